// Shared by every kernel file: storage types, float conversion, activations, warp and block reductions.
//
// Storage types (one per compile, injected as #defines by hpcinfer/kernels/loader.py):
//   T_STORAGE  weights and the KV cache: float, __half or __nv_bfloat16 (default float)
//   T_ACT      activations read and written by the kernels (x, y, q, k, v, logits ...); default T_STORAGE
// Small parameters (biases, norm weights, cos/sin, gate weights) are always float32; integer tables (ids, slots,
// experts, rows) are always int64. Every sum is accumulated in float32.
//
// The loader pastes this file in place of `#include "common.cuh"` before handing the source to NVRTC, so that
// CuPy's kernel cache (keyed on the source text) sees a change here; nvcc finds it with -I cuda_src.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef T_STORAGE
#define T_STORAGE float
#endif
#ifndef T_ACT
#define T_ACT T_STORAGE
#endif

typedef T_STORAGE storage_t;
typedef T_ACT act_t;

// Activation codes for ACT (used by activation.cu and the GEMV epilogues).
#define ACT_NONE 0
#define ACT_GELU 1        // 0.5 x (1 + erf(x / sqrt 2))
#define ACT_GELU_TANH 2   // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
#define ACT_RELU 3        // max(x, 0)
#define ACT_SILU 4        // x / (1 + exp(-x))

#define FULL_MASK 0xffffffffu
#define NEG_INF (__int_as_float(0xff800000))

// ---- conversions ----------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename S> __device__ __forceinline__ S from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// N contiguous elements of type S at p -> float out[N]. p must be aligned to the vector width used: 16 bytes when
// N * sizeof(S) is a multiple of 16, 8 bytes when it is a multiple of 8; element-wise loads otherwise.
template <typename S, int N>
__device__ __forceinline__ void load_vec(const S* p, float (&out)[N]) {
    constexpr int bytes = N * (int)sizeof(S);
    if constexpr (bytes % 16 == 0) {
        constexpr int per = 16 / (int)sizeof(S);
#pragma unroll
        for (int v = 0; v < bytes / 16; ++v) {
            uint4 raw = *reinterpret_cast<const uint4*>(p + v * per);
            const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
            for (int i = 0; i < per; ++i) out[v * per + i] = to_float(e[i]);
        }
    } else if constexpr (bytes % 8 == 0) {
        constexpr int per = 8 / (int)sizeof(S);
#pragma unroll
        for (int v = 0; v < bytes / 8; ++v) {
            uint2 raw = *reinterpret_cast<const uint2*>(p + v * per);
            const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
            for (int i = 0; i < per; ++i) out[v * per + i] = to_float(e[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
    }
}

// ---- activations ----------------------------------------------------------------------------------------------
template <int KIND>
__device__ __forceinline__ float activate(float x) {
    if constexpr (KIND == ACT_GELU) {
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    } else if constexpr (KIND == ACT_GELU_TANH) {
        return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    } else if constexpr (KIND == ACT_RELU) {
        return fmaxf(x, 0.0f);
    } else if constexpr (KIND == ACT_SILU) {
        return x / (1.0f + expf(-x));
    } else {
        return x;
    }
}

// ---- reductions (every lane of the warp / thread of the block must call these) ----------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Sum over the block (any block shape with a multiple of 32 threads, at most 1024); every thread gets the result.
// `scratch` is 32 floats of shared memory; the function synchronizes before returning, so it may be reused.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int lane = tid & 31, warp = tid >> 5, warps = (blockDim.x * blockDim.y * blockDim.z) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = lane < warps ? scratch[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();
    return total;
}

// The second step of the small-batch GEMVs (sbi_core.cuh, quant_gemv.cu): each lane of warp w holds partial sums
// acc[r][t] of tile column r * 32 + lane for token t over warp w's share of the input; they are summed over the
// NWARP warps of a block (32, NWARP), one token at a time, into res[t][c]. red: shared [NWARP][NR * 32 + 1] (+1:
// lane i reads row i of a column, conflict-free), res: shared [MAXT][NR * 32]. The whole block calls this.
template <int NR, int MAXT, int NWARP>
__device__ __forceinline__ void gemv_reduce_warps(const float (&acc)[NR][MAXT], int T, float (*red)[NR * 32 + 1],
                                                  float (*res)[NR * 32]) {
    const int lane = threadIdx.x, warp = threadIdx.y;
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
        if (t < T) {
#pragma unroll
            for (int r = 0; r < NR; ++r) red[warp][r * 32 + lane] = acc[r][t];
            __syncthreads();
            for (int c = warp; c < NR * 32; c += NWARP) {
                float v = lane < NWARP ? red[lane][c] : 0.0f;
                v = warp_sum(v);
                if (lane == 0) res[t][c] = v;
            }
            __syncthreads();
        }
    }
}
