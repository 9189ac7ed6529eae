// Paged attention (issue 21, vLLM's PagedAttention): the KV cache of one layer is a pool of fixed-size blocks,
// pool [num_blocks, Hkv, bs, hd] (a block is the dense cache's [Hkv, L, hd] cut into bs positions), and sequence s
// keeps its positions in the blocks of its table, in order: position p is row p % bs of block tables[s, p / bs].
// Reference: hpcinfer/backend/paged_attention.py (paged_append, paged_decode_attention; NumpyOps.attention on a
// StepLayout.paged). The wrapper is hpcinfer/backend/cupy_paged.py.
//
// kernel paged_kv_append(const act_t* k, const act_t* v, storage_t* pool_k, storage_t* pool_v,
//                        const long long* slots, int Hkv, int hd, int bs, long long ldk, long long ldv)
//   k, v    [T, Hkv, hd]: token rows ldk (resp. ldv) elements apart, heads hd apart (views into qkv are fine)
//   pool_k, pool_v [num_blocks, Hkv, bs, hd] contiguous
//   slots   [T] int64: token t's flat slot block * bs + offset (StepLayout.flat_slots), each < num_blocks * bs
// Launch: grid (T), block (BLOCK): block t copies token t's Hkv rows. (Prefill and mixed steps; a decode step
// appends inside paged_decode_attention.)
//
// kernel paged_decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* pool_k,
//                               storage_t* pool_v, const int* tables, const int* lengths, const float* cos,
//                               const float* sin, int rotary_dim, act_t* out, float* part, int* counters, int H,
//                               int Hkv, int hd, int bs, int B, long long ldq, long long ldk, long long ldv,
//                               long long ldo, float scale)
//   q       [S, H, hd], k, v [S, Hkv, hd]: one token per sequence, rows ldq / ldk / ldv apart, heads hd apart
//   tables  [S, B] int32, -1 past a sequence's blocks; lengths [S] int32: sequence s writes its new row at
//           position lengths[s] - 1 and attends positions 0 .. lengths[s] - 1 (1 <= lengths[s] <= B * bs)
//   cos, sin, rotary_dim, out, part, counters: as decode_attention.cu (rotary fused into the q load and the append;
//           the split over the context and its combine in this one launch)
// Launch: grid (Hkv, S, C), block (32, NWARPS); no dynamic shared memory. Block (kvh, s, c) takes chunk c of the
// sequence's own length (decode_chunk); the last chunk appends the new row of KV head kvh (no other block reads
// it), then each block attends the g = H / Hkv query heads kvh * g + h (GQA: the group shares every K and V row it
// loads): the dense decode kernel's attention (decode_attention_core.cuh: 16-byte vectors, several positions a
// warp, the last block of a (sequence, KV head) combines the chunks) with a reader that finds position j through
// the table. Only positions below the length are read: no table entry past it (maybe -1), no row of the last block
// past it (another sequence's stale rows). The pools must be 16-byte aligned.
//
// Preconditions (checked by the wrapper; the attention kernel writes nothing otherwise): H == GROUP * Hkv,
// hd == HEAD_DIM, 0 <= rotary_dim <= hd even.
// Defines: T_STORAGE (pools), T_ACT (q, k, v, out), BLOCK (append, default 128), HEAD_DIM, GROUP, NWARPS (default
// 4): the decode core's.
#include "decode_attention_core.cuh"

#ifndef BLOCK
#define BLOCK 128
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
paged_kv_append(const act_t* k, const act_t* v, storage_t* pool_k, storage_t* pool_v, const long long* slots,
                int Hkv, int hd, int bs, long long ldk, long long ldv) {
    const long long t = blockIdx.x, slot = slots[t];
    const long long block = slot / bs, offset = slot % bs;
    for (int e = threadIdx.x; e < Hkv * hd; e += blockDim.x) {
        const int h = e / hd, d = e % hd;
        const long long dst = ((block * Hkv + h) * bs + offset) * hd + d;
        pool_k[dst] = from_float<storage_t>(to_float(k[t * ldk + e]));
        pool_v[dst] = from_float<storage_t>(to_float(v[t * ldv + e]));
    }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* pool_k, storage_t* pool_v,
                       const int* tables, const int* lengths, const float* cos, const float* sin, int rotary_dim,
                       act_t* out, float* part, int* counters, int H, int Hkv, int hd, int bs, int B, long long ldq,
                       long long ldk, long long ldv, long long ldo, float scale) {
    if (H != GROUP * Hkv || hd != HEAD_DIM || rotary_dim < 0 || rotary_dim > hd || rotary_dim % 2) return;
    const int kvh = blockIdx.x, s = blockIdx.y, c = blockIdx.z, C = gridDim.z;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const int* table = tables + (long long)s * B;
    const long long length = lengths[s], pos = length - 1;
    // row j of KV head kvh: pool[table[j / bs], kvh, j % bs, :]. The pools are not const / __restrict__: the row
    // appended here is read back after a __syncthreads, which the read-only cache would not promise.
    auto row = [&](long long j) { return (((long long)table[j / bs] * Hkv + kvh) * bs + j % bs) * HEAD_DIM; };
    long long begin, end;
    decode_chunk(length, c, C, begin, end);

    // 1. the query heads (rotated, scaled); the token's key (rotated) and value appended by the last chunk
    decode_stage_q(q, s, kvh, ldq, cos, sin, rotary_dim, scale);
    if (c == C - 1) {
        const long long dst = row(pos);
        for (int d = tid; d < HEAD_DIM; d += NWARPS * 32) {
            pool_k[dst + d] = from_float<storage_t>(decode_new_k(k, s, kvh, ldk, cos, sin, rotary_dim, d));
            pool_v[dst + d] = from_float<storage_t>(to_float(v[s * ldv + (long long)kvh * HEAD_DIM + d]));
        }
    }
    __syncthreads();
    // 2. attend over the chunk's positions through the table, in 16-byte vectors
    decode_attend(begin, end, s, kvh, H, c, C, DecodeOut{out, ldo, part, counters},
                  [&](long long j, int vi, float (&kf)[dec::VEC], float (&vf)[dec::VEC]) {
                      const long long at = row(j) + vi * dec::VEC;
                      load_vec<storage_t, dec::VEC>(pool_k + at, kf);
                      load_vec<storage_t, dec::VEC>(pool_v + at, vf);
                  });
}
