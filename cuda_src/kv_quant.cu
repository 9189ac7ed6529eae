// The quantized KV cache's two directions ([model] kv_cache = "int8" | "int4"; the row format in kv_quant.cuh,
// the spec in hpcinfer/quant/kv.py): quantize new K and V rows into the cache, and dequantize chosen cached rows
// into a float32 buffer (a prefill's earlier positions, top-k's keys and kept values). Decode attention reads the
// cache itself, dequantizing in registers (decode_attention_quant.cu).
//
// kernel kv_quantize_append(const act_t* k, const act_t* v, unsigned char* qk, __half* sk, __half* mk,
//                           unsigned char* qv, __half* sv, __half* mv, const long long* slots,
//                           const long long* starts, const long long* offsets, int Hkv, int hd, int group, int Lmax,
//                           long long ldk, long long ldv, int* status)
//   As kv_append.cu: sequence s has its new tokens at offsets[s] .. offsets[s + 1] - 1 of the packed token axis;
//   they go, quantized, to positions starts[s] .. of slot slots[s]. k, v [T, Hkv, hd] rows ldk / ldv apart.
//   qk, sk, mk / qv, sv, mv: the K / V cache's q [N, Hkv, Lmax, B], scale and min [N, Hkv, Lmax, G] (contiguous).
//   status: int, or null; set to 1 when a group's scale or minimum overflows float16 (never cleared here).
//   Launch: grid (max count, S), block (BLOCK): block (i, s) quantizes token i of sequence s, one thread per group
//   (2 Hkv G groups: K's then V's). Preconditions (wrapper): hd % group == 0, group even for KV_BITS = 4,
//   starts[s] + count(s) <= Lmax.
//
// kernel kv_dequantize_rows(const unsigned char* q, const __half* scale, const __half* low,
//                           const long long* src_rows, const long long* dst_rows, float* out, long long R, int hd,
//                           int group)
//   out[dst_rows[i], :] = dequantized cache row src_rows[i] (row r = (slot * Hkv + kvh) * Lmax + pos) for i < R;
//   dst_rows null: out[i, :]. out rows are hd floats apart. Launch: any 1-D grid x (BLOCK) (grid-stride over R hd).
//
// Defines: T_ACT (k, v), KV_BITS (4 or 8, default 8), BLOCK (default 128).
#include "common.cuh"
#include "kv_quant.cuh"

#ifndef BLOCK
#define BLOCK 128
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
kv_quantize_append(const act_t* k, const act_t* v, unsigned char* qk, __half* sk, __half* mk, unsigned char* qv,
                   __half* sv, __half* mv, const long long* slots, const long long* starts, const long long* offsets,
                   int Hkv, int hd, int group, int Lmax, long long ldk, long long ldv, int* status) {
    const int i = blockIdx.x, s = blockIdx.y;
    const long long first = offsets[s], count = offsets[s + 1] - first;
    if (i >= count) return;
    const long long token = first + i, pos = starts[s] + i, slot = slots[s];
    const int G = hd / group, B = hd * KV_BITS / 8, per_group = group * KV_BITS / 8;
    for (int e = threadIdx.x; e < 2 * Hkv * G; e += blockDim.x) {
        const bool is_v = e >= Hkv * G;
        const int f = is_v ? e - Hkv * G : e, h = f / G, gi = f % G;
        const long long row = (slot * Hkv + h) * Lmax + pos;
        const act_t* x = (is_v ? v + token * ldv : k + token * ldk) + (long long)h * hd + gi * group;
        unsigned char* qrow = (is_v ? qv : qk) + row * B;
        const bool ok = kv_quantize_group(x, group, qrow + gi * per_group, (is_v ? sv : sk) + row * G + gi,
                                          (is_v ? mv : mk) + row * G + gi);
        if (!ok && status != nullptr) *status = 1;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
kv_dequantize_rows(const unsigned char* q, const __half* scale, const __half* low, const long long* src_rows,
                   const long long* dst_rows, float* out, long long R, int hd, int group) {
    const int B = hd * KV_BITS / 8, G = hd / group;
    const long long total = R * hd, stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long i = e / hd, src = src_rows[i], dst = dst_rows != nullptr ? dst_rows[i] : i;
        const int d = (int)(e % hd);
        out[dst * hd + d] = kv_dequant(q + src * B, scale + src * G, low + src * G, d, group);
    }
}
