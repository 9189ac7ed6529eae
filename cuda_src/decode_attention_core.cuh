// The attention half of decode attention (Deep-Fusion region 2), shared by decode_attention.cu (dense float cache),
// paged_attention.cu (paged pool) and decode_attention_quant.cu (quantized cache). One block (kvh, s, c) attends the
// GROUP = H / Hkv query heads of KV head kvh of sequence s (GQA: query head kvh * GROUP + h) over chunk c of C of
// the sequence's positions, softmax(q k^T * scale) v with an online softmax in float32; the including kernel first
// appends its token's row (in its cache format) and stages the group's query heads (decode_stage_q, rotary fused).
//
// Bandwidth (issue 29): a K or V row is read in vectors of VEC elements (16 bytes of a float cache: 4 float32 or 8
// half; 8 values of a quantized row), a row by LP lanes (LP = the power of two <= min(32, hd / VEC); each lane NV
// vectors), so a warp has PPW = 32 / LP positions in flight at once, and loads the next ones before it computes
// these (for hd = 128 in float16: 16 lanes a row, 2 positions a warp, 4 in flight). Each lane group keeps its own
// online softmax; a score is summed over its LP lanes by xor shuffles; at the end the lane groups of a warp are
// merged by shuffles, the warps through shared memory (always in the same order: deterministic).
//
// Split and combine in ONE launch (flash-decoding without a second kernel): a batch of one sequence has only Hkv
// blocks (25 for gpt2-1.5b on 132 SMs), so the wrapper splits each context into C chunks (grid (Hkv, S, C)); chunk c
// is [length c / C, length (c + 1) / C) of the sequence's own length, read on the device, so a CUDA graph captured
// with a fixed C stays right as the context grows. With C = 1 the block writes the normalized output. With C > 1
// each block writes its partial (running max m, sum l of exp(score - m), unnormalized acc) into a float32 workspace
// part [S, H, C, 2 + hd], fences, and counts itself done on counters[s * Hkv + kvh] (atomicAdd); the block that
// finds itself the C-th merges the C partials of its group IN CHUNK ORDER (M = max_c m_c, out = sum_c acc_c
// exp(m_c - M) / sum_c l_c exp(m_c - M); an empty chunk, m = -inf, adds nothing) and resets the counter to 0 for the
// next launch. Whichever block finishes last, the sums run in the same order: the result is deterministic.
// Precondition: the counters are zero at launch (the wrapper keeps them; each launch leaves them zero), and no two
// launches sharing counters run at once (one stream).
//
// Defines: HEAD_DIM (the head dim, exactly), GROUP (H / Hkv, exactly), NWARPS (default 4); KV_VEC (elements per
// vector load; the including file may set it, default 16 bytes of storage_t), reduced to a power of two dividing
// HEAD_DIM.
#pragma once
#include "common.cuh"

#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef KV_VEC
#define KV_VEC (16 / (int)sizeof(storage_t))
#endif

namespace dec {
constexpr int vec_width(int want, int hd) {
    int v = want;
    while (v > 1 && hd % v) v /= 2;
    return v;
}
constexpr int pow2_floor(int x) {
    int p = 1;
    while (p * 2 <= x) p *= 2;
    return p;
}
constexpr int VEC = vec_width(KV_VEC, HEAD_DIM);         // elements per vector load
constexpr int VECS = HEAD_DIM / VEC;                      // vectors per row
constexpr int LP = pow2_floor(VECS < 32 ? VECS : 32);     // lanes per position
constexpr int NV = (VECS + LP - 1) / LP;                  // vectors per lane
constexpr int PPW = 32 / LP;                              // positions per warp at once
constexpr int UNITS = NWARPS * PPW;                       // positions per block at once
}  // namespace dec

static_assert(sizeof(float) * (GROUP * HEAD_DIM * (NWARPS + 1) + 2 * NWARPS * GROUP + 2 * HEAD_DIM) <= 48 * 1024,
              "decode attention: shared memory over 48 KiB; lower NWARPS (or the group / head dim is too large)");

// Shared by the block: the group's query heads (scaled, rotated) and the quantized kernel's new row as floats.
__shared__ float dec_q_s[GROUP][HEAD_DIM];
__shared__ float dec_new_s[2][HEAD_DIM];

// Chunk c of C of a sequence of `length` positions: [begin, end), as even as integers allow. The last chunk is never
// empty (it holds position length - 1, the row the step appends); the others are empty only when length < C.
__device__ __forceinline__ void decode_chunk(long long length, int c, int C, long long& begin, long long& end) {
    begin = length * c / C;
    end = length * (c + 1) / C;
}

// Rotary embedding (half-split, NumpyOps.rotary): element d of a head row x after rotation by the position's cos /
// sin rows (dim / 2 floats each); dims >= dim pass through, dim = 0 rotates nothing. The products are rounded one by
// one (__fmul_rn: no fused multiply-add), as NumPy computes them.
__device__ __forceinline__ float rope_at(const act_t* x, int d, const float* cos, const float* sin, int dim) {
    if (d >= dim) return to_float(x[d]);
    const int half = dim / 2;
    if (d < half) return __fmul_rn(to_float(x[d]), cos[d]) - __fmul_rn(to_float(x[d + half]), sin[d]);
    const int i = d - half;
    return __fmul_rn(to_float(x[d]), cos[i]) + __fmul_rn(to_float(x[i]), sin[i]);
}

// The group's query heads of sequence s into dec_q_s, rotated (rotary_dim > 0: cos, sin [S, rotary_dim / 2]) and
// scaled. The caller synchronizes before decode_attend.
__device__ __forceinline__ void decode_stage_q(const act_t* q, int s, int kvh, long long ldq, const float* cos,
                                               const float* sin, int rotary_dim, float scale) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const float* c = cos + (long long)s * (rotary_dim / 2);
    const float* sn = sin + (long long)s * (rotary_dim / 2);
    for (int e = tid; e < GROUP * HEAD_DIM; e += NWARPS * 32) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        const act_t* row = q + s * ldq + (long long)(kvh * GROUP + h) * HEAD_DIM;
        dec_q_s[h][d] = (rotary_dim > 0 ? rope_at(row, d, c, sn, rotary_dim) : to_float(row[d])) * scale;
    }
}

// The new key of sequence s, KV head kvh, at head dim d (rotated when rotary_dim > 0).
__device__ __forceinline__ float decode_new_k(const act_t* k, int s, int kvh, long long ldk, const float* cos,
                                              const float* sin, int rotary_dim, int d) {
    const act_t* row = k + s * ldk + (long long)kvh * HEAD_DIM;
    if (rotary_dim <= 0) return to_float(row[d]);
    const long long at = (long long)s * (rotary_dim / 2);
    return rope_at(row, d, cos + at, sin + at, rotary_dim);
}

// Where a block's result goes: out [S, H * hd] rows ldo apart; with C > 1 also the workspace part [S, H, C, 2 + hd]
// and counters [S * Hkv] (zero at launch, left zero).
struct DecodeOut {
    act_t* out;
    long long ldo;
    float* part;
    int* counters;
};

// part's row of (sequence s, query head, chunk c): m, l, acc[HEAD_DIM].
__device__ __forceinline__ float* decode_partial(float* part, int s, int head, int c, int H, int C) {
    return part + (((long long)s * H + head) * C + c) * (2 + HEAD_DIM);
}

// The last block of (s, kvh): merge the C partials of each of the group's query heads in chunk order into out.
__device__ void decode_combine(const DecodeOut& o, int s, int kvh, int H, int C) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
    for (int e = tid; e < GROUP * HEAD_DIM; e += NWARPS * 32) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM, head = kvh * GROUP + h;
        const float* row0 = decode_partial(o.part, s, head, 0, H, C);
        float M = NEG_INF;
        for (int c = 0; c < C; ++c) M = fmaxf(M, __ldcg(row0 + (long long)c * (2 + HEAD_DIM)));
        float num = 0.0f, den = 0.0f;
        for (int c = 0; c < C; ++c) {
            const float* row = row0 + (long long)c * (2 + HEAD_DIM);
            const float m = __ldcg(row);
            if (m == NEG_INF) continue;                   // an empty chunk
            const float f = expf(m - M);
            num += __ldcg(row + 2 + d) * f;
            den += __ldcg(row + 1) * f;
        }
        o.out[s * o.ldo + (long long)head * HEAD_DIM + d] = from_float<act_t>(num / den);
    }
}

// Merge online-softmax state (m, l, acc) with another's (mo, lo, ao): factors exp(m - M), 0 for an empty state.
__device__ __forceinline__ void merge_factors(float m, float mo, float& M, float& fa, float& fb) {
    M = fmaxf(m, mo);
    fa = m == NEG_INF ? 0.0f : expf(m - M);
    fb = mo == NEG_INF ? 0.0f : expf(mo - M);
}

// Positions [begin, end) of (sequence s, KV head kvh, chunk c of C) against dec_q_s (staged and synchronized by the
// caller); `read_kv(j, vi, kf, vf)` gives vector vi (head dims vi * VEC ..) of position j's key and value as floats.
// Writes the block's result as DecodeOut says (and, with C > 1, the last block of (s, kvh) combines). Call it last:
// a block that is not the last of its group returns from here.
template <class ReadKV>
__device__ void decode_attend(long long begin, long long end, int s, int kvh, int H, int c, int C,
                              const DecodeOut& o, ReadKV read_kv) {
    using namespace dec;
    __shared__ float m_s[NWARPS][GROUP];
    __shared__ float l_s[NWARPS][GROUP];
    __shared__ float acc_s[NWARPS][GROUP][HEAD_DIM];
    __shared__ int last_s;
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int sub = lane / LP, li = lane % LP;           // this lane's position within the warp, its part of a row

    // 1. this lane's slice of the query heads, the online softmax state, the first position's K and V
    float qr[GROUP][NV][VEC], m[GROUP], l[GROUP], acc[GROUP][NV][VEC];
    float kn[NV][VEC], vn[NV][VEC];
#pragma unroll
    for (int n = 0; n < NV; ++n) {
        const int vi = li + LP * n;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            kn[n][e] = vn[n][e] = 0.0f;
#pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                qr[h][n][e] = vi < VECS ? dec_q_s[h][vi * VEC + e] : 0.0f;
                acc[h][n][e] = 0.0f;
            }
        }
    }
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
    }
    auto load = [&](long long j) {
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int vi = li + LP * n;
            if (vi < VECS) read_kv(j, vi, kn[n], vn[n]);
        }
    };
    long long j = begin + warp * PPW + sub;              // this lane group's position: j, j + UNITS, ...
    if (j < end) load(j);

    // 2. the positions, PPW a warp at once; the loop runs while the warp's first lane group has one (uniform)
    for (long long first = begin + warp * PPW; first < end; first += UNITS, j += UNITS) {
        float kf[NV][VEC], vf[NV][VEC];
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                kf[n][e] = kn[n][e];
                vf[n][e] = vn[n][e];
            }
        if (j + UNITS < end) load(j + UNITS);             // the next positions in flight while these compute
        const bool valid = j < end;
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            float part = 0.0f;
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int e = 0; e < VEC; ++e) part += qr[h][n][e] * kf[n][e];
#pragma unroll
            for (int off = LP / 2; off > 0; off >>= 1) part += __shfl_xor_sync(FULL_MASK, part, off);
            if (valid) {
                const float m_new = fmaxf(m[h], part);
                const float corr = expf(m[h] - m_new);    // 0 on the first position (m = -inf)
                const float p = expf(part - m_new);
                l[h] = l[h] * corr + p;
#pragma unroll
                for (int n = 0; n < NV; ++n)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[h][n][e] = acc[h][n][e] * corr + p * vf[n][e];
                m[h] = m_new;
            }
        }
    }

    // 3. merge the lane groups of the warp (shuffles), then the warps (shared memory), in a fixed order
#pragma unroll
    for (int off = LP; off < 32; off <<= 1) {
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            float M, fa, fb;
            merge_factors(m[h], __shfl_xor_sync(FULL_MASK, m[h], off), M, fa, fb);
            l[h] = l[h] * fa + __shfl_xor_sync(FULL_MASK, l[h], off) * fb;
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    acc[h][n][e] = acc[h][n][e] * fa + __shfl_xor_sync(FULL_MASK, acc[h][n][e], off) * fb;
            m[h] = M;
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            if (li == 0) {
                m_s[warp][h] = m[h];
                l_s[warp][h] = l[h];
            }
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                const int vi = li + LP * n;
                if (vi < VECS)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc_s[warp][h][vi * VEC + e] = acc[h][n][e];
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < GROUP * HEAD_DIM; e += NWARPS * 32) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM, head = kvh * GROUP + h;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, m_s[w][h]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            if (m_s[w][h] == NEG_INF) continue;          // a warp that had no position
            const float f = expf(m_s[w][h] - M);
            num += acc_s[w][h][d] * f;
            den += l_s[w][h] * f;
        }
        if (C == 1) {
            o.out[s * o.ldo + (long long)head * HEAD_DIM + d] = from_float<act_t>(num / den);
        } else {
            float* row = decode_partial(o.part, s, head, c, H, C);
            if (d == 0) {
                row[0] = M;
                row[1] = den;
            }
            row[2 + d] = num;
        }
    }
    if (C == 1) return;

    // 4. count this chunk done; the C-th block of (s, kvh) to finish merges all C partials
    __threadfence();                                      // this block's partial visible device-wide ...
    __syncthreads();                                      // ... from every thread, before the count
    const int at = s * gridDim.x + kvh;
    if (tid == 0) last_s = atomicAdd(&o.counters[at], 1) == C - 1;
    __syncthreads();
    if (!last_s) return;
    __threadfence();                                      // the other blocks' partials, read through L2 (__ldcg)
    decode_combine(o, s, kvh, H, C);
    if (tid == 0) o.counters[at] = 0;                     // ready for the next launch
}
