// SBI-GeMM for small batch (1 .. MAX_TOKENS tokens): y[T, ncols] = epilogue(x[T, in] @ W^T), W in the SBI layout.
// The design (layout, tiling, the two reductions, the epilogue) is described in sbi_core.cuh. Reference:
// NumpyOps.linear (+ activation / gated_activation / the residual add that follows, when fused).
//
// kernel sbi_gemv(const act_t* x, const storage_t* w, const float* bias, const act_t* residual, act_t* y,
//                 float* partial, int T, int in, int out, long long ldx, long long ldr, long long ldy)
//   x        [T, in] rows ldx apart (T <= MAX_TOKENS)
//   w        SBI layout [ceil(in / VEC), out, VEC] of W [out, in] (hpcinfer.kernels.layout.sbi_pack), 16-byte
//            aligned; with W_ROWMAJOR=1 (required by TILING=1), W [out, in] itself (contiguous, in % VEC == 0)
//   bias     [out] float32 (HAS_BIAS; out = 2F when GATED: gate biases, then up biases)
//   residual [T, ncols] rows ldr apart (HAS_RESIDUAL; may be y itself: read and written by one thread)
//   y        [T, ncols] rows ldy apart, ncols = out (out / 2 when GATED)
//   partial  [SPLITS, T, out] float32 workspace, used only when grid.y > 1 (then y is written by sbi_gemv_reduce)
//   Unused pointers (bias without HAS_BIAS, ...) may be anything, e.g. numpy.uint64(0).
// Launch: TILING=1 grid (ceil(ncols / (WARPS * RW)), SPLITS), TILING=0 grid (ceil(ncols / (32 * ROWS)), SPLITS);
// block (32, WARPS); no dynamic shared memory.
//
// kernel sbi_gemv_reduce(const float* partial, const float* bias, const act_t* residual, act_t* y, int T, int out,
//                        int splits, long long ldr, long long ldy)
//   the second reduction when SPLITS > 1, with the same defines. Launch: grid (ceil(T * ncols / 256)), block (256).
//
// Defines: T_STORAGE (w), T_ACT (x, residual, y), MAX_TOKENS (default 1), TILING (0), WARPS (4), UNROLL (4),
// ROWS (1; TILING=0), RW (1) and X_TILE (TILING=1), ACT (ACT_NONE), HAS_BIAS (0), HAS_RESIDUAL (0), GATED (0),
// X_VEC (1), W_ROWMAJOR (0); see sbi_core.cuh.
#include "sbi_core.cuh"

extern "C" __global__ void __launch_bounds__(WARPS * 32)
sbi_gemv(const act_t* x, const storage_t* w, const float* bias, const act_t* residual, act_t* y, float* partial,
         int T, int in, int out, long long ldx, long long ldr, long long ldy) {
    const NormArgs none = {nullptr, nullptr, 0.0f};
    sbi_body<NORM_NONE, false>(x, w, bias, residual, y, partial, T, in, out, ldx, ldr, ldy, none);
}

extern "C" __global__ void __launch_bounds__(256)
sbi_gemv_reduce(const float* partial, const float* bias, const act_t* residual, act_t* y, int T, int out,
                int splits, long long ldr, long long ldy) {
    sbi_reduce_body(partial, bias, residual, y, T, out, splits, ldr, ldy);
}
