// Decode attention over a QUANTIZED KV cache ([model] kv_cache = "int8" | "int4"; row format in kv_quant.cuh):
// decode_attention.cu with the cache read as quantized rows, dequantized in registers 8 values a load (8 bytes of
// int8, 4 of int4; no float copy of the cache). As the reference (hpcinfer/backend/kv_attention.py, after FlexGen),
// the new token's own key and value enter the attention UNQUANTIZED (position starts[s] reads them as floats, from
// shared memory) and are stored quantized: the block that holds that position quantizes its (s, kvh) row into the
// cache and never reads that row back. One launch: split over the context and combined by the last block of each
// (sequence, KV head), as decode_attention.cu (decode_attention_core.cuh says why and how); rotary fused as there.
//
// kernel decode_attention_quant(const act_t* q, const act_t* k, const act_t* v, unsigned char* qk, __half* sk,
//                               __half* mk, unsigned char* qv, __half* sv, __half* mv, const long long* slots,
//                               const long long* starts, const float* cos, const float* sin, int rotary_dim,
//                               act_t* out, float* part, int* counters, int H, int Hkv, int hd, int group, int Lmax,
//                               long long ldq, long long ldk, long long ldv, long long ldo, float scale,
//                               int* status)
//   q, k, v, slots, starts, cos, sin, rotary_dim, out, part, counters: as decode_attention.cu
//   qk, sk, mk / qv, sv, mv: the K / V cache's q [N, Hkv, Lmax, B] and scale, min [N, Hkv, Lmax, G] (contiguous)
//   status: int or null, set to 1 when a new row's scale or minimum overflows float16 (kv_quant.cu)
// Launch: grid (Hkv, S, C), block (32, NWARPS); block (kvh, s, C - 1) stores the new row.
//
// Preconditions (checked by the wrapper; the kernel writes nothing otherwise): H == GROUP * Hkv, hd == HEAD_DIM,
// hd % group == 0 (group even for KV_BITS = 4), 0 <= rotary_dim <= hd even.
// Defines: T_ACT (q, k, v, out), KV_BITS (4 or 8), HEAD_DIM, GROUP, NWARPS (default 4).
#define KV_VEC 8
#include "decode_attention_core.cuh"
#include "kv_quant.cuh"

// The wrapper's preconditions, checked again here (a kernel given other shapes writes nothing).
__device__ __forceinline__ bool decode_quant_shapes_ok(int H, int Hkv, int hd, int group, int rotary_dim) {
    return H == GROUP * Hkv && hd == HEAD_DIM && group >= 1 && hd % group == 0 && !(KV_BITS == 4 && group % 2) &&
           rotary_dim >= 0 && rotary_dim <= hd && rotary_dim % 2 == 0;
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
decode_attention_quant(const act_t* q, const act_t* k, const act_t* v, unsigned char* qk, __half* sk, __half* mk,
                       unsigned char* qv, __half* sv, __half* mv, const long long* slots, const long long* starts,
                       const float* cos, const float* sin, int rotary_dim, act_t* out, float* part, int* counters,
                       int H, int Hkv, int hd, int group, int Lmax, long long ldq, long long ldk, long long ldv,
                       long long ldo, float scale, int* status) {
    if (!decode_quant_shapes_ok(H, Hkv, hd, group, rotary_dim)) return;
    const int kvh = blockIdx.x, s = blockIdx.y, c = blockIdx.z, C = gridDim.z;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const long long slot = slots[s], pos = starts[s];
    const int G = HEAD_DIM / group, B = HEAD_DIM * KV_BITS / 8, per_group = group * KV_BITS / 8;
    const long long row0 = (slot * Hkv + kvh) * (long long)Lmax;   // this (slot, KV head)'s position 0
    long long begin, end;
    decode_chunk(pos + 1, c, C, begin, end);

    // 1. the query heads (rotated, scaled); the new key (rotated) and value as floats in shared memory
    decode_stage_q(q, s, kvh, ldq, cos, sin, rotary_dim, scale);
    if (c == C - 1) {
        for (int d = tid; d < HEAD_DIM; d += NWARPS * 32) {
            dec_new_s[0][d] = decode_new_k(k, s, kvh, ldk, cos, sin, rotary_dim, d);
            dec_new_s[1][d] = to_float(v[s * ldv + (long long)kvh * HEAD_DIM + d]);
        }
    }
    __syncthreads();
    // 2. store them quantized (thread e < G: a K group, G <= e < 2 G: a V group); the attention reads the floats
    if (c == C - 1) {
        const long long row = row0 + pos;
        for (int e = tid; e < 2 * G; e += NWARPS * 32) {
            const bool is_v = e >= G;
            const int gi = is_v ? e - G : e;
            const bool ok = kv_quantize_group(dec_new_s[is_v] + gi * group, group,
                                              (is_v ? qv : qk) + row * B + gi * per_group,
                                              (is_v ? sv : sk) + row * G + gi, (is_v ? mv : mk) + row * G + gi);
            if (!ok && status != nullptr) *status = 1;
        }
    }
    // 3. attend over the chunk's positions: the cache's rows dequantized in registers, this token's own as floats
    decode_attend(begin, end, s, kvh, H, c, C, DecodeOut{out, ldo, part, counters},
                  [&](long long j, int vi, float (&kf)[dec::VEC], float (&vf)[dec::VEC]) {
                      const int d0 = vi * dec::VEC;
                      if (j == pos) {
#pragma unroll
                          for (int e = 0; e < dec::VEC; ++e) {
                              kf[e] = dec_new_s[0][d0 + e];
                              vf[e] = dec_new_s[1][d0 + e];
                          }
                          return;
                      }
                      const long long row = row0 + j;
                      kv_dequant_vec<dec::VEC>(qk + row * B, sk + row * G, mk + row * G, d0, group, kf);
                      kv_dequant_vec<dec::VEC>(qv + row * B, sv + row * G, mv + row * G, d0, group, vf);
                  });
}
