// SBI-GeMM core (DeepSpeed Inference III-C), shared by sbi_gemv.cu and fused_norm_gemv.cu:
//   y[t, c] = epilogue(sum_k x[t, k] W[c, k])   for t < T <= MAX_TOKENS (1 .. 16 tokens), c < ncols.
//
// Weight layout ("SBI layout", made once at load by hpcinfer.kernels.layout.sbi_pack): W [out, in] is stored as
//   Wp[kv, c, i] = W[c, kv * VEC + i]   shape [ceil(in / VEC), out, VEC], zero where kv * VEC + i >= in,
// with VEC = 16 / sizeof(storage_t) (8 for half / bfloat16, 4 for float): the VEC consecutive input elements of one
// output column are one 16-byte vector, and the 32 lanes of a warp, on 32 consecutive columns, read 512 contiguous
// bytes (four full 128-byte lines) per load: the paper's transposed layout.
// W_ROWMAJOR=1 reads W [out, in] as stored instead (contiguous, in % VEC == 0, 16-byte aligned): it spares a second
// copy of a weight that cuBLAS also reads for large batches. Under the column tiling the lanes then read at stride
// `in` (each lane's 16 bytes half a 32-byte sector); the row tiling below reads it fully coalesced.
//
// Tiling, TILING=1 (rows; what backend/cupy_sbi.plan launches by default; needs W_ROWMAJOR=1): warp w of block b
// owns the RW consecutive output columns c0 = (b WARPS + w) RW .. c0 + RW - 1, i.e. RW rows of W (GATED: the RW gate
// rows and the matching RW up rows, NR = 2 RW rows). Its 32 lanes walk the input dimension in 16-byte vectors (lane
// l reads vectors l, l + 32, ...), so one warp load is 512 contiguous bytes of one row: 4 full 128-byte lines, where
// the column tiling's row-major load touched 32 rows (32 sectors, half of each used). Each lane keeps UNROLL x NR
// such loads in flight (a batch) and accumulates float32 acc[r][t] for its rows and every token; at the end one
// warp-shuffle sum per (row, token) and the epilogue, written by one lane each. No block-level reduction, and the
// grid is ceil(ncols / (WARPS RW)) blocks: with 4 to 6 columns per block, out >= 1600 gives >= 2 blocks per SM of
// 132 with no input split, so the common case is one kernel (the column tiling's 32 columns per block needed
// splits and the *_reduce kernel, 12% of a gpt2-1.5b decode step). grid.y = SPLITS > 1 (the same partial +
// *_reduce path as below) remains for layers whose columns give fewer blocks than SMs (cupy_sbi.choose_splits).
// x: the block stages its x rows as float32 in shared memory, xs[MAX_TOKENS][X_TILE] (normalized there when NORM is
// fused), X_TILE elements per token at a time (the whole row when it fits: then the norm statistics come from
// shared memory too; else tile by tile, with the statistics from one pass over global x first). Each x vector is
// read from shared memory once per token and serves the lane's NR rows, instead of a global (L1/L2) read per
// weight vector per token; its halves are laid out so that a warp's 16-byte reads are conflict-free
// (sbi_xs_slot). The first batch of weight loads is issued before x is staged, so its latency hides the staging's.
// Static shared memory (MAX_TOKENS x X_TILE floats, at most 40 KiB): the kernels launch with no dynamic shared memory.
//
// Tiling, TILING=0 (cols; the header's default, for callers that compute its launch geometry): block (32, WARPS)
// owns TILE = 32 * ROWS output columns (lane l holds columns tile + r * 32 + l, r < ROWS); its warps split the input
// dimension (warp w takes vectors kv = w, w + WARPS, ...; UNROLL loads in flight), and grid.y = SPLITS splits it
// further across blocks for small models. Each lane accumulates, in float32 registers, its columns for every token.
// Reduction over the block's warps: the partial sums go to shared memory transposed (partials of one column
// contiguous) and one warp per column sums them with shuffles in registers; the results, contiguous in shared
// memory, are written out coalesced after the epilogue. With SPLITS > 1 the block writes raw float32 sums to
// `partial` [SPLITS, T, out] instead, and the *_reduce kernel sums the splits in order (a deterministic second
// reduction) and applies the epilogue. Kept to compare the two on a GPU (bench/gpu_linear.py --tiling).
//
// Epilogue (in this order, all in float32): + bias[c] (HAS_BIAS) -> activation ACT -> + residual[t, c]
// (HAS_RESIDUAL, Deep-Fusion region 4). GATED: W holds 2 F columns (gate rows first, then up rows, as the fused
// gate/up projection is stored); ncols = F and y[t, f] = act(gate + bias[f]) * (up + bias[F + f]) (+ residual).
//
// x: [T, in] rows ldx elements apart. X_VEC=1 (default) reads x in vectors of VEC (rows: 4) elements: the wrapper must
// ensure x is 16-byte aligned and ldx * sizeof(act_t) is a multiple of 16 (a multiple of 8 suffices when
// VEC * sizeof(act_t) is 8); X_VEC=0 reads element-wise (any alignment, any in).
#pragma once
#include "gemm_epilogue.cuh"

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
#ifndef X_VEC
#define X_VEC 1
#endif
#ifndef W_ROWMAJOR
#define W_ROWMAJOR 0
#endif
#ifndef TILING
#define TILING 0   // 0: columns across lanes (the launch geometry of older callers); 1: rows per warp
#endif
#ifndef RW
#define RW 1       // TILING=1: output columns (weight rows; GATED: gate and up rows) per warp
#endif

#define VEC (16 / (int)sizeof(storage_t))   // input elements per 16-byte weight vector
#define TILE (32 * ROWS)                     // TILING=0: output columns per block
#if TILING
#define NR (RW * (GATED ? 2 : 1))            // weight rows per warp
#define XS_FLOATS 8192                       // default shared x staging: 32 KiB
#define XS_UNIT (32 * UNROLL * VEC)          // x elements of one batch of warp loads (32 lanes x UNROLL vectors)
#ifndef X_TILE                               // x elements per token per staged tile: whole batches
#define X_TILE (XS_FLOATS / MAX_TOKENS >= XS_UNIT ? XS_FLOATS / MAX_TOKENS / XS_UNIT * XS_UNIT : XS_UNIT)
#endif
#define XS_TILE_V (X_TILE / VEC)             // 16-byte weight vectors per staged tile
#else
#define NR (ROWS * (GATED ? 2 : 1))          // weight columns per lane
#endif

static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be 1 .. 32");
static_assert(MAX_TOKENS >= 1 && MAX_TOKENS <= 32, "MAX_TOKENS must be 1 .. 32");
#if TILING
static_assert(W_ROWMAJOR, "the row tiling reads W [out, in] as stored: TILING=1 needs W_ROWMAJOR=1");
static_assert(RW >= 1 && UNROLL >= 1, "RW and UNROLL must be at least 1");
static_assert(X_TILE % XS_UNIT == 0, "X_TILE must be a whole number of batches (32 * UNROLL * VEC elements)");
static_assert(MAX_TOKENS * X_TILE * 4 <= 40 * 1024, "the staged x tile exceeds 40 KiB of shared memory");
#endif

// The block's sums of output column c for token t (u: the up row's, GATED): raw into partial[blockIdx.y, t] when
// the input is split (grid.y > 1: the *_reduce kernel finishes), else through the epilogue into y.
__device__ __forceinline__ void sbi_store(int c, int t, float g, float u, int T, int out, const float* bias,
                                          const act_t* residual, act_t* y, float* partial, long long ldr,
                                          long long ldy) {
    const int ncols = GATED ? out / 2 : out;
    if (gridDim.y > 1) {
        float* p = partial + ((long long)blockIdx.y * T + t) * out;
        p[c] = g;
        if (GATED) p[ncols + c] = u;
    } else {
        y[(long long)t * ldy + c] = from_float<act_t>(sbi_epilogue(c, t, g, u, ncols, bias, residual, ldr));
    }
}

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
            if (k < in) xf[i] = sbi_norm_value<NormKind, NormBias>(xf[i], k, mean, rstd, na);
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

// The VEC weights of one 16-byte vector as float.
__device__ __forceinline__ void sbi_unpack_w(const uint4& raw, float (&wf)[VEC]) {
    const storage_t* e = reinterpret_cast<const storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) wf[i] = to_float(e[i]);
}

// TILING=0: the column tiling (lanes across output columns, warps across the input); see the header comment.
template <int NormKind, bool NormBias>
__device__ __forceinline__ void sbi_body_cols(const act_t* x, const storage_t* w, const float* bias,
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
                for (int r = 0; r < NR; ++r) sbi_unpack_w(wr[u][r], wf[r]);
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
        sbi_store(c, t, g, u, T, out, bias, residual, y, partial, ldr, ldy);
    }
}

// ---- TILING=1: the row tiling ----------------------------------------------------------------------------------
#if TILING
// Where x[t, k0 + 4 q .. k0 + 4 q + 3] of a staged tile (k0 its first element) lives in xs[t]: the float4 slot
// h * XS_TILE_V + v, v = 4 q / VEC the tile's vector and h = (4 q % VEC) / 4 its half (fp16/bf16 weights: VEC = 8,
// two halves). A lane reading half h of its vector reads slot h * XS_TILE_V + lane: a warp's load is 512 contiguous
// bytes, free of bank conflicts (32-byte vectors side by side would make every 16-byte load a two-way conflict).
__device__ __forceinline__ int sbi_xs_slot(int q) { return ((4 * q) % VEC / 4) * XS_TILE_V + 4 * q / VEC; }

// Four elements x[t, k .. k + 3] as float (X_VEC=1: one 16-byte, or 8-byte, load; k is a multiple of 4).
__device__ __forceinline__ float4 sbi_load_x4(const act_t* p) {
    float f[4];
#if X_VEC
    load_vec<act_t, 4>(p, f);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = to_float(p[i]);
#endif
    return make_float4(f[0], f[1], f[2], f[3]);
}

// The raw rows x[t, VEC kv0 .. VEC kv1) for t < T into xs (as float, sbi_xs_slot order), four elements a thread and
// STAGE_LOADS loads in flight per thread (the tile comes from L2: latency, not bandwidth, bounds it); the whole block.
#define STAGE_LOADS 4
__device__ __forceinline__ void sbi_stage_x(const act_t* x, int T, long long ldx, int kv0, int kv1,
                                            float4 (*xs)[X_TILE / 4]) {
    const int tid = threadIdx.x + 32 * threadIdx.y;
    const int quads = (kv1 - kv0) * VEC / 4, n = T * quads;
    for (int e0 = tid; e0 < n; e0 += 32 * WARPS * STAGE_LOADS) {
        float4 f[STAGE_LOADS];
#pragma unroll
        for (int j = 0; j < STAGE_LOADS; ++j) {
            const int e = e0 + j * 32 * WARPS;
            if (e < n) f[j] = sbi_load_x4(x + (long long)(e / quads) * ldx + kv0 * VEC + 4 * (e % quads));
        }
#pragma unroll
        for (int j = 0; j < STAGE_LOADS; ++j) {
            const int e = e0 + j * 32 * WARPS;
            if (e < n) xs[e / quads][sbi_xs_slot(e % quads)] = f[j];
        }
    }
}

// norm(x) in place on the staged tile whose first element is k0 (Deep-Fusion regions 1 and 3); the whole block.
template <int NormKind, bool NormBias>
__device__ __forceinline__ void sbi_normalize_xs(float4 (*xs)[X_TILE / 4], int T, int k0, int quads,
                                                 const float* mean_s, const float* rstd_s, const NormArgs& na) {
    const int tid = threadIdx.x + 32 * threadIdx.y;
    for (int e = tid; e < T * quads; e += 32 * WARPS) {
        const int t = e / quads, q = e % quads;
        float* f = reinterpret_cast<float*>(&xs[t][sbi_xs_slot(q)]);
        const float mean = mean_s[t], rstd = rstd_s[t];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[i] = sbi_norm_value<NormKind, NormBias>(f[i], k0 + 4 * q + i, mean, rstd, na);
        }
    }
}

// One batch of weight loads: the vectors kv + 32 u (u < UNROLL) of the warp's NR rows, zero past kv_end or ncols.
__device__ __forceinline__ void sbi_load_rows(uint4 (&wr)[UNROLL][NR], const uint4* const (&wrow)[NR],
                                              const bool (&ok)[NR], int kv, int kv_end) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int r = 0; r < NR; ++r)
            wr[u][r] = (kv + 32 * u < kv_end && ok[r]) ? __ldg(wrow[r] + kv + 32 * u) : make_uint4(0, 0, 0, 0);
}

// acc[r][t] += W[row r, vector kv] . x[t, vector kv] for the batch loaded by sbi_load_rows: each x vector, read once
// from shared memory per token, serves the NR rows.
__device__ __forceinline__ void sbi_fma_rows(float (&acc)[NR][MAX_TOKENS], const uint4 (&wr)[UNROLL][NR],
                                             const float4 (*xs)[X_TILE / 4], int T, int kv, int kv_end, int tile0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        if (kv + 32 * u >= kv_end) continue;
        const int v = kv + 32 * u - tile0;   // the vector's place in the staged tile
        float wf[NR][VEC];
#pragma unroll
        for (int r = 0; r < NR; ++r) sbi_unpack_w(wr[u][r], wf[r]);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= T) break;
            float xf[VEC];
#pragma unroll
            for (int h = 0; h < VEC / 4; ++h) {
                const float4 q = xs[t][h * XS_TILE_V + v];
                xf[4 * h] = q.x;
                xf[4 * h + 1] = q.y;
                xf[4 * h + 2] = q.z;
                xf[4 * h + 3] = q.w;
            }
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[r][t] += wf[r][i] * xf[i];
        }
    }
}

// TILING=1: warp w of block b owns the RW output columns c0 = (b WARPS + w) RW ...; its lanes walk the input in
// 16-byte vectors (lane l: vectors l, l + 32, ...), UNROLL x NR loads in flight, x staged in shared memory by tiles
// of X_TILE elements per token; one shuffle reduction per (row, token) at the end. See the header comment.
template <int NormKind, bool NormBias>
__device__ __forceinline__ void sbi_body_rows(const act_t* x, const storage_t* w, const float* bias,
                                              const act_t* residual, act_t* y, float* partial, int T, int in,
                                              int out, long long ldx, long long ldr, long long ldy,
                                              const NormArgs& na) {
    __shared__ float4 xs[MAX_TOKENS][X_TILE / 4];   // x[t, tile] as float (normalized when NORM is fused)
    __shared__ float mean_s[MAX_TOKENS];
    __shared__ float rstd_s[MAX_TOKENS];

    const int lane = threadIdx.x;
    const int ncols = GATED ? out / 2 : out;
    const int c0 = (blockIdx.x * WARPS + threadIdx.y) * RW;
    const int kvecs = in / VEC;                                           // row-major: in % VEC == 0
    const int splits = gridDim.y;
    const int per_split = ((kvecs + splits - 1) / splits + 31) / 32 * 32;   // whole 512-byte warp loads
    const int kv_begin = min(kvecs, (int)blockIdx.y * per_split);
    const int kv_end = min(kvecs, kv_begin + per_split);
    if (T > MAX_TOKENS) return;   // precondition (the wrapper picks a module with MAX_TOKENS >= T)

    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const uint4* wrow[NR];
    bool ok[NR];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        ok[r] = c0 + r < ncols;
        wrow[r] = wv + (long long)(ok[r] ? c0 + r : 0) * kvecs;
#if GATED
        ok[RW + r] = ok[r];
        wrow[RW + r] = wv + (long long)(ok[r] ? ncols + c0 + r : 0) * kvecs;   // the up row of the same output
#endif
    }
    float acc[NR][MAX_TOKENS] = {};   // float32 sums of the lane's share, per (row, token)

    // The first batch of weights does not need x: it is in flight while x (and its norm statistics) load.
    uint4 wr[UNROLL][NR];
    sbi_load_rows(wr, wrow, ok, kv_begin + lane, kv_end);
    const bool whole_row = kv_begin == 0 && kv_end == kvecs && kvecs <= XS_TILE_V;   // one tile holds all of x
    if constexpr (NormKind != NORM_NONE) {
        if (!whole_row)
            sbi_row_stats<NormKind>(T, in, na.eps, [&](int t, int q) { return sbi_load_x4(x + t * ldx + 4 * q); },
                                    mean_s, rstd_s);
    }
    int tile0 = kv_begin, tile1 = kv_begin;   // the staged tile [tile0, tile1) (vectors)
    for (int kv = kv_begin; kv < kv_end; kv += 32 * UNROLL) {   // block-uniform: every warp syncs at each tile
        if (kv != kv_begin) sbi_load_rows(wr, wrow, ok, kv + lane, kv_end);
        if (kv == tile1) {   // XS_TILE_V is a whole number of batches: a batch never straddles two tiles
            tile0 = kv;
            tile1 = min(kv_end, kv + XS_TILE_V);
            __syncthreads();   // every warp is done with the previous tile; mean_s / rstd_s are written
            sbi_stage_x(x, T, ldx, tile0, tile1, xs);
            if constexpr (NormKind != NORM_NONE) {
                __syncthreads();
                if (whole_row) {
                    sbi_row_stats<NormKind>(T, in, na.eps, [&](int t, int q) { return xs[t][sbi_xs_slot(q)]; },
                                            mean_s, rstd_s);
                    __syncthreads();
                }
                sbi_normalize_xs<NormKind, NormBias>(xs, T, tile0 * VEC, (tile1 - tile0) * VEC / 4, mean_s, rstd_s,
                                                     na);
            }
            __syncthreads();
        }
        sbi_fma_rows(acc, wr, xs, T, kv + lane, kv_end, tile0);
    }

    // Sum over the lanes; lane (r MAX_TOKENS + t) % 32 writes (row r, token t): the epilogue, or the raw split sum.
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t >= T) break;
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const float g = warp_sum(acc[r][t]);
#if GATED
            const float u = warp_sum(acc[RW + r][t]);
#else
            const float u = 0.0f;
#endif
            const int c = c0 + r;
            if (lane == (r * MAX_TOKENS + t) % 32 && c < ncols)
                sbi_store(c, t, g, u, T, out, bias, residual, y, partial, ldr, ldy);
        }
    }
}

#endif   // TILING

template <int NormKind, bool NormBias>
__device__ __forceinline__ void sbi_body(const act_t* x, const storage_t* w, const float* bias,
                                         const act_t* residual, act_t* y, float* partial, int T, int in, int out,
                                         long long ldx, long long ldr, long long ldy, const NormArgs& na) {
#if TILING
    sbi_body_rows<NormKind, NormBias>(x, w, bias, residual, y, partial, T, in, out, ldx, ldr, ldy, na);
#else
    sbi_body_cols<NormKind, NormBias>(x, w, bias, residual, y, partial, T, in, out, ldx, ldr, ldy, na);
#endif
}

