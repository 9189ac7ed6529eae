// Decode attention (Deep-Fusion region 2): one new token per sequence. Appends its key (rotated, when rotary_dim > 0)
// and value to the KV cache at the sequence's position, then attends its query heads (rotated on load) over
// positions 0 .. starts[s] of the cache, GQA (query head kvh * g + h, h < g = H / Hkv, uses KV head kvh),
// softmax(q k^T * scale) v, numerically stable (online softmax). Reference: NumpyOps.rotary on q and k, then
// NumpyOps.attention on a decode step (_append_kv + _decode_attention). One kernel: a block per (KV head, sequence,
// chunk of the context); with more than one chunk the last block of a (sequence, KV head) to finish merges the
// chunks in order, in the same launch. Why and how: decode_attention_core.cuh; the chunk count:
// backend/cupy_decode.py (decode_splits).
//
// kernel decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
//                         const long long* slots, const long long* starts, const float* cos, const float* sin,
//                         int rotary_dim, act_t* out, float* part, int* counters, int H, int Hkv, int hd, int Lmax,
//                         long long ldq, long long ldk, long long ldv, long long ldo, float scale)
//   q      [S, H, hd]: token rows ldq elements apart, heads hd apart (a view into qkv is fine)
//   k, v   [S, Hkv, hd]: rows ldk / ldv apart
//   cache_k, cache_v [N, Hkv, Lmax, hd] contiguous, 16-byte aligned; slots, starts [S] int64: sequence s writes
//          position starts[s] of slot slots[s] and attends positions 0 .. starts[s] (starts[s] + 1 <= Lmax)
//   cos, sin [S, rotary_dim / 2] float32 (each token's position's rows) when rotary_dim > 0 (even, <= hd): q and k
//          are rotated on the fly (half-split, NumpyOps.rotary's arithmetic); null with rotary_dim = 0
//   out    [S, H * hd] rows ldo apart
//   part   [S, H, C, 2 + hd] float32 workspace, counters [S * Hkv] int32 zeros (left zero); null when C = 1
// Launch: grid (Hkv, S, C), block (32, NWARPS); no dynamic shared memory. Block (kvh, s, C - 1) holds position
// starts[s]: it appends the row and is the only one that reads it (after a __syncthreads), so the append needs no
// second launch.
//
// Preconditions (checked by the wrapper; the kernel writes nothing otherwise): H == GROUP * Hkv, hd == HEAD_DIM,
// 0 <= rotary_dim <= hd, rotary_dim even.
// Defines: T_STORAGE (cache), T_ACT (q, k, v, out), HEAD_DIM, GROUP, NWARPS (default 4).
#include "decode_attention_core.cuh"

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
                 const long long* slots, const long long* starts, const float* cos, const float* sin, int rotary_dim,
                 act_t* out, float* part, int* counters, int H, int Hkv, int hd, int Lmax, long long ldq,
                 long long ldk, long long ldv, long long ldo, float scale) {
    if (H != GROUP * Hkv || hd != HEAD_DIM || rotary_dim < 0 || rotary_dim > hd || rotary_dim % 2) return;
    const int kvh = blockIdx.x, s = blockIdx.y, c = blockIdx.z, C = gridDim.z;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const long long slot = slots[s], pos = starts[s];
    // No const / __restrict__ on the cache: the row appended below is read back after __syncthreads, which the
    // read-only (non-coherent) cache path would not guarantee.
    storage_t* kc = cache_k + (slot * Hkv + kvh) * (long long)Lmax * HEAD_DIM;
    storage_t* vc = cache_v + (slot * Hkv + kvh) * (long long)Lmax * HEAD_DIM;
    long long begin, end;
    decode_chunk(pos + 1, c, C, begin, end);

    // 1. the query heads (rotated, scaled); the token's key (rotated) and value appended, rounded to the storage
    //    type as the reference stores them, by the block whose chunk holds the position
    decode_stage_q(q, s, kvh, ldq, cos, sin, rotary_dim, scale);
    if (c == C - 1) {
        for (int d = tid; d < HEAD_DIM; d += NWARPS * 32) {
            kc[pos * HEAD_DIM + d] = from_float<storage_t>(decode_new_k(k, s, kvh, ldk, cos, sin, rotary_dim, d));
            vc[pos * HEAD_DIM + d] = from_float<storage_t>(to_float(v[s * ldv + (long long)kvh * HEAD_DIM + d]));
        }
    }
    __syncthreads();
    // 2. attend over the chunk's positions in 16-byte vectors
    decode_attend(begin, end, s, kvh, H, c, C, DecodeOut{out, ldo, part, counters},
                  [&](long long j, int vi, float (&kf)[dec::VEC], float (&vf)[dec::VEC]) {
                      load_vec<storage_t, dec::VEC>(kc + j * HEAD_DIM + vi * dec::VEC, kf);
                      load_vec<storage_t, dec::VEC>(vc + j * HEAD_DIM + vi * dec::VEC, vf);
                  });
}
