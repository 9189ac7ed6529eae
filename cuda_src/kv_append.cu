// Append the new tokens' keys and values to the KV cache (the prefill half of NumpyOps._append_kv; the decode step
// appends inside decode_attention). Sequence s has its new tokens at offsets[s] .. offsets[s + 1] - 1 of the packed
// token axis; they go to positions starts[s] .. starts[s] + count - 1 of cache slot slots[s].
//
// kernel kv_append(const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v, const long long* slots,
//                  const long long* starts, const long long* offsets, int Hkv, int hd, int Lmax,
//                  long long ldk, long long ldv)
//   k, v      [T, Hkv, hd]: token rows ldk (resp. ldv) elements apart, heads hd apart (views into qkv are fine)
//   cache_k/v [N, Hkv, Lmax, hd] contiguous
//   slots, starts [S] int64; offsets [S + 1] int64 (offsets[0] = 0, offsets[S] = T)
//   Precondition (checked by the wrapper): starts[s] + count(s) <= Lmax.
// Launch: grid (max_count, S), block (BLOCK): block (i, s) copies token i of sequence s (exits if i >= count(s)).
// Defines: T_STORAGE (cache), T_ACT (k, v), BLOCK (default 128).
#include "common.cuh"

#ifndef BLOCK
#define BLOCK 128
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
kv_append(const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v, const long long* slots,
          const long long* starts, const long long* offsets, int Hkv, int hd, int Lmax, long long ldk,
          long long ldv) {
    const int i = blockIdx.x, s = blockIdx.y;
    const long long first = offsets[s], count = offsets[s + 1] - first;
    if (i >= count) return;
    const long long token = first + i, pos = starts[s] + i, slot = slots[s];
    for (int e = threadIdx.x; e < Hkv * hd; e += blockDim.x) {
        const int h = e / hd, d = e % hd;
        const long long dst = ((slot * Hkv + h) * Lmax + pos) * hd + d;
        cache_k[dst] = from_float<storage_t>(to_float(k[token * ldk + e]));
        cache_v[dst] = from_float<storage_t>(to_float(v[token * ldv + e]));
    }
}
