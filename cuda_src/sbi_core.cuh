// SBI-GeMM core (DeepSpeed Inference III-C), shared by sbi_gemv.cu and fused_norm_gemv.cu:
//   y[t, c] = epilogue(sum_k x[t, k] W[c, k])   for t < T <= MAX_TOKENS (1 .. 16 tokens), c < ncols.
//
// Weight layout ("SBI layout", made once at load by hpcinfer.kernels.layout.sbi_pack): W [out, in] is stored as
//   Wp[kv, c, i] = W[c, kv * VEC + i]   shape [ceil(in / VEC), out, VEC], zero where kv * VEC + i >= in,
// with VEC = 16 / sizeof(storage_t) (8 for half / bfloat16, 4 for float): the VEC consecutive input elements of one
// output column are one 16-byte vector, and the 32 lanes of a warp, on 32 consecutive columns, read 512 contiguous
// bytes (four full 128-byte lines) per load: the paper's transposed layout.
// W_ROWMAJOR=1 reads W [out, in] as stored instead (contiguous, in % VEC == 0, 16-byte aligned): the same vectors,
// at stride `in` between lanes, so each lane's 16 bytes are half a 32-byte sector and the line's other vectors are
// read by the block's next warps (L1 hits if the lines stay resident). It spares a second copy of a weight that
// cuBLAS also reads for large batches; which layout streams faster is for the GPU benchmark to say.
//
// Tiling: block (32, WARPS) owns TILE = 32 * ROWS output columns (lane l holds columns tile + r * 32 + l, r < ROWS);
// its warps split the input dimension (warp w takes vectors kv = w, w + WARPS, ...; UNROLL loads in flight), and
// grid.y = SPLITS splits it further across blocks for small models. Each lane accumulates, in float32 registers,
// its columns for every token. Reduction over the block's warps: the partial sums go to shared memory transposed
// (partials of one column contiguous) and one warp per column sums them with shuffles in registers; the results,
// contiguous in shared memory, are written out coalesced after the epilogue. With SPLITS > 1 the block writes raw
// float32 sums to `partial` [SPLITS, T, out] instead, and the *_reduce kernel sums the splits in order (a
// deterministic second reduction) and applies the epilogue.
//
// Epilogue (in this order, all in float32): + bias[c] (HAS_BIAS) -> activation ACT -> + residual[t, c]
// (HAS_RESIDUAL, Deep-Fusion region 4). GATED: W holds 2 F columns (gate rows first, then up rows, as the fused
// gate/up projection is stored); ncols = F and y[t, f] = act(gate + bias[f]) * (up + bias[F + f]) (+ residual).
//
// x: [T, in] rows ldx elements apart. X_VEC=1 (default) reads x in vectors of VEC elements: the wrapper must
// ensure x is 16-byte aligned and ldx * sizeof(act_t) is a multiple of 16 (a multiple of 8 suffices when
// VEC * sizeof(act_t) is 8); X_VEC=0 reads element-wise (any alignment, any in).
#pragma once
#include "common.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#ifndef ROWS
#define ROWS 1
#endif
#ifndef MAX_TOKENS
#define MAX_TOKENS 1
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef ACT
#define ACT ACT_NONE
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef HAS_RESIDUAL
#define HAS_RESIDUAL 0
#endif
#ifndef GATED
#define GATED 0
#endif
#ifndef X_VEC
#define X_VEC 1
#endif
#ifndef W_ROWMAJOR
#define W_ROWMAJOR 0
#endif

#define NORM_NONE 0
#define NORM_RMS 1
#define NORM_LAYER 2

#define VEC (16 / (int)sizeof(storage_t))   // input elements per 16-byte weight vector
#define NR (ROWS * (GATED ? 2 : 1))          // weight columns per lane
#define TILE (32 * ROWS)                     // output columns per block

static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be 1 .. 32");
static_assert(MAX_TOKENS >= 1 && MAX_TOKENS <= 32, "MAX_TOKENS must be 1 .. 32");
static_assert(!GATED || ACT != ACT_NONE, "GATED needs an activation");

// act(g + bias) (* (u + bias_up)) (+ residual), float32 in and out.
__device__ __forceinline__ float sbi_epilogue(int c, int t, float g, float u, int ncols, const float* bias,
                                              const act_t* residual, long long ldr) {
    float v = g;
#if HAS_BIAS
    v += bias[c];
#endif
#if GATED
    float up = u;
#if HAS_BIAS
    up += bias[ncols + c];
#endif
    v = activate<ACT>(v) * up;
#else
    v = activate<ACT>(v);
#endif
#if HAS_RESIDUAL
    v += to_float(residual[(long long)t * ldr + c]);
#endif
    return v;
}

// Per-token normalization of the GEMV input (Deep-Fusion regions 1 and 3): every block recomputes the statistics
// of all T rows (the paper's "broadcast the input batch across the SMs") and normalizes x as it reads it.
struct NormArgs {
    const float* gamma;   // [in] norm weight
    const float* beta;    // [in] norm bias (NORM_LAYER with NORM_BIAS only)
    float eps;
};

// x[t, k0 .. k0 + VEC - 1] as float, zero past `in`, normalized when NormKind != NORM_NONE.
template <int NormKind, bool NormBias>
__device__ __forceinline__ void sbi_load_x(const act_t* xr, int k0, int in, float mean, float rstd,
                                           const NormArgs& na, float (&xf)[VEC]) {
#if X_VEC
    if (k0 + VEC <= in) {
        load_vec<act_t, VEC>(xr + k0, xf);
    } else
#endif
    {
#pragma unroll
        for (int i = 0; i < VEC; ++i) xf[i] = k0 + i < in ? to_float(xr[k0 + i]) : 0.0f;
    }
    if constexpr (NormKind != NORM_NONE) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            const int k = k0 + i;
            if (k < in) {
                if constexpr (NormKind == NORM_RMS) {
                    xf[i] = xf[i] * rstd * na.gamma[k];
                } else {
                    float v = (xf[i] - mean) * rstd * na.gamma[k];
                    if constexpr (NormBias) v += na.beta[k];
                    xf[i] = v;
                }
            }
        }
    }
}

// Row statistics of x[t, :in] for every t < T into mean_s / rstd_s (shared); the whole block calls this.
template <int NormKind>
__device__ __forceinline__ void sbi_norm_stats(const act_t* x, int T, int in, long long ldx, float eps,
                                               float* mean_s, float* rstd_s, float* scratch) {
    const int tid = threadIdx.x + 32 * threadIdx.y, nthreads = 32 * WARPS;
    for (int t = 0; t < T; ++t) {
        const act_t* xr = x + (long long)t * ldx;
        float mean = 0.0f, sq = 0.0f;
        if constexpr (NormKind == NORM_LAYER) {
            float s = 0.0f;
            for (int k = tid; k < in; k += nthreads) s += to_float(xr[k]);
            mean = block_sum(s, scratch) / (float)in;
        }
        for (int k = tid; k < in; k += nthreads) {
            const float c = to_float(xr[k]) - mean;
            sq += c * c;
        }
        const float var = block_sum(sq, scratch) / (float)in;   // mean of squares for RMSNorm (mean = 0)
        if (tid == 0) {
            mean_s[t] = mean;
            rstd_s[t] = 1.0f / sqrtf(var + eps);
        }
    }
    __syncthreads();
}

template <int NormKind, bool NormBias>
__device__ __forceinline__ void sbi_body(const act_t* x, const storage_t* w, const float* bias,
                                         const act_t* residual, act_t* y, float* partial, int T, int in, int out,
                                         long long ldx, long long ldr, long long ldy, const NormArgs& na) {
    __shared__ float red[WARPS][NR * 32 + 1];   // +1: lane i reads row i of a column, conflict-free
    __shared__ float res[MAX_TOKENS][NR * 32];
    __shared__ float mean_s[MAX_TOKENS];
    __shared__ float rstd_s[MAX_TOKENS];
    __shared__ float scratch[32];

    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane, nthreads = WARPS * 32;
    const int ncols = GATED ? out / 2 : out;
    const int col0 = blockIdx.x * TILE;
    const int kvecs = (in + VEC - 1) / VEC;
    const int splits = gridDim.y;
    const int per_split = (kvecs + splits - 1) / splits;
    const int kv_begin = blockIdx.y * per_split;
    const int kv_end = min(kvecs, kv_begin + per_split);
    if (T > MAX_TOKENS) return;   // precondition (the wrapper picks a module with MAX_TOKENS >= T)

    if constexpr (NormKind != NORM_NONE) sbi_norm_stats<NormKind>(x, T, in, ldx, na.eps, mean_s, rstd_s, scratch);

    int col[NR];
    bool ok[NR];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        col[r] = col0 + r * 32 + lane;
        ok[r] = col[r] < ncols;
#if GATED
        col[ROWS + r] = col[r] + ncols;   // the up column of the same output
        ok[ROWS + r] = ok[r];
#endif
    }

    float acc[NR][MAX_TOKENS];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) acc[r][t] = 0.0f;

    // the 16-byte vector (kv, c): wv[kv * out + c] in the SBI layout, wv[c * (in / VEC) + kv] row-major
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const long long kv_stride = W_ROWMAJOR ? 1 : out;
    const long long col_stride = W_ROWMAJOR ? in / VEC : 1;
    for (int kv0 = kv_begin + warp; kv0 < kv_end; kv0 += WARPS * UNROLL) {
        uint4 wr[UNROLL][NR];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kv = kv0 + u * WARPS;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                wr[u][r] = (kv < kv_end && ok[r]) ? __ldg(wv + kv * kv_stride + col[r] * col_stride)
                                                  : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kv = kv0 + u * WARPS;
            if (kv < kv_end) {
                float wf[NR][VEC];
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    const storage_t* e = reinterpret_cast<const storage_t*>(&wr[u][r]);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) wf[r][i] = to_float(e[i]);
                }
#pragma unroll
                for (int t = 0; t < MAX_TOKENS; ++t) {
                    if (t < T) {
                        float xf[VEC];
                        float mean = 0.0f, rstd = 1.0f;
                        if constexpr (NormKind != NORM_NONE) {
                            mean = mean_s[t];
                            rstd = rstd_s[t];
                        }
                        sbi_load_x<NormKind, NormBias>(x + (long long)t * ldx, kv * VEC, in, mean, rstd, na, xf);
#pragma unroll
                        for (int r = 0; r < NR; ++r)
#pragma unroll
                            for (int i = 0; i < VEC; ++i) acc[r][t] += wf[r][i] * xf[i];
                    }
                }
            }
        }
    }

    gemv_reduce_warps<NR, MAX_TOKENS, WARPS>(acc, T, red, res);   // res[t][c]: the block's sums

    // Epilogue and coalesced store: consecutive threads take consecutive columns of one token.
    for (int e = tid; e < T * TILE; e += nthreads) {
        const int t = e / TILE, cl = e % TILE;
        const int c = col0 + cl;
        if (c >= ncols) continue;
        const float g = res[t][cl];
        const float u = GATED ? res[t][ROWS * 32 + cl] : 0.0f;
        if (splits > 1) {
            float* p = partial + ((long long)blockIdx.y * T + t) * out;
            p[c] = g;
            if (GATED) p[ncols + c] = u;
        } else {
            y[(long long)t * ldy + c] = from_float<act_t>(sbi_epilogue(c, t, g, u, ncols, bias, residual, ldr));
        }
    }
}

// Second reduction for SPLITS > 1: y[t, c] = epilogue(sum over s of partial[s, t, c]) (summed in split order).
// Launch: grid (ceil(T * ncols / 256)), block (256).
__device__ __forceinline__ void sbi_reduce_body(const float* partial, const float* bias, const act_t* residual,
                                                act_t* y, int T, int out, int splits, long long ldr, long long ldy) {
    const int ncols = GATED ? out / 2 : out;
    const long long n = (long long)T * ncols;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const int t = (int)(e / ncols), c = (int)(e % ncols);
    float g = 0.0f, u = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float* p = partial + ((long long)s * T + t) * out;
        g += p[c];
        if (GATED) u += p[ncols + c];
    }
    y[(long long)t * ldy + c] = from_float<act_t>(sbi_epilogue(c, t, g, u, ncols, bias, residual, ldr));
}
