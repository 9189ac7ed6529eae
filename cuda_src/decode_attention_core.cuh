// The attention half of decode attention (Deep-Fusion region 2), shared by decode_attention.cu (float cache) and
// decode_attention_quant.cu (quantized cache). One block attends the g = H / Hkv query heads of KV head kvh of
// sequence s (GQA: query head kvh * g + h) over a range [begin, end) of its positions, softmax(q k^T * scale) v,
// numerically stable (online softmax with a running maximum). The kernel first appends its token's row (in its
// cache format) and then calls decode_attend; `read_kv(j, d, kf, vf)` gives position j's key and value at head dim
// d (d < hd) as floats. decode_attend starts with a __syncthreads, so a row the block appended may be read back.
//
// Two ways to use it, one block shape:
// - single pass (grid (Hkv, S)): the block takes all positions 0 .. length - 1 and writes the normalized output;
// - flash-decoding (grid (Hkv, S, C)): a batch of one sequence has only Hkv blocks (25 for gpt2-1.5b, on 132 SMs),
//   each reading its whole context in turn: 27 us for 2 MB (bench/results/gpu-check-2026-11-27). Block (kvh, s, c)
//   takes chunk c of C (decode_chunk: [length c / C, length (c + 1) / C), read on the device from the sequence's
//   own length, so a CUDA graph captured with a fixed C stays right as the context grows; a chunk past a short
//   sequence's end is empty) and writes its partial (running max m, sum l of exp(score - m), the unnormalized
//   sum acc of exp(score - m) v) to a float32 workspace; decode_combine then merges the C partials of each query
//   head, in chunk order (deterministic: no atomics), with the usual rescaling by exp(m_c - max_c m_c).
//
// Work split inside a block: warp w takes positions begin + w, begin + w + NWARPS, ...; its lanes split the head
// dim (d = lane + 32 i); each warp keeps an online softmax per query head of the group and loads the next
// position's K and V before it computes the current one (the loop is bound by load latency, not bandwidth); the
// warps' partial results are merged in shared memory. Defines: NWARPS (default 4), MAX_HEAD_DIM (multiple of 32,
// default 128), MAX_GROUP (default 8).
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

// Chunk c of C of a sequence of `length` positions: [begin, end), the chunks as even as integers allow. The last
// chunk is never empty (it holds position length - 1, the row the step appends); the others are empty only when
// length < C.
__device__ __forceinline__ void decode_chunk(long long length, int c, int C, long long& begin, long long& end) {
    begin = length * c / C;
    end = length * (c + 1) / C;
}

// The partial of one (sequence, query head, chunk) in the workspace part [S, H, C, 2 + hd] float32: m, l, acc[hd].
template <class F>
__device__ __forceinline__ F* decode_partial(F* part, int s, int head, int c, int H, int C, int hd) {
    return part + (((long long)s * H + head) * C + c) * (2 + hd);
}

// Positions [begin, end) of (sequence s, KV head kvh) for the group's query heads; emit(h, d, m, l, acc) is called
// once per (query head h < g, d < hd) after the warps are merged: m the block's maximum score, l = sum exp(score -
// m), acc = sum exp(score - m) v[d] (m = -inf and l = acc = 0 for an empty range).
template <class ReadKV, class Emit>
__device__ void decode_attend(const act_t* q, int s, int kvh, int g, int hd, long long begin, long long end,
                              long long ldq, float scale, ReadKV read_kv, Emit emit) {
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

    // 3. online softmax over this warp's positions; kf, vf hold position j, kn, vn the next one (loaded early)
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][DPL];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[h][i] = 0.0f;
    }
    float kn[DPL], vn[DPL];
    auto load = [&](long long j) {
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            kn[i] = vn[i] = 0.0f;
            if (d < hd) read_kv(j, d, kn[i], vn[i]);
        }
    };
    if (begin + warp < end) load(begin + warp);
    for (long long j = begin + warp; j < end; j += NWARPS) {
        float kf[DPL], vf[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            kf[i] = kn[i];
            vf[i] = vn[i];
        }
        if (j + NWARPS < end) load(j + NWARPS);            // uniform over the warp
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

    // 4. merge the warps: M = max_w m_w, l = sum_w l_w exp(m_w - M), acc = sum_w acc_w exp(m_w - M)
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
            if (m_s[w][h] == NEG_INF) continue;            // a warp that had no position (fewer than NWARPS)
            const float f = expf(m_s[w][h] - M);
            num += acc_s[w][h][d] * f;
            den += l_s[w][h] * f;
        }
        emit(h, d, M, den, num);
    }
}

// The single pass's emit: out[s, (kvh g + h) hd + d] = acc / l.
__device__ __forceinline__ auto decode_write_out(act_t* out, int s, int kvh, int g, int hd, long long ldo) {
    return [=](int h, int d, float, float l, float acc) {
        out[s * ldo + (long long)(kvh * g + h) * hd + d] = from_float<act_t>(acc / l);
    };
}

// Flash-decoding's emit: the chunk's partial (m, l, acc) into the workspace (decode_partial).
__device__ __forceinline__ auto decode_write_partial(float* part, int s, int kvh, int g, int hd, int H, int c,
                                                     int C) {
    return [=](int h, int d, float m, float l, float acc) {
        float* row = decode_partial(part, s, kvh * g + h, c, H, C, hd);
        if (d == 0) {
            row[0] = m;
            row[1] = l;
        }
        row[2 + d] = acc;
    };
}

// out[s, e] (e = head hd + d < H hd) from the C partials of (s, head), merged in chunk order: M = max_c m_c,
// out = sum_c acc_c exp(m_c - M) / sum_c l_c exp(m_c - M); an empty chunk (m = -inf) adds nothing. Every
// sequence has a non-empty chunk (its last), so M is finite.
__device__ __forceinline__ void decode_combine(const float* part, act_t* out, int s, int e, int H, int hd, int C,
                                               long long ldo) {
    const int head = e / hd, d = e % hd;
    const float* row0 = decode_partial(part, s, head, 0, H, C, hd);
    float M = NEG_INF;
    for (int c = 0; c < C; ++c) M = fmaxf(M, row0[c * (2 + hd)]);
    float num = 0.0f, den = 0.0f;
    for (int c = 0; c < C; ++c) {
        const float* row = row0 + c * (2 + hd);
        if (row[0] == NEG_INF) continue;
        const float f = expf(row[0] - M);
        num += row[2 + d] * f;
        den += row[1] * f;
    }
    out[s * ldo + e] = from_float<act_t>(num / den);
}
