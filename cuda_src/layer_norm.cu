// LayerNorm, one block per row (token):
//   mean = mean(x[t]),  var = mean((x[t] - mean)^2),  y[t] = (x[t] - mean) * (1 / sqrt(var + eps)) * weight + bias
// Two passes over the row (mean, then the centered variance), as the reference does. Reference: NumpyOps.layer_norm.
//
// kernel layer_norm(const act_t* x, const float* weight, const float* bias, act_t* y, int D, long long ldx,
//                   long long ldy, float eps)
//   x      [T, D] rows ldx elements apart           weight, bias [D] float32 (bias ignored when HAS_BIAS=0)
//   y      [T, D] rows ldy elements apart (may be x itself)
// Launch: grid (T), block (BLOCK) with BLOCK a multiple of 32 (default 256); no dynamic shared memory.
// Defines: T_STORAGE / T_ACT (common.cuh), BLOCK, HAS_BIAS (default 1).
#include "common.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 1
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
layer_norm(const act_t* x, const float* weight, const float* bias, act_t* y, int D, long long ldx, long long ldy,
           float eps) {
    __shared__ float scratch[32];
    const act_t* xr = x + (long long)blockIdx.x * ldx;
    act_t* yr = y + (long long)blockIdx.x * ldy;

    float s = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) s += to_float(xr[d]);
    const float mean = block_sum(s, scratch) / (float)D;

    float sq = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float c = to_float(xr[d]) - mean;
        sq += c * c;
    }
    const float var = block_sum(sq, scratch) / (float)D;
    const float rstd = 1.0f / sqrtf(var + eps);

    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float v = (to_float(xr[d]) - mean) * rstd * weight[d];
#if HAS_BIAS
        v += bias[d];
#endif
        yr[d] = from_float<act_t>(v);
    }
}
