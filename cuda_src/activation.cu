// Element-wise activations. References: NumpyOps.activation and NumpyOps.gated_activation.
//
// kernel activation(const act_t* x, act_t* y, long long n)
//   y[i] = act(x[i]) for i < n; x, y contiguous (y may be x).
// kernel gated_activation(const act_t* gate_up, act_t* y, int T, int F, long long ld_in, long long ld_out)
//   gate_up [T, 2F] (rows ld_in apart, the gate half first) -> y[t, f] = act(gate_up[t, f]) * gate_up[t, F + f],
//   y [T, F] rows ld_out apart.
// Launch (both): grid (G), block (BLOCK); grid-stride loops, so any G >= 1 is correct: G = ceil(work / BLOCK)
// capped at a few waves (e.g. 32 * SMs), with work = n, resp. T * F.
// Defines: T_STORAGE / T_ACT (common.cuh), ACT (ACT_GELU 1, ACT_GELU_TANH 2, ACT_RELU 3, ACT_SILU 4; default SILU),
// BLOCK (default 256).
#include "common.cuh"

#ifndef ACT
#define ACT ACT_SILU
#endif
#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
activation(const act_t* x, act_t* y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = from_float<act_t>(activate<ACT>(to_float(x[i])));
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
gated_activation(const act_t* gate_up, act_t* y, int T, int F, long long ld_in, long long ld_out) {
    const long long n = (long long)T * F;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long t = i / F, f = i % F;
        const float g = to_float(gate_up[t * ld_in + f]);
        const float u = to_float(gate_up[t * ld_in + F + f]);
        y[t * ld_out + f] = from_float<act_t>(activate<ACT>(g) * u);
    }
}
