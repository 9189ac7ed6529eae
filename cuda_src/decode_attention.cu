// Decode attention (Deep-Fusion region 2): one new token per sequence. Appends its key and value to the KV cache at
// the sequence's position, then attends its query heads over positions 0 .. starts[s] of the cache, GQA (query
// head kvh * g + h, h < g = H / Hkv, uses KV head kvh), softmax(q k^T * scale) v, numerically stable (online
// softmax with a running maximum). Reference: NumpyOps.attention on a decode step (_append_kv + _decode_attention).
//
// kernel decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
//                         const long long* slots, const long long* starts, act_t* out, int H, int Hkv, int hd,
//                         int Lmax, long long ldq, long long ldk, long long ldv, long long ldo, float scale)
//   q      [S, H, hd]: token rows ldq elements apart, heads hd apart (a view into qkv is fine: head transposition
//          fused, the paper's region 2)
//   k, v   [S, Hkv, hd]: rows ldk / ldv apart
//   cache_k, cache_v [N, Hkv, Lmax, hd] contiguous; slots, starts [S] int64: sequence s writes position starts[s]
//          of slot slots[s] and attends positions 0 .. starts[s] (its length is starts[s] + 1 <= Lmax)
//   out    [S, H * hd] rows ldo apart
// Launch: grid (Hkv, S), block (32, NWARPS); no dynamic shared memory. Block (kvh, s) owns the cache row it
// appends, so no other block reads it: the append and the attention need no second launch.
// The attention itself (work split, online softmax, the merge of the warps): decode_attention_core.cuh.
// Preconditions (checked by the wrapper; the kernel writes nothing otherwise): H % Hkv == 0, H / Hkv <= MAX_GROUP,
// hd <= MAX_HEAD_DIM.
// Defines: T_STORAGE (cache), T_ACT (q, k, v, out), NWARPS (default 4), MAX_HEAD_DIM (multiple of 32, default
// 128), MAX_GROUP (default 8).
#include "decode_attention_core.cuh"

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
                 const long long* slots, const long long* starts, act_t* out, int H, int Hkv, int hd, int Lmax,
                 long long ldq, long long ldk, long long ldv, long long ldo, float scale) {
    const int kvh = blockIdx.x, s = blockIdx.y;
    const int tid = threadIdx.y * 32 + threadIdx.x, nthreads = NWARPS * 32;
    const int g = H / Hkv;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;

    const long long slot = slots[s], pos = starts[s];
    // No const / __restrict__ on the cache: the row appended below is read back after __syncthreads, which the
    // read-only (non-coherent) cache path would not guarantee.
    storage_t* kc = cache_k + (slot * Hkv + kvh) * (long long)Lmax * hd;
    storage_t* vc = cache_v + (slot * Hkv + kvh) * (long long)Lmax * hd;

    // 1. append this token's key and value (rounded to the storage type, as the reference stores them)
    for (int d = tid; d < hd; d += nthreads) {
        kc[pos * hd + d] = from_float<storage_t>(to_float(k[s * ldk + (long long)kvh * hd + d]));
        vc[pos * hd + d] = from_float<storage_t>(to_float(v[s * ldv + (long long)kvh * hd + d]));
    }
    // 2. attend over positions 0 .. pos of the cache (this row included)
    decode_attend(q, out, s, kvh, g, hd, pos + 1, ldq, ldo, scale, [&](long long j, int d, float& kf, float& vf) {
        kf = to_float(kc[j * hd + d]);
        vf = to_float(vc[j * hd + d]);
    });
}
