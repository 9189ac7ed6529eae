// The attention half of decode attention (Deep-Fusion region 2), shared by decode_attention.cu (float cache) and
// decode_attention_quant.cu (quantized cache): block (kvh, s) of a grid (Hkv, S), block (32, NWARPS), attends the
// g = H / Hkv query heads of KV head kvh over positions 0 .. length - 1, GQA (query head kvh * g + h), softmax(q k^T
// * scale) v, numerically stable (online softmax with a running maximum). The kernel first appends its token's row
// (in its cache format) and then calls decode_attend; `read_kv(j, d, kf, vf)` gives position j's key and value at
// head dim d (d < hd) as floats. decode_attend starts with a __syncthreads, so a row the block appended may be
// read back. Work split: warp w takes positions w, w + NWARPS, ...; its lanes split the head dim (d = lane + 32 i);
// each warp keeps an online softmax per query head of the group; the warps' partial results are merged in shared
// memory. Defines: NWARPS (default 4), MAX_HEAD_DIM (multiple of 32, default 128), MAX_GROUP (default 8).
#pragma once
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
              "decode attention: shared memory over 48 KiB; lower NWARPS, MAX_GROUP or MAX_HEAD_DIM");

template <class ReadKV>
__device__ void decode_attend(const act_t* q, act_t* out, int s, int kvh, int g, int hd, long long length,
                              long long ldq, long long ldo, float scale, ReadKV read_kv) {
    __shared__ float q_s[MAX_GROUP][MAX_HEAD_DIM];
    __shared__ float m_s[NWARPS][MAX_GROUP];
    __shared__ float l_s[NWARPS][MAX_GROUP];
    __shared__ float acc_s[NWARPS][MAX_GROUP][MAX_HEAD_DIM];
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane, nthreads = NWARPS * 32;

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
            kf[i] = vf[i] = 0.0f;
            if (d < hd) read_kv(j, d, kf[i], vf[i]);
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
