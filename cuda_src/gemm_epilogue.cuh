// The epilogue and the norm prologue of the small-batch linears, shared by the SBI GEMV (sbi_core.cuh) and the
// tensor-core GEMM (tc_gemm.cu, tc_quant_gemm.cu), so that both compute the same float32 operations:
//   y[t, c] = act(g + bias[c]) (GATED: * (u + bias[F + c])) (+ residual[t, c])
//   x normalized per token: x rstd gamma (RMSNorm), (x - mean) rstd gamma (+ beta) (LayerNorm, two passes).
// Defines: ACT (common.cuh ACT_*), HAS_BIAS, HAS_RESIDUAL, GATED (all default 0); NORM_* codes for the callers'
// NORM define.
#pragma once
#include "common.cuh"

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

#define NORM_NONE 0
#define NORM_RMS 1
#define NORM_LAYER 2

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

// x[t, k] normalized: x rstd gamma[k] (RMSNorm), (x - mean) rstd gamma[k] (+ beta[k]) (LayerNorm).
template <int NormKind, bool NormBias>
__device__ __forceinline__ float sbi_norm_value(float x, int k, float mean, float rstd, const NormArgs& na) {
    if constexpr (NormKind == NORM_RMS) {
        return x * rstd * na.gamma[k];
    } else {
        float v = (x - mean) * rstd * na.gamma[k];
        if constexpr (NormBias) v += na.beta[k];
        return v;
    }
}

// The warp's sum of f(get(q)) over q < quads (get(q): a float4 of the row), 4 loads in flight per lane.
template <typename Get, typename F>
__device__ __forceinline__ float sbi_warp_row_sum(int quads, Get get, F f) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int q0 = threadIdx.x; q0 < quads; q0 += 128) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (q0 + 32 * j < quads) s[j] += f(get(q0 + 32 * j));
    }
    return warp_sum((s[0] + s[1]) + (s[2] + s[3]));
}

// Row statistics of the first T rows (mean_s, rstd_s; mean 0 for RMSNorm), one warp per row (two passes for
// LayerNorm, as NumpyOps.layer_norm): get(t, q) is x[t, 4 q .. 4 q + 3] (in % 4 == 0: the row-major read has
// in % VEC == 0).
template <int NormKind, typename Get>
__device__ __forceinline__ void sbi_row_stats(int T, int in, float eps, Get get, float* mean_s, float* rstd_s) {
    for (int t = threadIdx.y; t < T; t += blockDim.y) {
        const auto row = [&](int q) { return get(t, q); };
        float mean = 0.0f;
        if constexpr (NormKind == NORM_LAYER)
            mean = sbi_warp_row_sum(in / 4, row, [](float4 v) { return (v.x + v.y) + (v.z + v.w); }) / (float)in;
        const float var = sbi_warp_row_sum(in / 4, row, [&](float4 v) {   // mean of squares for RMSNorm (mean 0)
            const float a = v.x - mean, b = v.y - mean, c = v.z - mean, d = v.w - mean;
            return (a * a + b * b) + (c * c + d * d);
        }) / (float)in;
        if (threadIdx.x == 0) {
            mean_s[t] = mean;
            rstd_s[t] = 1.0f / sqrtf(var + eps);
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
