// Tensor-core GEMM for small batches (2 .. 64 tokens) over quantized weights: y[T, ncols] = epilogue(norm(x) @ W^T)
// with W = scale * q (+ min) int8 / int4 (quant_core.cuh: formats, the quant layout [ceil(B / 16), out, 16] bytes,
// scales and minimums [G, out]), dequantized in registers, never as a float copy in device memory. Reference:
// NumpyOps.linear_q (+ the epilogues of tc_core.cuh). Design (operand roles, tiling, split-K, x staging, prologue,
// epilogue): tc_core.cuh; the weights differ from tc_gemm.cu only in how the A fragments are made:
//   each warp streams its NRT x 16 rows' bytes through STAGES shared-memory stages of KS = 64 input elements (64
//   bytes a row at 8 bits, 32 at 4) with cp.async.cg (consecutive rows of one 16-byte vector column are contiguous
//   in the quant layout: 16 lanes read 256 contiguous bytes); for each k-step of 16 elements a lane converts the four
//   element pairs of the mma's A layout for rows g and g + 8 to the mma type as integers (exact: |q| <= 255), so the
//   mma sums q x exactly per product in float32 per group; at each group's end (quant_core.cuh's rule
//   W = scale[group, row] q (+ min[group, row])) the lane adds scale * sum(q x) (+ min * sum(x), the sum of x from one
//   more mma with an all-ones A) to its float32 result. No weight is rounded: the result is NumpyOps.linear_q's to
//   float32 rounding. 4-bit: byte j of a vector holds elements 2 j (low nibble) and 2 j + 1, so a pair is one byte.
//
// kernel tc_quant_gemm(const act_t* x, const float* gamma, const float* beta, float eps, const unsigned char* q,
//                      const float* scale, const float* mn, const float* bias, const act_t* residual, act_t* y,
//                      float* partial, int T, int in, int out, long long ldx, long long ldr, long long ldy)
//   q: quant layout, 16-byte aligned; scale, mn [G, out] float32 (mn read only with HAS_MIN); in % 16 == 0; the
//   other arguments as tc_gemm's (tc_gemm.cu). Launch: as tc_gemm's.
// kernel tc_quant_gemm_reduce: as tc_gemm_reduce, for SPLITS > 1.
//
// Defines: QBITS, QSIGNED, HAS_MIN, GROUP (quant_core.cuh; GROUP a multiple of 16 at 8 bits, 32 at 4 bits); T_STORAGE
// (the mma type, __half or __nv_bfloat16: __half keeps more of x with XSPLIT) and the defines of tc_gemm.cu.
#ifndef T_STORAGE                       // the tensor cores take 16-bit inputs: __half unless told (common.cuh's
#define T_STORAGE __half                // float default would not compile here)
#endif
#ifndef T_ACT
#define T_ACT float
#endif
#include "quant_core.cuh"
#include "tc_core.cuh"

#define QCH (KS / QVEC)                        // 16-byte vectors per row per stage: 4 at 8 bits, 2 at 4 bits
#define Q_STAGE_BYTES (NRT * 16 * QCH * 16)    // one warp's stage
static_assert(WARPS * STAGES * Q_STAGE_BYTES + XS_BYTES + 2 * MAX_TOKENS * 4 <= 48 * 1024,
              "tc_quant_gemm: the weight stages and the x tile exceed 48 KiB of static shared memory");

// Issue the cp.async of the stage of vectors kv0 .. kv0 + QCH - 1 of the warp's rows (zero-filled past ncols and
// past kv_end), then commit the group.
__device__ __forceinline__ void tc_load_q_stage(unsigned char* stage, const unsigned char* q, int c0, int ncols,
                                                int out, int kv0, int kv_end, bool any) {
    const int lane = threadIdx.x;
    if (any) {
#pragma unroll
        for (int u = 0; u < NRT * QCH / 2; ++u) {
            const int idx = lane + 32 * u, row = idx % (NRT * 16), v = idx / (NRT * 16);
            const int i = row / 16, col = c0 + 16 * (i % MT) + row % 16;
            const bool valid = col < ncols && kv0 + v < kv_end;
            const long long wrow = (i < MT ? 0 : ncols) + (long long)col;
            tc_cp_async16(stage + (row * QCH + v) * 16, valid ? q + ((long long)(kv0 + v) * out + wrow) * 16 : q,
                          valid ? 16 : 0);
        }
    }
    tc_cp_async_commit();
}

// Two consecutive quantized values (elements e, e + 1; e even) of a row's stage, as integers in the mma type (exact:
// |q| <= 255 needs 8 significant bits), packed as an mma operand register.
__device__ __forceinline__ unsigned tc_q_pair(const unsigned char* row, int e) {
    float q0, q1;
#if QBITS == 8
#if QSIGNED
    q0 = (float)(signed char)row[e];
    q1 = (float)(signed char)row[e + 1];
#else
    q0 = (float)row[e];
    q1 = (float)row[e + 1];
#endif
#else
    const unsigned char b = row[e / 2];
    q0 = (float)(b & 0x0F);
    q1 = (float)(b >> 4);
#endif
    return tc_pack2(from_float<mma_t>(q0), from_float<mma_t>(q1));
}

// The A fragment of m-tile i for the k-step of stage elements 16 s .. 16 s + 15: the raw q values.
__device__ __forceinline__ void tc_q_fragment(unsigned (&a)[4], const unsigned char* stage, int i, int s) {
    const int lane = threadIdx.x, g = lane / 4, qd = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {                      // rows g (a0, a2) and g + 8 (a1, a3)
        const unsigned char* row = stage + (16 * i + g + 8 * h) * QCH * 16;
        a[h] = tc_q_pair(row, 16 * s + 2 * qd);
        a[2 + h] = tc_q_pair(row, 16 * s + 2 * qd + 8);
    }
}

// End of group `grp`: acc += scale[grp, row] * sum q x (+ min[grp, row] * sum x) for each of the lane's rows, and
// the group's sums restart from zero.
__device__ __forceinline__ void tc_flush_group(float (&acc)[NRT][NT][4], float (&qx)[NRT][NT][4],
                                               float (&xsum)[NT][4], int grp, int c0, int ncols, int out,
                                               const float* scale, const float* mn) {
    const int g = threadIdx.x / 4;
#pragma unroll
    for (int i = 0; i < NRT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {                  // rows g (registers 0, 1) and g + 8 (2, 3)
            const int col = min(c0 + 16 * (i % MT) + g + 8 * h, ncols - 1);
            const long long at = (long long)grp * out + (i < MT ? 0 : ncols) + col;
            const float sc = __ldg(scale + at);
            const float m = HAS_MIN ? __ldg(mn + at) : 0.0f;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int r = 2 * h; r < 2 * h + 2; ++r) {
                    acc[i][j][r] += HAS_MIN ? sc * qx[i][j][r] + m * xsum[j][r] : sc * qx[i][j][r];
                    qx[i][j][r] = 0.0f;
                }
        }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) xsum[j][r] = 0.0f;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
tc_quant_gemm(const act_t* x, const float* gamma, const float* beta, float eps, const unsigned char* q,
              const float* scale, const float* mn, const float* bias, const act_t* residual, act_t* y,
              float* partial, int T, int in, int out, long long ldx, long long ldr, long long ldy) {
    __shared__ __align__(128) unsigned char ws[WARPS][STAGES][Q_STAGE_BYTES];
    __shared__ __align__(128) XTile xs;
    __shared__ float mean_s[MAX_TOKENS], rstd_s[MAX_TOKENS];
    if (T > MAX_TOKENS) return;   // precondition: the wrapper picks a module with MAX_TOKENS >= T

    const int warp = threadIdx.y;
    const int ncols = GATED ? out / 2 : out;
    const int c0 = (blockIdx.x * WARPS + warp) * 16 * MT;
    const int kvecs = (in * QBITS / 8 + 15) / 16;
    int k_begin, k_end;
    tc_split_range(in, k_begin, k_end);
    const int stages = (k_end - k_begin + KS - 1) / KS;
    const int kv_begin = k_begin / QVEC, kv_end = min(kvecs, (k_end + QVEC - 1) / QVEC);
    const NormArgs na = {gamma, beta, eps};

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        tc_load_q_stage(ws[warp][s], q, c0, ncols, out, kv_begin + s * QCH, kv_end, s < stages);
    tc_norm_stats(x, T, in, ldx, eps, mean_s, rstd_s);

    float acc[NRT][NT][4] = {};   // scaled sums
    float qx[NRT][NT][4] = {};    // the current group's sum of q x (exact integer products)
    float xsum[NT][4] = {};       // ... and of x (HAS_MIN)
    for (int st = 0; st < stages; ++st) {
        const int k0 = k_begin + st * KS, xoff = (st * KS) % XK;
        if (xoff == 0) {
            __syncthreads();
            tc_stage_x(xs, x, T, ldx, k0, k_end, mean_s, rstd_s, na);
            __syncthreads();
        }
        tc_cp_async_wait<STAGES - 2>();
        tc_syncwarp();
        const int next = st + STAGES - 1;
        tc_load_q_stage(ws[warp][next % STAGES], q, c0, ncols, out, kv_begin + next * QCH, kv_end, next < stages);
        const unsigned char* stage = ws[warp][st % STAGES];
#pragma unroll
        for (int s = 0; s < 4; ++s) {                  // the stage's k-steps of 16 elements, k = k0 + 16 s
            const int k = k0 + 16 * s;
            if (k >= k_end) break;                     // block-uniform
            unsigned a[NRT][4];
#pragma unroll
            for (int i = 0; i < NRT; ++i) tc_q_fragment(a[i], stage, i, s);
            tc_mma_step<HAS_MIN>(qx, a, xs, T, xoff / 8 + 2 * s, xsum);
            if (k + 16 >= k_end || (GROUP != 0 && (k + 16) % (GROUP == 0 ? 1 : GROUP) == 0))
                tc_flush_group(acc, qx, xsum, GROUP == 0 ? 0 : k / (GROUP == 0 ? 1 : GROUP), c0, ncols, out, scale,
                               mn);
        }
    }
    tc_cp_async_wait<0>();
    tc_store(acc, c0, T, out, bias, residual, y, partial, ldr, ldy);
}

extern "C" __global__ void __launch_bounds__(256)
tc_quant_gemm_reduce(const float* partial, const float* bias, const act_t* residual, act_t* y, int T, int out,
                     int splits, long long ldr, long long ldy) {
    sbi_reduce_body(partial, bias, residual, y, T, out, splits, ldr, ldy);
}
