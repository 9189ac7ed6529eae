// RMSNorm, one block per row (token):  y[t, :] = x[t, :] * (1 / sqrt(mean(x[t, :]^2) + eps)) * weight
// Reference: NumpyOps.rms_norm.
//
// kernel rms_norm(const act_t* x, const float* weight, act_t* y, int D, long long ldx, long long ldy, float eps)
//   x      [T, D] rows ldx elements apart           weight [D] float32
//   y      [T, D] rows ldy elements apart (may be x itself: each element is read before it is written, by the same
//          thread)
// Launch: grid (T), block (BLOCK) with BLOCK a multiple of 32 (default 256); no dynamic shared memory.
// Defines: T_STORAGE / T_ACT (common.cuh), BLOCK (launch size the wrapper must match).
#include "common.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
rms_norm(const act_t* x, const float* weight, act_t* y, int D, long long ldx, long long ldy, float eps) {
    __shared__ float scratch[32];
    const act_t* xr = x + (long long)blockIdx.x * ldx;
    act_t* yr = y + (long long)blockIdx.x * ldy;

    float sq = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float v = to_float(xr[d]);
        sq += v * v;
    }
    const float ms = block_sum(sq, scratch) / (float)D;
    const float rstd = 1.0f / sqrtf(ms + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        yr[d] = from_float<act_t>(to_float(xr[d]) * rstd * weight[d]);
    }
}
