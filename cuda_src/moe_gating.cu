// MoE gating and dispatch (DeepSpeed-MoE 5.4): top-k gating into a dense token->expert table, the scan that gives
// every (token, choice) its slot in its expert's buffer (with capacity drop), the expert->token tables, the scatter
// of token rows into expert order and the gather back with the gate weights. No one-hot tensors: O(T K D).
// References: hpcinfer/backend/moe_ops.py (top_k_gating, route, permute, unpermute); the tables below are exactly
// moe_ops.Routing's fields.
//
// Shapes: T tokens, E experts, K choices per token, D hidden, N = T * K (token, choice) pairs, pair i = (i / K, i % K);
// R = kept pairs (rows). Integer tables are int64; gate weights float32; logits, x, rows and out are act_t.
//
// kernel moe_topk_gating(const act_t* logits, long long* experts, float* weights, int T, int E, int K,
//                        long long ld, int normalize)
//   logits [T, E] rows ld apart -> experts [T, K] (decreasing probability; ties: the lower expert), weights [T, K]
//   (softmax probabilities over all E in float32; normalize=1: renormalized over the K chosen).
//   Preconditions (checked by the wrapper; nothing is written otherwise): 1 <= K <= E <= MAX_EXPERTS.
//   Launch: grid (ceil(T / NWARPS)), block (32, NWARPS): one warp per token.
//
// kernel moe_route(const long long* experts, const float* weights, int T, int K, int E, int capacity,
//                  long long* expert_counts, long long* offsets, long long* slot, long long* row_of_choice,
//                  long long* expert_of_row, long long* token_of_row, float* weight_of_row, long long* num_rows)
//   experts, weights [N] (the [T, K] tables) -> expert_counts [E] (after capacity), offsets [E + 1] (expert e's rows
//   are offsets[e] .. offsets[e + 1] - 1), slot [N] (-1: dropped), row_of_choice [N] (-1: dropped),
//   expert_of_row / token_of_row / weight_of_row [N] of which the first R = num_rows[0] are written, sorted by
//   expert, then token, then choice. capacity < 0: no limit. An expert id outside [0, E) is dropped.
//   Launch: grid (1), block (ROUTE_BLOCK) (1-D): a single-block scan; expert e's thread walks the pairs in
//   token-major order (staged CHUNK at a time in shared memory) and numbers its pairs: O(N) per thread, no atomics,
//   deterministic.
//
// kernel moe_gate_dispatch(const act_t* logits, int T, int E, int K, long long ld, int normalize, int capacity,
//                          long long* experts, float* weights, <moe_route's outputs>, const act_t* x,
//                          act_t* rows, int D, long long ldx, long long ldrows)
//   the fused kernel of the paper, for decode-sized T: gating + scan + tables + (PERMUTE=1) the scatter
//   rows[r] = x[token_of_row[r]] (rows [N, D] rows ldrows apart, the first R written), in one launch.
//   Launch: grid (1), block (ROUTE_BLOCK) (1-D).
//
// kernel moe_permute(const act_t* x, const long long* token_of_row, const long long* num_rows, act_t* rows, int D,
//                    long long ldx, long long ldrows)
//   rows[r, :] = x[token_of_row[r], :] for r < num_rows[0] (read on the device: no host round trip).
//   Launch: grid (N) (an upper bound on R; blocks past R exit), block (BLOCK).
//
// kernel moe_unpermute(const act_t* rows, const long long* row_of_choice, const float* weight_of_row, act_t* out,
//                      int T, int K, int D, long long ldrows, long long ldo)
//   out[t, :] = sum over kept choices c, in choice order, of weight_of_row[row] * rows[row, :], row =
//   row_of_choice[t, c] (zero when every choice was dropped). A gather: no atomics, deterministic; the products and
//   sums are rounded as the reference's (no fused multiply-add).
//   Launch: grid (T), block (BLOCK).
//
// Defines: T_ACT (and T_STORAGE, its default), MAX_EXPERTS (multiple of 32, <= 1024; default 256), NWARPS (8),
// ROUTE_BLOCK (1-D block of the single-block kernels, multiple of 32; default 1024), CHUNK (pairs staged per
// round; default 2048), BLOCK (256), PERMUTE (moe_gate_dispatch scatters the rows; default 1).
#include "common.cuh"

#ifndef MAX_EXPERTS
#define MAX_EXPERTS 256
#endif
#ifndef NWARPS
#define NWARPS 8
#endif
#ifndef ROUTE_BLOCK
#define ROUTE_BLOCK 1024
#endif
#ifndef CHUNK
#define CHUNK 2048
#endif
#ifndef BLOCK
#define BLOCK 256
#endif
#ifndef PERMUTE
#define PERMUTE 1
#endif
#define EPL (MAX_EXPERTS / 32)   // experts per lane

static_assert(MAX_EXPERTS % 32 == 0 && MAX_EXPERTS <= 1024, "MAX_EXPERTS must be a multiple of 32, at most 1024");
static_assert(ROUTE_BLOCK % 32 == 0 && ROUTE_BLOCK <= 1024, "ROUTE_BLOCK must be a multiple of 32, at most 1024");

// One warp gates one token: softmax over E, then K rounds of a warp argmax (ties: the lower index), as the
// reference's k passes of argmax. Lane 0 writes the K choices.
__device__ __forceinline__ void gate_token(const act_t* row, int E, int K, int normalize, long long* experts_t,
                                           float* weights_t) {
    const int lane = threadIdx.x & 31;
    float p[EPL];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < E ? to_float(row[e]) : NEG_INF;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        if (e < E) {
            p[i] = expf(p[i] - mx);
            sum += p[i];
        }
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < EPL; ++i) p[i] = p[i] / sum;   // entries past E stay -inf and are never taken

    unsigned taken = 0u;   // bit i: expert lane + 32 i already chosen
    float wsum = 0.0f;
    for (int c = 0; c < K; ++c) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e = lane + 32 * i;
            if (e < E && !((taken >> i) & 1u) && (p[i] > bv || bi == 0x7fffffff)) {
                bv = p[i];   // ascending e within a lane: strict > keeps the lower index on ties
                bi = e;
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, offset);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, offset);
            if (oi != 0x7fffffff && (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);   // bi < E: K <= E leaves a candidate every round
        if (lane == 0) {
            experts_t[c] = bi;
            weights_t[c] = bv;
        }
        wsum += bv;
    }
    if (normalize && lane == 0) {
        for (int c = 0; c < K; ++c) weights_t[c] = weights_t[c] / wsum;
    }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
moe_topk_gating(const act_t* logits, long long* experts, float* weights, int T, int E, int K, long long ld,
                int normalize) {
    const int t = blockIdx.x * NWARPS + threadIdx.y;
    if (t >= T || E > MAX_EXPERTS || K < 1 || K > E) return;   // whole warps leave (preconditions: wrapper)
    gate_token(logits + (long long)t * ld, E, K, normalize, experts + (long long)t * K, weights + (long long)t * K);
}

// The scan and the tables; the whole (1-D) block calls it. `experts` and `slot` may have been written by this
// block before the call (the fused kernel): they are read with plain loads after a __syncthreads.
__device__ __forceinline__ void route_block(const long long* experts, const float* weights, int T, int K, int E,
                                            int capacity, long long* expert_counts, long long* offsets,
                                            long long* slot, long long* row_of_choice, long long* expert_of_row,
                                            long long* token_of_row, float* weight_of_row, long long* num_rows,
                                            int* total_rows) {
    __shared__ int cnt_s[MAX_EXPERTS];
    __shared__ int start_s[MAX_EXPERTS + 1];
    __shared__ int ex_s[CHUNK];
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int N = T * K;

    for (int e = tid; e < E; e += nthreads) cnt_s[e] = 0;
    __syncthreads();
    // slot of pair i = number of earlier pairs (token-major) with the same expert
    for (int base = 0; base < N; base += CHUNK) {
        const int len = min(CHUNK, N - base);
        for (int j = tid; j < len; j += nthreads) {
            const long long e = experts[base + j];
            const int ei = (e >= 0 && e < E) ? (int)e : -1;
            ex_s[j] = ei;
            if (ei < 0) slot[base + j] = -1;
        }
        __syncthreads();
        for (int e = tid; e < E; e += nthreads) {
            int c = cnt_s[e];
            for (int j = 0; j < len; ++j) {
                if (ex_s[j] == e) slot[base + j] = c++;
            }
            cnt_s[e] = c;
        }
        __syncthreads();
    }
    // capacity, then the exclusive scan of the kept counts (E <= MAX_EXPERTS: one thread is enough)
    for (int e = tid; e < E; e += nthreads) {
        const int kept = capacity < 0 ? cnt_s[e] : min(cnt_s[e], capacity);
        cnt_s[e] = kept;
        expert_counts[e] = kept;
    }
    __syncthreads();
    if (tid == 0) {
        int run = 0;
        for (int e = 0; e < E; ++e) {
            start_s[e] = run;
            offsets[e] = run;
            run += cnt_s[e];
        }
        start_s[E] = run;
        offsets[E] = run;
        num_rows[0] = run;
    }
    __syncthreads();
    // the expert->token tables: a kept pair's row is its expert's first row + its slot
    for (int i = tid; i < N; i += nthreads) {
        const long long e = experts[i];
        const long long sl = slot[i];
        const bool keep = e >= 0 && e < E && sl >= 0 && (capacity < 0 || sl < capacity);
        if (keep) {
            const long long row = start_s[e] + sl;
            row_of_choice[i] = row;
            expert_of_row[row] = e;
            token_of_row[row] = i / K;
            weight_of_row[row] = weights[i];
        } else {
            slot[i] = -1;
            row_of_choice[i] = -1;
        }
    }
    *total_rows = start_s[E];
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(ROUTE_BLOCK)
moe_route(const long long* experts, const float* weights, int T, int K, int E, int capacity,
          long long* expert_counts, long long* offsets, long long* slot, long long* row_of_choice,
          long long* expert_of_row, long long* token_of_row, float* weight_of_row, long long* num_rows) {
    if (E > MAX_EXPERTS) return;   // precondition, checked by the wrapper
    int total;
    route_block(experts, weights, T, K, E, capacity, expert_counts, offsets, slot, row_of_choice, expert_of_row,
                token_of_row, weight_of_row, num_rows, &total);
}

extern "C" __global__ void __launch_bounds__(ROUTE_BLOCK)
moe_gate_dispatch(const act_t* logits, int T, int E, int K, long long ld, int normalize, int capacity,
                  long long* experts, float* weights, long long* expert_counts, long long* offsets, long long* slot,
                  long long* row_of_choice, long long* expert_of_row, long long* token_of_row, float* weight_of_row,
                  long long* num_rows, const act_t* x, act_t* rows, int D, long long ldx, long long ldrows) {
    if (E > MAX_EXPERTS || K < 1 || K > E) return;   // preconditions, checked by the wrapper
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int t = warp; t < T; t += warps) {
        gate_token(logits + (long long)t * ld, E, K, normalize, experts + (long long)t * K,
                   weights + (long long)t * K);
    }
    __syncthreads();   // the token->expert table is complete (global writes of this block are visible to it)
    int total;
    route_block(experts, weights, T, K, E, capacity, expert_counts, offsets, slot, row_of_choice, expert_of_row,
                token_of_row, weight_of_row, num_rows, &total);
#if PERMUTE
    for (long long e = threadIdx.x; e < (long long)total * D; e += blockDim.x) {
        const long long r = e / D, d = e % D;
        rows[r * ldrows + d] = x[token_of_row[r] * ldx + d];
    }
#endif
}

extern "C" __global__ void __launch_bounds__(BLOCK)
moe_permute(const act_t* x, const long long* token_of_row, const long long* num_rows, act_t* rows, int D,
            long long ldx, long long ldrows) {
    const long long r = blockIdx.x;
    if (r >= num_rows[0]) return;
    const act_t* src = x + token_of_row[r] * ldx;
    act_t* dst = rows + r * ldrows;
    for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = src[d];
}

extern "C" __global__ void __launch_bounds__(BLOCK)
moe_unpermute(const act_t* rows, const long long* row_of_choice, const float* weight_of_row, act_t* out, int T,
              int K, int D, long long ldrows, long long ldo) {
    const int t = blockIdx.x;
    if (t >= T) return;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < K; ++c) {
            const long long row = row_of_choice[(long long)t * K + c];
            if (row >= 0) acc = __fadd_rn(acc, __fmul_rn(to_float(rows[row * ldrows + d]), weight_of_row[row]));
        }
        out[(long long)t * ldo + d] = from_float<act_t>(acc);
    }
}
