// Tensor-core small-batch GEMM core, shared by tc_gemm.cu (float16 / bfloat16 weights) and tc_quant_gemm.cu (int8 /
// int4 weights dequantized in registers):
//   y[t, c] = epilogue(sum_k norm(x)[t, k] W[c, k])   for t < T <= MAX_TOKENS (2 .. 64 tokens), c < ncols.
//
// The weights are the mma's A operand (M = 16 output rows per m-tile, K = 16) and the tokens its B operand (N = 8
// tokens per n-tile): W [out, in] row-major is A row-major as stored, and x [T, in] row-major is B "col" as stored,
// so neither needs a transpose and a step of 2 .. 8 tokens wastes only the idle columns of B, never weight bytes.
// mma.sync.m16n8k16 with float32 accumulation (tc_mma.cuh), every weight byte read once.
//
// Block (32, WARPS); warp w of block b owns MT m-tiles, output columns c0 = (b WARPS + w) 16 MT .. + 16 MT - 1
// (GATED: the MT gate tiles and the MT matching up tiles, rows ncols + c0 ...; NRT = m-tiles per warp), and walks the
// block's share of the input in stages of KS = 64 elements. grid.y = SPLITS splits the input into whole stages
// (split-K, for layers whose columns alone give too few blocks): each block then writes its raw float32 sums to
// `partial` [SPLITS, T, out] and the *_reduce kernel adds the splits in split order and applies the epilogue, so the
// sum's order is fixed by the launch alone (no atomics): the same inputs give the same bits on every run.
//
// x: the block stages XK input elements of every token at a time in shared memory as the mma's 16-bit type
// (normalized first when NORM is fused), tokens T .. MAX_TOKENS - 1 and columns past the block's range as zeros.
// XSPLIT=1 (default) keeps it as hi + lo, two 16-bit numbers whose sum is x to about 2^-22 (f16) or 2^-16 (bf16)
// relative, and runs the mma on both: the float32 activations keep their precision (as the SBI GEMV's float32
// products do) at twice the tensor-core work, which is idle at these sizes; XSPLIT=0 rounds x to 16 bits once.
// Shared-memory rows are 128-byte (8 chunk) groups whose 16-byte chunks are XOR-swizzled by row (chunk ^ row % 8), so
// that each ldmatrix phase (8 rows of one chunk column) hits 8 distinct bank groups.
//
// Norm prologue (NORM 1 RMSNorm, 2 LayerNorm): every block computes the T rows' statistics from global x (one warp
// per row, as sbi_row_stats), then normalizes x as it stages it. Epilogue: gemm_epilogue.cuh (bias, activation,
// gate * up, residual), float32, as the SBI GEMV's.
#pragma once
#include "gemm_epilogue.cuh"
#include "tc_mma.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#ifndef MT
#define MT 1                 // m-tiles (16 output columns) per warp
#endif
#ifndef MAX_TOKENS
#define MAX_TOKENS 8         // 8, 16, 32 or 64: n-tiles of 8 tokens
#endif
#ifndef STAGES
#define STAGES 4             // weight stages in flight per warp (cp.async groups)
#endif
#ifndef XK
#define XK 256               // x elements per token staged at a time (a multiple of KS)
#endif
#ifndef XSPLIT
#define XSPLIT 1
#endif
#ifndef NORM
#define NORM NORM_NONE
#endif
#ifndef NORM_BIAS
#define NORM_BIAS 1
#endif

#define KS 64                           // input elements per weight stage: one 128-byte row chunk group
#define NT (MAX_TOKENS / 8)             // n-tiles
#define NRT (MT * (GATED ? 2 : 1))      // m-tiles of weight rows per warp
#define BCOLS (WARPS * 16 * MT)         // output columns per block
#define XS_BYTES (MAX_TOKENS * XK * 2 * (XSPLIT ? 2 : 1))

typedef T_STORAGE mma_t;                // the mma's 16-bit input type (tc_quant_gemm: what W is dequantized to)
static_assert(sizeof(mma_t) == 2, "the tensor-core GEMM takes __half or __nv_bfloat16 (T_STORAGE)");
static_assert(MAX_TOKENS == 8 || MAX_TOKENS == 16 || MAX_TOKENS == 32 || MAX_TOKENS == 64,
              "MAX_TOKENS must be 8, 16, 32 or 64");
static_assert(XK % KS == 0 && XK >= KS, "XK must be a whole number of 64-element stages");
static_assert(STAGES >= 2 && WARPS >= 1 && WARPS <= 16 && MT >= 1, "STAGES >= 2, 1 <= WARPS <= 16, MT >= 1");
static_assert(NORM == NORM_NONE || NORM == NORM_RMS || NORM == NORM_LAYER, "NORM must be 0, 1 or 2");

// The byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile with `row_chunks` chunks per row.
__device__ __forceinline__ int tc_swizzle(int row, int chunk, int row_chunks) {
    return (row * row_chunks + ((chunk & ~7) | ((chunk ^ row) & 7))) * 16;
}

// x[t, k] as the hi (+ lo) 16-bit pair, the rest of the tile zero. One tile: xs_hi [MAX_TOKENS][XK] (+ xs_lo).
struct XTile {
    unsigned char hi[MAX_TOKENS * XK * 2];
#if XSPLIT
    unsigned char lo[MAX_TOKENS * XK * 2];
#endif
};

// Stage x[t, k0 .. k0 + XK) for every token (zero past T and past k_end), normalized when NORM is fused; the
// whole block, between two __syncthreads of the caller.
__device__ __forceinline__ void tc_stage_x(XTile& xs, const act_t* x, int T, long long ldx, int k0, int k_end,
                                           const float* mean_s, const float* rstd_s, const NormArgs& na) {
    const int tid = threadIdx.x + 32 * threadIdx.y;
    constexpr int row_chunks = XK / 8;
    for (int e = tid; e < MAX_TOKENS * row_chunks; e += 32 * WARPS) {
        const int t = e / row_chunks, chunk = e % row_chunks, k = k0 + 8 * chunk;
        mma_t hi[8], lo[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float v = 0.0f;
            if (t < T && k + i < k_end) {
                v = to_float(x[(long long)t * ldx + k + i]);
#if NORM != NORM_NONE
                v = sbi_norm_value<NORM, NORM == NORM_LAYER && NORM_BIAS>(v, k + i, mean_s[t], rstd_s[t], na);
#endif
            }
            hi[i] = from_float<mma_t>(v);
            lo[i] = from_float<mma_t>(v - to_float(hi[i]));
        }
        const int off = tc_swizzle(t, chunk, row_chunks);
        memcpy(xs.hi + off, hi, 16);
#if XSPLIT
        memcpy(xs.lo + off, lo, 16);
#endif
    }
}

// The B fragments of n-tile j for the two k-steps of chunks kc .. kc + 3 of the staged tile (ldmatrix x4: matrix
// m = lane / 8 is tokens 8 j .. 8 j + 7 at chunk kc + m): b[0..1] k-step kc / 2, b[2..3] the next.
__device__ __forceinline__ void tc_load_b(unsigned (&b)[4], const unsigned char* tile, int j, int kc) {
    const int lane = threadIdx.x;
    tc_ldmatrix_x4(b, tile + tc_swizzle(8 * j + lane % 8, kc + lane / 8, XK / 8));
}

// acc[i][j] += A_i B_j over the two k-steps at chunk kc of the staged x tile (a[i][s]: m-tile i, k-step s).
__device__ __forceinline__ void tc_mma_tiles(float (&acc)[NRT][NT][4], const unsigned (&a)[NRT][2][4],
                                             const XTile& xs, int T, int kc) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        if (8 * j >= T) break;   // warp-uniform: idle n-tiles
        unsigned bh[4];
        tc_load_b(bh, xs.hi, j, kc);
#if XSPLIT
        unsigned bl[4];
        tc_load_b(bl, xs.lo, j, kc);
#endif
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const unsigned bhs[2] = {bh[2 * s], bh[2 * s + 1]};
#if XSPLIT
            const unsigned bls[2] = {bl[2 * s], bl[2 * s + 1]};
#endif
#pragma unroll
            for (int i = 0; i < NRT; ++i) {
                tc_mma(acc[i][j], a[i][s], bhs, mma_t());
#if XSPLIT
                tc_mma(acc[i][j], a[i][s], bls, mma_t());
#endif
            }
        }
    }
}

// acc[i][j] += A_i B_j over the one k-step at chunk kc of the staged x tile (ldmatrix x2: chunks kc, kc + 1), and,
// with XSum, xsum[j] += ones B_j: every row of it the sum of token t's x over the k-step (tc_quant_gemm's minimums).
template <bool XSum>
__device__ __forceinline__ void tc_mma_step(float (&acc)[NRT][NT][4], const unsigned (&a)[NRT][4], const XTile& xs,
                                            int T, int kc, float (&xsum)[NT][4]) {
    const int lane = threadIdx.x;
    const unsigned one = tc_pack2(from_float<mma_t>(1.0f), from_float<mma_t>(1.0f));
    const unsigned ones[4] = {one, one, one, one};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        if (8 * j >= T) break;   // warp-uniform: idle n-tiles
        const int off = tc_swizzle(8 * j + lane % 8, kc + (lane / 8) % 2, XK / 8);
        unsigned bh[2];
        tc_ldmatrix_x2(bh, xs.hi + off);
#if XSPLIT
        unsigned bl[2];
        tc_ldmatrix_x2(bl, xs.lo + off);
#endif
#pragma unroll
        for (int i = 0; i < NRT; ++i) {
            tc_mma(acc[i][j], a[i], bh, mma_t());
#if XSPLIT
            tc_mma(acc[i][j], a[i], bl, mma_t());
#endif
        }
        if constexpr (XSum) {
            tc_mma(xsum[j], ones, bh, mma_t());
#if XSPLIT
            tc_mma(xsum[j], ones, bl, mma_t());
#endif
        }
    }
}

// The warp's sums out: raw into partial[blockIdx.y] when the input is split (grid.y > 1), else through the epilogue
// into y. acc[i][j][r]: m-tile i row g + 8 (r / 2), token 8 j + 2 q + r % 2 (tc_mma.cuh's C layout).
__device__ __forceinline__ void tc_store(const float (&acc)[NRT][NT][4], int c0, int T, int out, const float* bias,
                                         const act_t* residual, act_t* y, float* partial, long long ldr,
                                         long long ldy) {
    const int lane = threadIdx.x, g = lane / 4, q = lane % 4;
    const int ncols = GATED ? out / 2 : out;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int c = c0 + 16 * i + g + 8 * (r / 2), t = 8 * j + 2 * q + r % 2;
                if (t >= T || c >= ncols) continue;
                const float gsum = acc[i][j][r];
                const float usum = GATED ? acc[NRT - MT + i][j][r] : 0.0f;
                if (gridDim.y > 1) {
                    float* p = partial + ((long long)blockIdx.y * T + t) * out;
                    p[c] = gsum;
                    if (GATED) p[ncols + c] = usum;
                } else {
                    y[(long long)t * ldy + c] = from_float<act_t>(sbi_epilogue(c, t, gsum, usum, ncols, bias,
                                                                               residual, ldr));
                }
            }
}

// The block's input range [k_begin, k_end) under SPLITS = gridDim.y: whole stages of KS elements.
__device__ __forceinline__ void tc_split_range(int in, int& k_begin, int& k_end) {
    const int stages = (in + KS - 1) / KS;
    const int per_split = (stages + gridDim.y - 1) / gridDim.y * KS;
    k_begin = min(in, (int)blockIdx.y * per_split);
    k_end = min(in, k_begin + per_split);
}

// Row statistics for the fused norm (the whole block; ends with __syncthreads).
__device__ __forceinline__ void tc_norm_stats(const act_t* x, int T, int in, long long ldx, float eps,
                                              float* mean_s, float* rstd_s) {
#if NORM != NORM_NONE
    sbi_row_stats<NORM>(T, in, eps, [&](int t, int q) {
        const act_t* p = x + (long long)t * ldx + 4 * q;
        return make_float4(to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3]));
    }, mean_s, rstd_s);
#endif
    __syncthreads();
}

// Second reduction when SPLITS > 1 (the *_reduce kernels): gemm_epilogue.cuh's sbi_reduce_body, split order.
