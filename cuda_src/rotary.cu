// Rotary position embedding, half-split ("rotate_half") convention, on the first rotary_dim dims of every head:
//   for i < rotary_dim / 2, with c = cos[t, i], s = sin[t, i], a = x[.., i], b = x[.., i + rotary_dim / 2]:
//     y[.., i] = a * c - b * s,   y[.., i + rotary_dim / 2] = b * c + a * s
//   dims rotary_dim .. hd - 1 are copied unchanged. Reference: NumpyOps.rotary.
//
// kernel rotary(const act_t* x, const float* cos, const float* sin, act_t* y, int heads, int hd, int rotary_dim,
//               long long ldx, long long ldy)
//   x    [T, heads, hd]: token rows ldx elements apart, heads hd apart (e.g. the q and k heads of the fused qkv
//        projection output, read in place: ldx = (H + 2 Hkv) hd)
//   cos, sin [T, rotary_dim / 2] float32 contiguous (the rows of each token's position)
//   y    [T, heads, hd]: token rows ldy apart, heads hd apart; y == x (same ld) rotates in place (each pair is
//        read before it is written, by one thread).
// Launch: grid (T), block (BLOCK); the block strides over heads * hd / 2 pairs.
// Defines: T_STORAGE / T_ACT (common.cuh), BLOCK (default 128).
#include "common.cuh"

#ifndef BLOCK
#define BLOCK 128
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
rotary(const act_t* x, const float* cos, const float* sin, act_t* y, int heads, int hd, int rotary_dim,
       long long ldx, long long ldy) {
    const int t = blockIdx.x;
    const int half = rotary_dim / 2;
    const act_t* xr = x + (long long)t * ldx;
    act_t* yr = y + (long long)t * ldy;
    const float* ct = cos + (long long)t * half;
    const float* st = sin + (long long)t * half;

    // rotated pairs: (head, i) for i < half
    for (int p = threadIdx.x; p < heads * half; p += blockDim.x) {
        const int h = p / half, i = p % half;
        const int base = h * hd;
        const float a = to_float(xr[base + i]);
        const float b = to_float(xr[base + i + half]);
        const float c = ct[i], s = st[i];
        yr[base + i] = from_float<act_t>(a * c - b * s);
        yr[base + i + half] = from_float<act_t>(b * c + a * s);
    }
    // pass-through dims rotary_dim .. hd - 1
    const int rest = hd - rotary_dim;
    if (rest > 0) {
        for (int p = threadIdx.x; p < heads * rest; p += blockDim.x) {
            const int h = p / rest, i = rotary_dim + p % rest;
            yr[h * hd + i] = xr[h * hd + i];
        }
    }
}
