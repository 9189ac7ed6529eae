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
//                               storage_t* pool_v, const int* tables, const int* lengths, act_t* out, int H,
//                               int Hkv, int hd, int bs, int B, long long ldq, long long ldk, long long ldv,
//                               long long ldo, float scale)
//   q       [S, H, hd], k, v [S, Hkv, hd]: one token per sequence, rows ldq / ldk / ldv apart, heads hd apart
//   tables  [S, B] int32, -1 past a sequence's blocks; lengths [S] int32: sequence s writes its new row at
//           position lengths[s] - 1 and attends positions 0 .. lengths[s] - 1 (1 <= lengths[s] <= B * bs)
//   out     [S, H * hd] rows ldo apart
// Launch: grid (Hkv, S), block (32, NWARPS); no dynamic shared memory. Block (kvh, s) appends the new row of KV
// head kvh (no other block reads it), then attends the g = H / Hkv query heads kvh * g + h (GQA: the group shares
// every K and V row it loads), softmax(q k^T * scale) v with an online softmax in float32: the dense decode
// kernel's attention (decode_attention_core.cuh: decode_attend, its work split and warp merge) with a reader that
// finds position j through the table. Only positions below the length are read: no table entry past it (maybe
// -1), no row of the last block past it (another sequence's stale rows).
//
// kernel paged_decode_attention_split(q, k, v, pool_k, pool_v, tables, lengths, float* part, int H, int Hkv,
//                                     int hd, int bs, int B, long long ldq, long long ldk, long long ldv,
//                                     float scale)
//   flash-decoding for a small batch, as decode_attention_split: part [S, H, C, 2 + hd] float32 in place of out.
// Launch: grid (Hkv, S, C), block (32, NWARPS); block (kvh, s, c) takes chunk c of the sequence's own length
// (decode_chunk); the last chunk appends the row. Then decode_attention.cu's decode_attention_combine merges the
// chunks into out (the workspace's layout is the dense kernels').
//
// Preconditions (checked by the wrapper; the attention kernels write nothing otherwise): H % Hkv == 0,
// H / Hkv <= MAX_GROUP, hd <= MAX_HEAD_DIM.
// Defines: T_STORAGE (pools), T_ACT (q, k, v, out), BLOCK (append, default 128), NWARPS (default 4), MAX_HEAD_DIM
// (multiple of 32, default 128), MAX_GROUP (default 8): the decode core's.
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

// Block (kvh, s) of either decode kernel: chunk c of C of sequence s. The pools are not const / __restrict__: the
// row appended here is read back after decode_attend's __syncthreads, which the read-only cache would not promise.
template <class Emit>
__device__ void paged_decode_block(const act_t* q, const act_t* k, const act_t* v, storage_t* pool_k,
                                   storage_t* pool_v, const int* tables, const int* lengths, int H, int Hkv, int hd,
                                   int bs, int B, long long ldq, long long ldk, long long ldv, float scale, int c,
                                   int C, Emit emit) {
    const int kvh = blockIdx.x, s = blockIdx.y;
    const int tid = threadIdx.y * 32 + threadIdx.x, nthreads = NWARPS * 32;
    const int* table = tables + (long long)s * B;
    const long long length = lengths[s], pos = length - 1;
    // row j of KV head kvh: pool[table[j / bs], kvh, j % bs, :]
    auto row = [&](long long j) { return (((long long)table[j / bs] * Hkv + kvh) * bs + j % bs) * hd; };
    long long begin, end;
    decode_chunk(length, c, C, begin, end);

    // 1. append this token's key and value (the last chunk holds its position)
    if (c == C - 1) {
        const long long dst = row(pos);
        for (int d = tid; d < hd; d += nthreads) {
            pool_k[dst + d] = from_float<storage_t>(to_float(k[s * ldk + (long long)kvh * hd + d]));
            pool_v[dst + d] = from_float<storage_t>(to_float(v[s * ldv + (long long)kvh * hd + d]));
        }
    }
    // 2. attend over the chunk's positions through the table
    decode_attend(q, s, kvh, H / Hkv, hd, begin, end, ldq, scale, [&](long long j, int d, float& kf, float& vf) {
        const long long at = row(j) + d;
        kf = to_float(pool_k[at]);
        vf = to_float(pool_v[at]);
    }, emit);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* pool_k, storage_t* pool_v,
                       const int* tables, const int* lengths, act_t* out, int H, int Hkv, int hd, int bs, int B,
                       long long ldq, long long ldk, long long ldv, long long ldo, float scale) {
    const int g = H / Hkv;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;
    paged_decode_block(q, k, v, pool_k, pool_v, tables, lengths, H, Hkv, hd, bs, B, ldq, ldk, ldv, scale, 0, 1,
                       decode_write_out(out, blockIdx.y, blockIdx.x, g, hd, ldo));
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_decode_attention_split(const act_t* q, const act_t* k, const act_t* v, storage_t* pool_k, storage_t* pool_v,
                             const int* tables, const int* lengths, float* part, int H, int Hkv, int hd, int bs,
                             int B, long long ldq, long long ldk, long long ldv, float scale) {
    const int g = H / Hkv, c = blockIdx.z, C = gridDim.z;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;
    paged_decode_block(q, k, v, pool_k, pool_v, tables, lengths, H, Hkv, hd, bs, B, ldq, ldk, ldv, scale, c, C,
                       decode_write_partial(part, blockIdx.y, blockIdx.x, g, hd, H, c, C));
}
