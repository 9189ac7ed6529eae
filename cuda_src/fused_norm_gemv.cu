// Deep-Fusion regions 1 and 3: the input normalization fused into the small-batch GEMV.
//   region 1: qkv = norm(x) @ Wqkv^T (+ bias)
//   region 3: h = act(norm(x) @ Wup^T + bias), or with GATED=1 the SiLU-gated MLP h = act(gate) * up
// Every block recomputes the norm statistics of the T <= MAX_TOKENS input rows (T * in elements from L2; with
// TILING=1 from the x it stages in shared memory when the rows fit one tile) and normalizes x as it uses it; the
// GEMV itself is the SBI-GeMM of sbi_core.cuh (layout, tilings, reductions and epilogue are described there).
// References: NumpyOps.rms_norm / layer_norm, then linear (+ activation / gated_activation).
//
// kernel fused_norm_gemv(const act_t* x, const float* gamma, const float* beta, float eps, const storage_t* w,
//                        const float* bias, const act_t* residual, act_t* y, float* partial, int T, int in, int out,
//                        long long ldx, long long ldr, long long ldy)
//   x [T, in] rows ldx apart (the un-normalized residual stream); gamma, beta [in] float32 (beta read only when
//   NORM=2 and NORM_BIAS=1); the other arguments as sbi_gemv's (sbi_gemv.cu).
// Launch: as sbi_gemv's (grid by TILING, block (32, WARPS)); no dynamic shared memory.
// kernel fused_norm_gemv_reduce: as sbi_gemv_reduce, for SPLITS > 1.
//
// Defines: NORM (1 = RMSNorm, 2 = LayerNorm; default 1), NORM_BIAS (LayerNorm bias; default 1), and those of
// sbi_gemv.cu.
#include "sbi_core.cuh"

#ifndef NORM
#define NORM NORM_RMS
#endif
#ifndef NORM_BIAS
#define NORM_BIAS 1
#endif
static_assert(NORM == NORM_RMS || NORM == NORM_LAYER, "NORM must be 1 (RMSNorm) or 2 (LayerNorm)");

extern "C" __global__ void __launch_bounds__(WARPS * 32)
fused_norm_gemv(const act_t* x, const float* gamma, const float* beta, float eps, const storage_t* w,
                const float* bias, const act_t* residual, act_t* y, float* partial, int T, int in, int out,
                long long ldx, long long ldr, long long ldy) {
    const NormArgs na = {gamma, beta, eps};
    sbi_body<NORM, NORM == NORM_LAYER && NORM_BIAS>(x, w, bias, residual, y, partial, T, in, out, ldx, ldr, ldy,
                                                     na);
}

extern "C" __global__ void __launch_bounds__(256)
fused_norm_gemv_reduce(const float* partial, const float* bias, const act_t* residual, act_t* y, int T, int out,
                       int splits, long long ldr, long long ldy) {
    sbi_reduce_body(partial, bias, residual, y, T, out, splits, ldr, ldy);
}
