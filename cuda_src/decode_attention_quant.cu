// Decode attention over a QUANTIZED KV cache ([model] kv_cache = "int8" | "int4"; row format in kv_quant.cuh):
// decode_attention.cu with the cache read as quantized rows, dequantized in registers (no float copy of the cache).
// As the reference (hpcinfer/backend/kv_attention.py, after FlexGen), the new token's own key and value enter the
// attention UNQUANTIZED (position starts[s] reads k, v, not the cache) and are stored quantized: the block that
// holds that position quantizes its (s, kvh) row into the cache; it never reads that row back, so no second launch
// is needed. As decode_attention.cu, one pass (decode_attention_quant) or flash-decoding for small batches
// (decode_attention_quant_split, then decode_attention.cu's decode_attention_combine, which does not read the
// cache): decode_attention_core.cuh says why and how.
//
// kernel decode_attention_quant(const act_t* q, const act_t* k, const act_t* v, unsigned char* qk, __half* sk,
//                               __half* mk, unsigned char* qv, __half* sv, __half* mv, const long long* slots,
//                               const long long* starts, act_t* out, int H, int Hkv, int hd, int group, int Lmax,
//                               long long ldq, long long ldk, long long ldv, long long ldo, float scale,
//                               int* status)
//   q, k, v, slots, starts, out: as decode_attention.cu
//   qk, sk, mk / qv, sv, mv: the K / V cache's q [N, Hkv, Lmax, B] and scale, min [N, Hkv, Lmax, G] (contiguous)
//   status: int or null, set to 1 when a new row's scale or minimum overflows float16 (kv_quant.cu)
// Launch: grid (Hkv, S), block (32, NWARPS); as decode_attention.cu.
//
// kernel decode_attention_quant_split(q, k, v, qk, sk, mk, qv, sv, mv, slots, starts, float* part, int H, int Hkv,
//                                     int hd, int group, int Lmax, long long ldq, long long ldk, long long ldv,
//                                     float scale, int* status)
//   as decode_attention_quant with part [S, H, C, 2 + hd] float32 in place of out (decode_attention_split's).
// Launch: grid (Hkv, S, C), block (32, NWARPS); block (kvh, s, C - 1) stores the new row.
//
// Preconditions (checked by the wrapper; the kernels write nothing otherwise): H % Hkv == 0, H / Hkv <= MAX_GROUP,
// hd <= MAX_HEAD_DIM, hd % group == 0 (group even for KV_BITS = 4).
// Defines: T_ACT (q, k, v, out), KV_BITS (4 or 8), NWARPS (default 4), MAX_HEAD_DIM (multiple of 32, default
// 128), MAX_GROUP (default 8).
#include "decode_attention_core.cuh"
#include "kv_quant.cuh"

// Block (kvh, s) over chunk c of C: store the token's row quantized when the chunk holds its position, then
// attend over the chunk's positions; emit as decode_attend.
template <class Emit>
__device__ void decode_quant_block(const act_t* q, const act_t* k, const act_t* v, unsigned char* qk, __half* sk,
                                   __half* mk, unsigned char* qv, __half* sv, __half* mv, const long long* slots,
                                   const long long* starts, int H, int Hkv, int hd, int group, int Lmax,
                                   long long ldq, long long ldk, long long ldv, float scale, int* status, int c,
                                   int C, Emit emit) {
    const int kvh = blockIdx.x, s = blockIdx.y;
    const int tid = threadIdx.y * 32 + threadIdx.x, nthreads = NWARPS * 32;
    const long long slot = slots[s], pos = starts[s];
    const int G = hd / group, B = hd * KV_BITS / 8, per_group = group * KV_BITS / 8;
    const long long row0 = (slot * Hkv + kvh) * (long long)Lmax;   // this (slot, KV head)'s position 0
    const act_t* k_new = k + s * ldk + (long long)kvh * hd;
    const act_t* v_new = v + s * ldv + (long long)kvh * hd;
    long long begin, end;
    decode_chunk(pos + 1, c, C, begin, end);

    // 1. store this token's key and value quantized (thread e < G: a K group, G <= e < 2 G: a V group); the
    //    attention below reads them from k, v unquantized, so this row is never read back here
    if (c == C - 1) {
        for (int e = tid; e < 2 * G; e += nthreads) {
            const bool is_v = e >= G;
            const int gi = is_v ? e - G : e;
            const long long row = row0 + pos;
            const bool ok = kv_quantize_group((is_v ? v_new : k_new) + gi * group, group,
                                              (is_v ? qv : qk) + row * B + gi * per_group,
                                              (is_v ? sv : sk) + row * G + gi, (is_v ? mv : mk) + row * G + gi);
            if (!ok && status != nullptr) *status = 1;
        }
    }
    // 2. attend over the chunk's positions: the cache's rows dequantized in registers, this token's own unquantized
    decode_attend(q, s, kvh, H / Hkv, hd, begin, end, ldq, scale, [&](long long j, int d, float& kf, float& vf) {
        const long long row = row0 + j;
        if (j == pos) {                                    // uniform over the warp
            kf = to_float(k_new[d]);
            vf = to_float(v_new[d]);
        } else {
            kf = kv_dequant(qk + row * B, sk + row * G, mk + row * G, d, group);
            vf = kv_dequant(qv + row * B, sv + row * G, mv + row * G, d, group);
        }
    }, emit);
}

// The wrapper's preconditions, checked again here (a kernel given other shapes writes nothing).
__device__ __forceinline__ bool decode_quant_shapes_ok(int H, int Hkv, int hd, int group) {
    return H / Hkv <= MAX_GROUP && hd <= MAX_HEAD_DIM && group >= 1 && hd % group == 0 &&
           !(KV_BITS == 4 && group % 2);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention_quant(const act_t* q, const act_t* k, const act_t* v, unsigned char* qk, __half* sk, __half* mk,
                       unsigned char* qv, __half* sv, __half* mv, const long long* slots, const long long* starts,
                       act_t* out, int H, int Hkv, int hd, int group, int Lmax, long long ldq, long long ldk,
                       long long ldv, long long ldo, float scale, int* status) {
    if (!decode_quant_shapes_ok(H, Hkv, hd, group)) return;
    decode_quant_block(q, k, v, qk, sk, mk, qv, sv, mv, slots, starts, H, Hkv, hd, group, Lmax, ldq, ldk, ldv,
                       scale, status, 0, 1, decode_write_out(out, blockIdx.y, blockIdx.x, H / Hkv, hd, ldo));
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention_quant_split(const act_t* q, const act_t* k, const act_t* v, unsigned char* qk, __half* sk,
                             __half* mk, unsigned char* qv, __half* sv, __half* mv, const long long* slots,
                             const long long* starts, float* part, int H, int Hkv, int hd, int group, int Lmax,
                             long long ldq, long long ldk, long long ldv, float scale, int* status) {
    const int c = blockIdx.z, C = gridDim.z;
    if (!decode_quant_shapes_ok(H, Hkv, hd, group)) return;
    decode_quant_block(q, k, v, qk, sk, mk, qv, sv, mv, slots, starts, H, Hkv, hd, group, Lmax, ldq, ldk, ldv,
                       scale, status, c, C, decode_write_partial(part, blockIdx.y, blockIdx.x, H / Hkv, hd, H, c, C));
}
