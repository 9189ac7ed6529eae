// Decode attention (Deep-Fusion region 2): one new token per sequence. Appends its key and value to the KV cache at
// the sequence's position, then attends its query heads over positions 0 .. starts[s] of the cache, GQA (query
// head kvh * g + h, h < g = H / Hkv, uses KV head kvh), softmax(q k^T * scale) v, numerically stable (online
// softmax with a running maximum). Reference: NumpyOps.attention on a decode step (_append_kv + _decode_attention).
// Three kernels: decode_attention (one pass: a block per (KV head, sequence)), and flash-decoding for when those
// blocks cannot fill the GPU (a small batch): decode_attention_split (a block per (KV head, sequence, chunk of the
// context), partials to a workspace) then decode_attention_combine (merges the chunks). Why and how:
// decode_attention_core.cuh; which one runs: backend/cupy_attention.py (decode_splits).
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
//
// kernel decode_attention_split(q, k, v, cache_k, cache_v, slots, starts, float* part, int H, int Hkv, int hd,
//                               int Lmax, long long ldq, long long ldk, long long ldv, float scale)
//   as decode_attention, with part [S, H, C, 2 + hd] float32 (per chunk: m, l, acc[hd]; every entry written, an
//   empty chunk as m = -inf, l = acc = 0) in place of out.
// Launch: grid (Hkv, S, C), block (32, NWARPS). Block (kvh, s, c) takes chunk c of the sequence's own length
// (decode_chunk); the last chunk holds position starts[s], so block (kvh, s, C - 1) appends the row and is the only
// one that reads it.
//
// kernel decode_attention_combine(const float* part, act_t* out, int H, int hd, int C, long long ldo)
//   out [S, H * hd] rows ldo apart, from part [S, H, C, 2 + hd] (decode_combine).
// Launch: grid (ceil(H hd / (32 NWARPS)), S), block (32, NWARPS), after decode_attention_split on the same stream.
//
// Preconditions (checked by the wrapper; the attention kernels write nothing otherwise): H % Hkv == 0,
// H / Hkv <= MAX_GROUP, hd <= MAX_HEAD_DIM.
// Defines: T_STORAGE (cache), T_ACT (q, k, v, out), NWARPS (default 4), MAX_HEAD_DIM (multiple of 32, default
// 128), MAX_GROUP (default 8).
#include "decode_attention_core.cuh"

// Block (kvh, s) over chunk c of C: append the token's key and value when the chunk holds its position, then attend
// over the chunk's positions; emit as decode_attend.
template <class Emit>
__device__ void decode_block(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
                             const long long* slots, const long long* starts, int H, int Hkv, int hd, int Lmax,
                             long long ldq, long long ldk, long long ldv, float scale, int c, int C, Emit emit) {
    const int kvh = blockIdx.x, s = blockIdx.y;
    const int tid = threadIdx.y * 32 + threadIdx.x, nthreads = NWARPS * 32;
    const long long slot = slots[s], pos = starts[s];
    // No const / __restrict__ on the cache: the row appended below is read back after __syncthreads, which the
    // read-only (non-coherent) cache path would not guarantee.
    storage_t* kc = cache_k + (slot * Hkv + kvh) * (long long)Lmax * hd;
    storage_t* vc = cache_v + (slot * Hkv + kvh) * (long long)Lmax * hd;
    long long begin, end;
    decode_chunk(pos + 1, c, C, begin, end);

    // 1. append this token's key and value (rounded to the storage type, as the reference stores them)
    if (c == C - 1) {
        for (int d = tid; d < hd; d += nthreads) {
            kc[pos * hd + d] = from_float<storage_t>(to_float(k[s * ldk + (long long)kvh * hd + d]));
            vc[pos * hd + d] = from_float<storage_t>(to_float(v[s * ldv + (long long)kvh * hd + d]));
        }
    }
    // 2. attend over the chunk's positions (the appended row included when it is this chunk's)
    decode_attend(q, s, kvh, H / Hkv, hd, begin, end, ldq, scale, [&](long long j, int d, float& kf, float& vf) {
        kf = to_float(kc[j * hd + d]);
        vf = to_float(vc[j * hd + d]);
    }, emit);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
                 const long long* slots, const long long* starts, act_t* out, int H, int Hkv, int hd, int Lmax,
                 long long ldq, long long ldk, long long ldv, long long ldo, float scale) {
    const int g = H / Hkv;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;
    decode_block(q, k, v, cache_k, cache_v, slots, starts, H, Hkv, hd, Lmax, ldq, ldk, ldv, scale, 0, 1,
                 decode_write_out(out, blockIdx.y, blockIdx.x, g, hd, ldo));
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention_split(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
                       const long long* slots, const long long* starts, float* part, int H, int Hkv, int hd,
                       int Lmax, long long ldq, long long ldk, long long ldv, float scale) {
    const int g = H / Hkv, c = blockIdx.z, C = gridDim.z;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;
    decode_block(q, k, v, cache_k, cache_v, slots, starts, H, Hkv, hd, Lmax, ldq, ldk, ldv, scale, c, C,
                 decode_write_partial(part, blockIdx.y, blockIdx.x, g, hd, H, c, C));
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention_combine(const float* part, act_t* out, int H, int hd, int C, long long ldo) {
    const int e = blockIdx.x * (NWARPS * 32) + threadIdx.y * 32 + threadIdx.x, s = blockIdx.y;
    if (e < H * hd) decode_combine(part, out, s, e, H, hd, C, ldo);
}
