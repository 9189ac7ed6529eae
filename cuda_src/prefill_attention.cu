// Prefill attention: causal attention of each sequence's new tokens over its KV cache, GQA, tiled. Token i of
// sequence s (at position starts[s] + i) attends positions 0 .. starts[s] + i of cache slot slots[s]; the new keys
// and values must already be in the cache (kv_append.cu, launched before). Sequences of different lengths are
// packed without padding: offsets[s] .. offsets[s + 1] - 1 are sequence s's tokens. Reference: NumpyOps.attention
// on a prefill step (_causal_attention per sequence).
//
// kernel prefill_attention(const act_t* q, const storage_t* cache_k, const storage_t* cache_v,
//                          const long long* slots, const long long* starts, const long long* offsets, act_t* out,
//                          int H, int Hkv, int hd, int Lmax, long long ldq, long long ldo, float scale)
//   q      [T, H, hd]: token rows ldq elements apart, heads hd apart (a view into qkv is fine)
//   cache_k, cache_v [N, Hkv, Lmax, hd] contiguous; slots, starts [S] int64; offsets [S + 1] int64
//   out    [T, H * hd] rows ldo apart
// Launch: grid (Hkv, ceil(max_count / TPB), S), block (32, NWARPS), where TPB = (NWARPS * ROWS_PER_WARP) / g and
// g = H / Hkv: block (kvh, y, s) takes tokens y*TPB .. y*TPB + TPB - 1 of sequence s (exits past its count) and
// the g query heads of KV head kvh: its rows are (token, head) pairs, token-major, row r to warp r % NWARPS.
// Tiles of KT positions of K and V are staged in shared memory (float) and shared by all the block's rows; each
// row keeps an online softmax (running max, sum and output in registers: lane j scores key j of the tile, lanes
// split the head dim for the output).
// Preconditions (checked by the wrapper): H % Hkv == 0, H / Hkv <= NWARPS * ROWS_PER_WARP, hd <= MAX_HEAD_DIM,
// starts[s] + count(s) <= Lmax.
// CAUSAL=0 (encoders, NumpyOps.bidirectional_attention): every token attends all count(s) positions of its slot
// (start + count keys; the wrapper packs the sequences' K and V into a scratch cache with kv_append first).
// Defines: T_STORAGE (cache), T_ACT (q, out), CAUSAL (default 1), NWARPS (default 4), ROWS_PER_WARP (default 4), MAX_HEAD_DIM
// (multiple of 32, default 128), KT (keys per tile, <= 32, default 32). Shared memory must stay <= 48 KiB
// (checked at compile time): for hd 256 use e.g. ROWS_PER_WARP=2 KT=16.
#include "common.cuh"

#ifndef CAUSAL
#define CAUSAL 1
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef ROWS_PER_WARP
#define ROWS_PER_WARP 4
#endif
#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 128
#endif
#ifndef KT
#define KT 32
#endif
#define RPB (NWARPS * ROWS_PER_WARP)   // query rows per block
#define DPL (MAX_HEAD_DIM / 32)         // head dims per lane

static_assert(MAX_HEAD_DIM % 32 == 0, "MAX_HEAD_DIM must be a multiple of 32");
static_assert(KT >= 1 && KT <= 32, "KT must be between 1 and 32");
static_assert(sizeof(float) * (RPB * MAX_HEAD_DIM + KT * (MAX_HEAD_DIM + 1) + KT * MAX_HEAD_DIM) <= 48 * 1024,
              "prefill_attention: shared memory over 48 KiB; lower ROWS_PER_WARP, NWARPS, KT or MAX_HEAD_DIM");

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
prefill_attention(const act_t* q, const storage_t* cache_k, const storage_t* cache_v, const long long* slots,
                  const long long* starts, const long long* offsets, act_t* out, int H, int Hkv, int hd, int Lmax,
                  long long ldq, long long ldo, float scale) {
    __shared__ float q_s[RPB][MAX_HEAD_DIM];
    __shared__ float k_s[KT][MAX_HEAD_DIM + 1];   // +1: lane j reads row j, conflict-free
    __shared__ float v_s[KT][MAX_HEAD_DIM];

    const int kvh = blockIdx.x, s = blockIdx.z;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane, nthreads = NWARPS * 32;
    const int g = H / Hkv;
    const int tpb = RPB / g;                       // tokens per block
    if (tpb == 0 || hd > MAX_HEAD_DIM) return;

    const long long first = offsets[s], count = offsets[s + 1] - first;
    const long long t0 = (long long)blockIdx.y * tpb;
    if (t0 >= count) return;                       // the whole block leaves together
    const int nt = (int)min((long long)tpb, count - t0);
    const int nrows = nt * g;
    const long long start = starts[s], slot = slots[s];
#if CAUSAL
    const long long n_keys = start + t0 + nt;     // the block's last token sees positions 0 .. n_keys - 1
#else
    const long long n_keys = start + count;       // every token sees its whole sequence
#endif
    const storage_t* kc = cache_k + (slot * Hkv + kvh) * (long long)Lmax * hd;
    const storage_t* vc = cache_v + (slot * Hkv + kvh) * (long long)Lmax * hd;

    for (int e = tid; e < nrows * hd; e += nthreads) {
        const int r = e / hd, d = e % hd;
        const int i = r / g, h = r % g;
        q_s[r][d] = to_float(q[(first + t0 + i) * ldq + (long long)(kvh * g + h) * hd + d]) * scale;
    }

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DPL];
#pragma unroll
    for (int jr = 0; jr < ROWS_PER_WARP; ++jr) {
        m[jr] = NEG_INF;
        l[jr] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[jr][i] = 0.0f;
    }

    for (long long kt = 0; kt < n_keys; kt += KT) {
        __syncthreads();                           // the previous tile is consumed (and q_s is written)
        for (int e = tid; e < KT * hd; e += nthreads) {
            const int j = e / hd, d = e % hd;
            const long long key = kt + j;
            float kv = 0.0f, vv = 0.0f;
            if (key < n_keys) {
                kv = to_float(kc[key * hd + d]);
                vv = to_float(vc[key * hd + d]);
            }
            k_s[j][d] = kv;
            v_s[j][d] = vv;
        }
        __syncthreads();

#pragma unroll
        for (int jr = 0; jr < ROWS_PER_WARP; ++jr) {
            const int r = warp + NWARPS * jr;      // uniform over the warp
            if (r < nrows) {
                const long long qpos = start + t0 + r / g;
                const long long key = kt + lane;
                const bool valid = lane < KT && (CAUSAL ? key <= qpos : key < n_keys);
                float score = NEG_INF;
                if (valid) {
                    float dot = 0.0f;
                    for (int d = 0; d < hd; ++d) dot += q_s[r][d] * k_s[lane][d];
                    score = dot;
                }
                // The first tile holds key 0 <= qpos, so m is finite from then on; a later tile whose keys are all
                // in this row's future gives tile_max = -inf, m_new = m, corr = 1 and p = 0.
                const float tile_max = warp_max(score);
                const float m_new = fmaxf(m[jr], tile_max);
                const float corr = expf(m[jr] - m_new);
                const float p = valid ? expf(score - m_new) : 0.0f;
                l[jr] = l[jr] * corr + warp_sum(p);
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[jr][i] *= corr;
                for (int jj = 0; jj < KT; ++jj) {
                    const float pj = __shfl_sync(FULL_MASK, p, jj);
#pragma unroll
                    for (int i = 0; i < DPL; ++i) {
                        const int d = lane + 32 * i;
                        if (d < hd) acc[jr][i] += pj * v_s[jj][d];
                    }
                }
                m[jr] = m_new;
            }
        }
    }

#pragma unroll
    for (int jr = 0; jr < ROWS_PER_WARP; ++jr) {
        const int r = warp + NWARPS * jr;
        if (r < nrows) {
            const int i = r / g, h = r % g;
            const float inv = 1.0f / l[jr];
            act_t* o = out + (first + t0 + i) * ldo + (long long)(kvh * g + h) * hd;
#pragma unroll
            for (int i2 = 0; i2 < DPL; ++i2) {
                const int d = lane + 32 * i2;
                if (d < hd) o[d] = from_float<act_t>(acc[jr][i2] * inv);
            }
        }
    }
}
