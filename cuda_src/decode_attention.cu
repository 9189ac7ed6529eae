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
// Work split: warp w takes positions w, w + NWARPS, ...; its lanes split the head dim (d = lane + 32 i); each warp
// keeps an online softmax per query head of the group; the warps' partial results are merged in shared memory.
// Preconditions (checked by the wrapper; the kernel writes nothing otherwise): H % Hkv == 0, H / Hkv <= MAX_GROUP,
// hd <= MAX_HEAD_DIM.
// Defines: T_STORAGE (cache), T_ACT (q, k, v, out), NWARPS (default 4), MAX_HEAD_DIM (multiple of 32, default
// 128), MAX_GROUP (default 8).
#include "common.cuh"

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
              "decode_attention: shared memory over 48 KiB; lower NWARPS, MAX_GROUP or MAX_HEAD_DIM");

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention(const act_t* q, const act_t* k, const act_t* v, storage_t* cache_k, storage_t* cache_v,
                 const long long* slots, const long long* starts, act_t* out, int H, int Hkv, int hd, int Lmax,
                 long long ldq, long long ldk, long long ldv, long long ldo, float scale) {
    __shared__ float q_s[MAX_GROUP][MAX_HEAD_DIM];
    __shared__ float m_s[NWARPS][MAX_GROUP];
    __shared__ float l_s[NWARPS][MAX_GROUP];
    __shared__ float acc_s[NWARPS][MAX_GROUP][MAX_HEAD_DIM];

    const int kvh = blockIdx.x, s = blockIdx.y;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane, nthreads = NWARPS * 32;
    const int g = H / Hkv;
    if (g > MAX_GROUP || hd > MAX_HEAD_DIM) return;

    const long long slot = slots[s], pos = starts[s], length = pos + 1;
    // No const / __restrict__ on the cache: the row appended below is read back after __syncthreads, which the
    // read-only (non-coherent) cache path would not guarantee.
    storage_t* kc = cache_k + (slot * Hkv + kvh) * (long long)Lmax * hd;
    storage_t* vc = cache_v + (slot * Hkv + kvh) * (long long)Lmax * hd;

    // 1. append this token's key and value (rounded to the storage type, as the reference stores them)
    for (int d = tid; d < hd; d += nthreads) {
        kc[pos * hd + d] = from_float<storage_t>(to_float(k[s * ldk + (long long)kvh * hd + d]));
        vc[pos * hd + d] = from_float<storage_t>(to_float(v[s * ldv + (long long)kvh * hd + d]));
    }
    // 2. the group's query heads, scaled, into shared memory
    for (int e = tid; e < g * hd; e += nthreads) {
        const int h = e / hd, d = e % hd;
        q_s[h][d] = to_float(q[s * ldq + (long long)(kvh * g + h) * hd + d]) * scale;
    }
    __syncthreads();

    // 3. online softmax over this warp's positions
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][DPL];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[h][i] = 0.0f;
    }
    for (long long j = warp; j < length; j += NWARPS) {
        float kf[DPL], vf[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            kf[i] = d < hd ? to_float(kc[j * hd + d]) : 0.0f;
            vf[i] = d < hd ? to_float(vc[j * hd + d]) : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            if (h < g) {                                   // g is uniform: every lane takes the same branch
                float part = 0.0f;
#pragma unroll
                for (int i = 0; i < DPL; ++i) {
                    const int d = lane + 32 * i;
                    if (d < hd) part += q_s[h][d] * kf[i];
                }
                const float score = warp_sum(part);
                const float m_new = fmaxf(m[h], score);
                const float corr = expf(m[h] - m_new);     // 0 on the warp's first position (m = -inf)
                const float p = expf(score - m_new);
                l[h] = l[h] * corr + p;
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[h][i] = acc[h][i] * corr + p * vf[i];
                m[h] = m_new;
            }
        }
    }

    // 4. merge the warps: out = sum_w acc_w exp(m_w - M) / sum_w l_w exp(m_w - M), M = max_w m_w
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        if (h < g) {
            if (lane == 0) {
                m_s[warp][h] = m[h];
                l_s[warp][h] = l[h];
            }
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < hd) acc_s[warp][h][d] = acc[h][i];
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < g * hd; e += nthreads) {
        const int h = e / hd, d = e % hd;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, m_s[w][h]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            if (m_s[w][h] == NEG_INF) continue;            // a warp that had no position (length < NWARPS)
            const float f = expf(m_s[w][h] - M);
            num += acc_s[w][h][d] * f;
            den += l_s[w][h] * f;
        }
        out[s * ldo + (long long)(kvh * g + h) * hd + d] = from_float<act_t>(num / den);
    }
}
