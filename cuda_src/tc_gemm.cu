// Tensor-core GEMM for small batches (2 .. 64 tokens): y[T, ncols] = epilogue(norm(x)[T, in] @ W^T), W [out, in]
// float16 or bfloat16 as stored (row-major, no re-layout), streamed once. The design (operand roles, tiling,
// split-K, x staging, swizzle, prologue and epilogue) is in tc_core.cuh. Reference: NumpyOps.linear /
// fused_linear (norm, bias, activation, gate * up, residual).
// Weights: each warp streams its NRT x 16 rows through STAGES shared-memory stages of 64 elements (128 bytes a row)
// with cp.async.cg (L2 only, 16 bytes a lane, 8 lanes per row: a warp instruction reads 4 whole 128-byte lines),
// STAGES - 1 stages in flight while it computes on one; the A fragments come from the stage by ldmatrix x4.
// Only the warp reads its stages, so a __syncwarp (not a block barrier) separates a stage's arrival, its reads and
// its refill; the block synchronizes only to stage x.
//
// kernel tc_gemm(const act_t* x, const float* gamma, const float* beta, float eps, const mma_t* w, const float* bias,
//                const act_t* residual, act_t* y, float* partial, int T, int in, int out, long long ldx,
//                long long ldr, long long ldy)
//   x        [T, in] rows ldx apart (float32 in the CuPy backend), 2 <= T <= MAX_TOKENS (more: writes nothing)
//   gamma    [in] float32 norm weight, beta [in] norm bias (NORM = 2 with NORM_BIAS); unused without NORM
//   w        [out, in] T_STORAGE row-major, 16-byte aligned, in % 16 == 0
//   bias     [out] float32 (HAS_BIAS; GATED: the F gate biases, then the F up biases)
//   residual [T, ncols] rows ldr apart (HAS_RESIDUAL; may be y itself)
//   y        [T, ncols] rows ldy apart, ncols = out (out / 2 when GATED: gate rows first, then up rows)
//   partial  [SPLITS, T, out] float32, written instead of y when grid.y = SPLITS > 1
// Launch: grid (ceil(ncols / (16 WARPS MT)), SPLITS), block (32, WARPS); static shared memory only.
// kernel tc_gemm_reduce(const float* partial, const float* bias, const act_t* residual, act_t* y, int T, int out,
//                       int splits, long long ldr, long long ldy)
//   y = epilogue(sum over s in order of partial[s]) when SPLITS > 1. Launch: grid (ceil(T ncols / 256)), block (256).
//
// Defines: T_STORAGE (__half | __nv_bfloat16), T_ACT (float), MAX_TOKENS (8 | 16 | 32 | 64), WARPS (4), MT (1),
// STAGES (4), XK (256), XSPLIT (1), NORM (0), NORM_BIAS (1), ACT, HAS_BIAS, HAS_RESIDUAL, GATED (0).
#ifndef T_STORAGE                       // the tensor cores take 16-bit inputs: __half unless told (common.cuh's
#define T_STORAGE __half                // float default would not compile here)
#endif
#ifndef T_ACT
#define T_ACT float
#endif
#include "tc_core.cuh"

#define W_STAGE_BYTES (NRT * 16 * KS * 2)   // one warp's stage: NRT m-tiles x 16 rows x 128 bytes
static_assert(WARPS * STAGES * W_STAGE_BYTES + XS_BYTES + 2 * MAX_TOKENS * 4 <= 48 * 1024,
              "tc_gemm: the weight stages and the x tile exceed 48 KiB of static shared memory");

// Issue the cp.async of stage [k0, k0 + KS) of the warp's rows into `stage` (rows past ncols or columns past k_end
// zero-filled without a read), then commit the group (an empty one past the last stage keeps the count uniform).
__device__ __forceinline__ void tc_load_w_stage(unsigned char* stage, const mma_t* w, int c0, int ncols, int in,
                                                int k0, int k_end, bool any) {
    const int lane = threadIdx.x;
    if (any) {
#pragma unroll
        for (int u = 0; u < NRT * 4; ++u) {
            const int idx = lane + 32 * u, row = idx / 8, chunk = idx % 8;
            const int i = row / 16, col = c0 + 16 * (i % MT) + row % 16;   // the output column of this row
            const int k = k0 + 8 * chunk;
            const bool valid = col < ncols && k < k_end;
            const long long wrow = (i < MT ? 0 : ncols) + (long long)col;   // GATED: up rows follow the F gate rows
            tc_cp_async16(stage + tc_swizzle(row, chunk, 8), valid ? w + wrow * in + k : w, valid ? 16 : 0);
        }
    }
    tc_cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
tc_gemm(const act_t* x, const float* gamma, const float* beta, float eps, const mma_t* w, const float* bias,
        const act_t* residual, act_t* y, float* partial, int T, int in, int out, long long ldx, long long ldr,
        long long ldy) {
    __shared__ __align__(128) unsigned char ws[WARPS][STAGES][W_STAGE_BYTES];
    __shared__ __align__(128) XTile xs;
    __shared__ float mean_s[MAX_TOKENS], rstd_s[MAX_TOKENS];
    if (T > MAX_TOKENS) return;   // precondition: the wrapper picks a module with MAX_TOKENS >= T

    const int warp = threadIdx.y, lane = threadIdx.x;
    const int ncols = GATED ? out / 2 : out;
    const int c0 = (blockIdx.x * WARPS + warp) * 16 * MT;
    int k_begin, k_end;
    tc_split_range(in, k_begin, k_end);
    const int stages = (k_end - k_begin + KS - 1) / KS;
    const NormArgs na = {gamma, beta, eps};

    // The first STAGES - 1 weight stages are in flight while the norm statistics are computed.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        tc_load_w_stage(ws[warp][s], w, c0, ncols, in, k_begin + s * KS, k_end, s < stages);
    tc_norm_stats(x, T, in, ldx, eps, mean_s, rstd_s);

    float acc[NRT][NT][4] = {};
    for (int st = 0; st < stages; ++st) {
        const int k0 = k_begin + st * KS, xoff = (st * KS) % XK;   // block-uniform
        if (xoff == 0) {
            __syncthreads();   // every warp is done with the previous x tile
            tc_stage_x(xs, x, T, ldx, k0, k_end, mean_s, rstd_s, na);
            __syncthreads();
        }
        tc_cp_async_wait<STAGES - 2>();   // this lane's copies of stage st have landed
        tc_syncwarp();                    // ... and every lane's; the stage read last iteration is free
        const int next = st + STAGES - 1;
        tc_load_w_stage(ws[warp][next % STAGES], w, c0, ncols, in, k_begin + next * KS, k_end, next < stages);
        const unsigned char* stage = ws[warp][st % STAGES];
#pragma unroll
        for (int p = 0; p < 2; ++p) {          // two pairs of k-steps: chunks 4 p .. 4 p + 3 of the stage
            unsigned a[NRT][2][4];
#pragma unroll
            for (int i = 0; i < NRT; ++i)
#pragma unroll
                for (int s = 0; s < 2; ++s) {  // ldmatrix x4: rows 0-7 / 8-15 of m-tile i, chunks 2 (2p + s) + 0 / 1
                    const int m = lane / 8;
                    tc_ldmatrix_x4(a[i][s], stage + tc_swizzle(16 * i + 8 * (m % 2) + lane % 8,
                                                                2 * (2 * p + s) + m / 2, 8));
                }
            tc_mma_tiles(acc, a, xs, T, xoff / 8 + 4 * p);
        }
    }
    tc_cp_async_wait<0>();
    tc_store(acc, c0, T, out, bias, residual, y, partial, ldr, ldy);
}

extern "C" __global__ void __launch_bounds__(256)
tc_gemm_reduce(const float* partial, const float* bias, const act_t* residual, act_t* y, int T, int out,
               int splits, long long ldr, long long ldy) {
    sbi_reduce_body(partial, bias, residual, y, T, out, splits, ldr, ldy);
}
