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
// Launch: grid (T), block (BLOCK): block t copies token t's Hkv rows.
//
// kernel paged_decode_attention(const act_t* q, const storage_t* pool_k, const storage_t* pool_v,
//                               const int* tables, const int* lengths, act_t* out, int H, int Hkv, int hd,
//                               int bs, int B, long long ldq, long long ldo, float scale)
//   q       [S, H, hd]: one token per sequence, rows ldq elements apart, heads hd apart
//   tables  [S, B] int32, -1 past a sequence's blocks; lengths [S] int32: positions sequence s attends
//           (start + 1: its new row already appended), 1 <= lengths[s] <= B * bs
//   out     [S, H * hd] rows ldo apart
// Launch: grid (Hkv, S), block (32, NWARPS); no dynamic shared memory. Block (kvh, s) attends the g = H / Hkv query
// heads kvh * g .. kvh * g + g - 1 (GQA) over the first lengths[s] positions, softmax(q k^T * scale) v: the group
// shares every K and V row it loads. Work split: warp w takes the table's blocks w, w + NWARPS, ... (one table
// read per block, then the block's bs rows of head kvh, contiguous: bs * hd elements) and its lanes split the head
// dim (d = lane + 32 i); each warp keeps an online softmax (running max and sum, float32) per query head, and the
// warps' partials are merged in shared memory. A table entry past the length (maybe -1) and the rows of the last
// block past it (another sequence's stale rows) are never read.
// Preconditions (checked by the wrapper; the kernel writes nothing otherwise): H % Hkv == 0, H / Hkv <= MAX_GROUP,
// hd <= MAX_HEAD_DIM.
// Defines: T_STORAGE (pools), T_ACT (k, v, q, out), BLOCK (append, default 128), NWARPS (default 4), MAX_HEAD_DIM
// (multiple of 32, default 128), MAX_GROUP (default 8): the dense decode kernel's bounds (decode_attention.cu).
#include "common.cuh"

#ifndef BLOCK
#define BLOCK 128
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 128
#endif
#ifndef MAX_GROUP
#define MAX_GROUP 8
#endif
#define DPL (MAX_HEAD_DIM / 32)   // head dims per lane

static_assert(MAX_HEAD_DIM % 32 == 0, "MAX_HEAD_DIM must be a multiple of 32");
static_assert(sizeof(float) * (MAX_GROUP * MAX_HEAD_DIM * (NWARPS + 1) + 2 * NWARPS * MAX_GROUP) <= 48 * 1024,
              "paged decode attention: shared memory over 48 KiB; lower NWARPS, MAX_GROUP or MAX_HEAD_DIM");

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

// One warp's online softmax state for the g query heads of its block: running max m, sum l of exp(score - m) and
// acc = sum exp(score - m) v (lane's head dims d = lane + 32 i).
struct WarpSoftmax {
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][DPL];

    __device__ void reset() {
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            m[h] = NEG_INF;
            l[h] = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[h][i] = 0.0f;
        }
    }

    // One position: its key kf and value vf (this lane's head dims) against the group's scaled queries q_s.
    __device__ void add(const float (*q_s)[MAX_HEAD_DIM], const float (&kf)[DPL], const float (&vf)[DPL], int g,
                        int hd) {
        const int lane = threadIdx.x;
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            if (h >= g) break;                                 // g is uniform: the whole warp leaves together
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < hd) part += q_s[h][d] * kf[i];
            }
            const float score = warp_sum(part);
            const float m_new = fmaxf(m[h], score);
            const float corr = expf(m[h] - m_new);             // 0 at the warp's first position (m = -inf)
            const float p = expf(score - m_new);
            l[h] = l[h] * corr + p;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[h][i] = acc[h][i] * corr + p * vf[i];
            m[h] = m_new;
        }
    }
};

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_decode_attention(const act_t* q, const storage_t* pool_k, const storage_t* pool_v, const int* tables,
                       const int* lengths, act_t* out, int H, int Hkv, int hd, int bs, int B, long long ldq,
                       long long ldo, float scale) {
    __shared__ float q_s[MAX_GROUP][MAX_HEAD_DIM];
    __shared__ float m_s[NWARPS][MAX_GROUP];
    __shared__ float l_s[NWARPS][MAX_GROUP];
    __shared__ float acc_s[NWARPS][MAX_GROUP][MAX_HEAD_DIM];
    const int kvh = blockIdx.x, s = blockIdx.y;
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int g = H / Hkv;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;
    const long long length = lengths[s];
    const int* table = tables + (long long)s * B;

    // 1. the group's query heads, scaled, into shared memory
    for (int e = tid; e < g * hd; e += NWARPS * 32) {
        const int h = e / hd, d = e % hd;
        q_s[h][d] = to_float(q[s * ldq + (long long)(kvh * g + h) * hd + d]) * scale;
    }
    __syncthreads();

    // 2. online softmax over this warp's blocks: rows 0 .. used - 1 of block table[b], used = bs but in the last
    WarpSoftmax sm;
    sm.reset();
    const long long blocks = (length + bs - 1) / bs;
    for (long long b = warp; b < blocks; b += NWARPS) {
        const long long base = ((long long)table[b] * Hkv + kvh) * bs * hd;
        const int used = (int)min((long long)bs, length - b * bs);
        for (int r = 0; r < used; ++r) {
            float kf[DPL], vf[DPL];
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                kf[i] = d < hd ? to_float(pool_k[base + (long long)r * hd + d]) : 0.0f;
                vf[i] = d < hd ? to_float(pool_v[base + (long long)r * hd + d]) : 0.0f;
            }
            sm.add(q_s, kf, vf, g, hd);
        }
    }

    // 3. merge the warps: out = sum_w acc_w exp(m_w - M) / sum_w l_w exp(m_w - M), M = max_w m_w
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {              // compile-time h: the state stays in registers
        if (h >= g) break;
        if (lane == 0) {
            m_s[warp][h] = sm.m[h];
            l_s[warp][h] = sm.l[h];
        }
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            if (d < hd) acc_s[warp][h][d] = sm.acc[h][i];
        }
    }
    __syncthreads();
    for (int e = tid; e < g * hd; e += NWARPS * 32) {
        const int h = e / hd, d = e % hd;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, m_s[w][h]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            if (m_s[w][h] == NEG_INF) continue;                // a warp with no block (fewer blocks than warps)
            const float f = expf(m_s[w][h] - M);
            num += acc_s[w][h][d] * f;
            den += l_s[w][h] * f;
        }
        out[s * ldo + (long long)(kvh * g + h) * hd + d] = from_float<act_t>(num / den);
    }
}
