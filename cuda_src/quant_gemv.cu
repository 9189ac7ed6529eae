// Quantized small-batch GEMV (1 .. MAX_TOKENS tokens): y[T, out] = x[T, in] @ W^T (+ bias), W read as int8 / int4
// and dequantized in registers, never as a float copy in device memory. Reference: NumpyOps.linear_q.
// Format, layout and defines of the weight: quant_core.cuh. The tiling, the two reductions and the epilogue follow
// sbi_core.cuh (SBI-GeMM) with 16-byte vectors of QVEC = 16 (8-bit) or 32 (4-bit) input elements:
//   block (32, WARPS) owns TILE = 32 * ROWS output columns (lane l: columns tile + r * 32 + l, r < ROWS); warp w
//   takes the vectors kv = w, w + WARPS, ... of its block's split of the input (UNROLL 16-byte loads in flight per
//   column), grid.y = SPLITS splits the input across blocks. Per vector a lane loads its column's group scale (and
//   min), decodes the QVEC values into float32 registers once (quant_decode) and accumulates them against every
//   token's x in float32. The warps' partial sums meet in shared memory (transposed), one warp per column sums them
//   with shuffles, and the results are written coalesced after the epilogue (+ bias[c] when HAS_BIAS, float32).
//   With SPLITS > 1 blocks write raw float32 sums to `partial` [SPLITS, T, out] and quant_gemv_reduce sums the
//   splits in order (deterministic) and applies the epilogue.
//
// kernel quant_gemv(const act_t* x, const unsigned char* q, const float* scale, const float* mn, const float* bias,
//                   act_t* y, float* partial, int T, int in, int out, long long ldx, long long ldy)
//   x        [T, in] rows ldx apart (T <= MAX_TOKENS; more writes nothing)
//   q        quant layout [ceil(B / 16), out, 16] bytes (B = in * QBITS / 8), 16-byte aligned
//   scale    [G, out] float32; mn [G, out] float32 (HAS_MIN; else unused)
//   bias     [out] float32 (HAS_BIAS)
//   y        [T, out] rows ldy apart; partial [SPLITS, T, out] float32, used only when grid.y > 1
//   Unused pointers may be anything (numpy.uint64(0)).
// Launch: grid (ceil(out / (32 * ROWS)), SPLITS), block (32, WARPS); no dynamic shared memory.
//
// kernel quant_gemv_reduce(const float* partial, const float* bias, act_t* y, int T, int out, int splits,
//                          long long ldy)
//   y[t, c] = sum over s of partial[s, t, c] (+ bias[c]). Launch: grid (ceil(T * out / 256)), block (256).
//
// Defines: QBITS, QSIGNED, HAS_MIN, GROUP (quant_core.cuh); T_ACT (x, y; default float via T_STORAGE);
// MAX_TOKENS (1), WARPS (4), ROWS (1), UNROLL (4), HAS_BIAS (0), X_VEC (1: x read in vectors of QVEC elements,
// which needs x 16-byte aligned and ldx * sizeof(act_t) a multiple of 16; 0: element-wise, any alignment).
#include "quant_core.cuh"

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
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef X_VEC
#define X_VEC 1
#endif

#define TILE (32 * ROWS)   // output columns per block

static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be 1 .. 32");
static_assert(MAX_TOKENS >= 1 && MAX_TOKENS <= 32, "MAX_TOKENS must be 1 .. 32");

// x[t, k0 .. k0 + QVEC - 1] as float, zero past `in` (which also zeroes the layout's padding bytes' values).
__device__ __forceinline__ void quant_load_x(const act_t* xr, int k0, int in, float (&xf)[QVEC]) {
#if X_VEC
    if (k0 + QVEC <= in) {
        load_vec<act_t, QVEC>(xr + k0, xf);
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < QVEC; ++i) xf[i] = k0 + i < in ? to_float(xr[k0 + i]) : 0.0f;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
quant_gemv(const act_t* x, const unsigned char* q, const float* scale, const float* mn, const float* bias,
           act_t* y, float* partial, int T, int in, int out, long long ldx, long long ldy) {
    __shared__ float red[WARPS][TILE + 1];   // +1: lane i reads row i of a column, conflict-free
    __shared__ float res[MAX_TOKENS][TILE];

    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane, nthreads = WARPS * 32;
    const int col0 = blockIdx.x * TILE;
    const int kvecs = (in + QVEC - 1) / QVEC;
    const int splits = gridDim.y;
    const int per_split = (kvecs + splits - 1) / splits;
    const int kv_begin = blockIdx.y * per_split;
    const int kv_end = min(kvecs, kv_begin + per_split);
    if (T > MAX_TOKENS) return;   // precondition (the wrapper picks a module with MAX_TOKENS >= T)

    int col[ROWS];
    bool ok[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        col[r] = col0 + r * 32 + lane;
        ok[r] = col[r] < out;
    }
    float acc[ROWS][MAX_TOKENS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) acc[r][t] = 0.0f;

    const uint4* qv = reinterpret_cast<const uint4*>(q);   // vector (kv, c) at qv[kv * out + c]
    for (int kv0 = kv_begin + warp; kv0 < kv_end; kv0 += WARPS * UNROLL) {
        uint4 wr[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kv = kv0 + u * WARPS;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                wr[u][r] = (kv < kv_end && ok[r]) ? __ldg(qv + (long long)kv * out + col[r]) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kv = kv0 + u * WARPS;
            if (kv < kv_end) {
                const long long g = (long long)quant_group(kv) * out;
                float wf[ROWS][QVEC];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const float s = ok[r] ? __ldg(scale + g + col[r]) : 0.0f;
                    const float m = (HAS_MIN && ok[r]) ? __ldg(mn + g + col[r]) : 0.0f;
                    quant_decode(wr[u][r], s, m, wf[r]);
                }
#pragma unroll
                for (int t = 0; t < MAX_TOKENS; ++t) {
                    if (t < T) {
                        float xf[QVEC];
                        quant_load_x(x + (long long)t * ldx, kv * QVEC, in, xf);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r)
#pragma unroll
                            for (int i = 0; i < QVEC; ++i) acc[r][t] += wf[r][i] * xf[i];
                    }
                }
            }
        }
    }

    gemv_reduce_warps<ROWS, MAX_TOKENS, WARPS>(acc, T, red, res);   // res[t][c]: the block's sums

    // Epilogue and coalesced store: consecutive threads take consecutive columns of one token.
    for (int e = tid; e < T * TILE; e += nthreads) {
        const int t = e / TILE, c = col0 + e % TILE;
        if (c >= out) continue;
        float v = res[t][e % TILE];
        if (splits > 1) {
            partial[((long long)blockIdx.y * T + t) * out + c] = v;
        } else {
#if HAS_BIAS
            v += bias[c];
#endif
            y[(long long)t * ldy + c] = from_float<act_t>(v);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
quant_gemv_reduce(const float* partial, const float* bias, act_t* y, int T, int out, int splits, long long ldy) {
    const long long n = (long long)T * out;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const int t = (int)(e / out), c = (int)(e % out);
    float v = 0.0f;
    for (int s = 0; s < splits; ++s) v += partial[((long long)s * T + t) * out + c];
#if HAS_BIAS
    v += bias[c];
#endif
    y[(long long)t * ldy + c] = from_float<act_t>(v);
}
