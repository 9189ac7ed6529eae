// The quantized KV cache's row format on the device (hpcinfer/quant/kv.py is the spec; shared by kv_quant.cu and
// decode_attention_quant.cu). A row is the head_dim vector of one (slot, KV head, position), cut into groups of
// `group` values; per group a float16 scale and minimum, values q in [0, 2^KV_BITS - 1], x ~= scale * q + min.
// KV_BITS = 8: one value per byte; KV_BITS = 4: two per byte, LOW NIBBLE FIRST (element 2j in bits 0-3 of byte j).
//   q            [N, Hkv, Lmax, B] unsigned char, B = hd * KV_BITS / 8
//   scale, low   [N, Hkv, Lmax, G] __half, G = hd / group
// Row r = (slot * Hkv + kvh) * Lmax + pos starts at q + r * B and scale / low + r * G.
//
// Bit-exact with quant/kv.py: min and max in float32, min rounded DOWN to float16 and (max - min) / top rounded UP
// (directed float16 conversions), q = clip(rint((x - min) / scale), 0, top) with IEEE division (NVRTC's default
// -prec-div=true), dequantized as fl(fl(q * scale) + min) (__fmul_rn: no fused multiply-add, as NumPy does it).
#pragma once

#ifndef KV_BITS
#define KV_BITS 8
#endif
#if KV_BITS != 4 && KV_BITS != 8
#error "KV_BITS must be 4 or 8"
#endif
#define KV_TOP ((1 << KV_BITS) - 1)

// Element d of a quantized row (qrow, srow, mrow point at the row's first byte / scale / minimum).
__device__ __forceinline__ float kv_dequant(const unsigned char* qrow, const __half* srow, const __half* mrow, int d,
                                            int group) {
#if KV_BITS == 4
    const unsigned b = qrow[d >> 1];
    const unsigned v = (d & 1) ? (b >> 4) : (b & 0x0Fu);
#else
    const unsigned v = qrow[d];
#endif
    const int gi = d / group;
    return __fmul_rn((float)v, __half2float(srow[gi])) + __half2float(mrow[gi]);
}

__device__ __forceinline__ unsigned kv_level(float x, float low, float safe) {
    return (unsigned)fminf(fmaxf(rintf((x - low) / safe), 0.0f), (float)KV_TOP);
}

// Quantize the `group` values x[0 .. group-1] (one thread) into qg (the group's first byte), *sg, *mg. Returns false
// when the scale or minimum is not finite (values beyond float16's range: quant/kv.py raises QuantError there).
template <typename A>
__device__ __forceinline__ bool kv_quantize_group(const A* x, int group, unsigned char* qg, __half* sg, __half* mg) {
    float lo = to_float(x[0]), hi = lo;
    for (int i = 1; i < group; ++i) {
        const float xi = to_float(x[i]);
        lo = fminf(lo, xi);
        hi = fmaxf(hi, xi);
    }
    const __half low_h = __float2half_rd(lo);                         // largest float16 <= min
    const float low = __half2float(low_h);
    const __half scale_h = __float2half_ru((hi - low) / (float)KV_TOP); // smallest float16 >= step
    const float scale = __half2float(scale_h);
    const float safe = scale > 0.0f ? scale : 1.0f;
#if KV_BITS == 4
    for (int i = 0; i < group; i += 2)
        qg[i >> 1] = (unsigned char)(kv_level(to_float(x[i]), low, safe) |
                                     (kv_level(to_float(x[i + 1]), low, safe) << 4));
#else
    for (int i = 0; i < group; ++i) qg[i] = (unsigned char)kv_level(to_float(x[i]), low, safe);
#endif
    *sg = scale_h;
    *mg = low_h;
    return scale - scale == 0.0f && low - low == 0.0f;                 // both finite (inf - inf, NaN: NaN)
}

// Elements d0 .. d0 + N - 1 of a quantized row (d0 a multiple of N, N * KV_BITS / 8 bytes one aligned load where
// that is 2, 4 or 8 bytes) -> out[N], each as kv_dequant gives it: decode attention's vector reads.
template <int N>
__device__ __forceinline__ void kv_dequant_vec(const unsigned char* qrow, const __half* srow, const __half* mrow,
                                               int d0, int group, float (&out)[N]) {
    constexpr int bytes = N * KV_BITS / 8;
    alignas(8) unsigned char raw[bytes > 0 ? bytes : 1];
    const unsigned char* src = qrow + d0 * KV_BITS / 8;
    if constexpr (bytes == 8) {
        *reinterpret_cast<uint2*>(raw) = *reinterpret_cast<const uint2*>(src);
    } else if constexpr (bytes == 4) {
        *reinterpret_cast<unsigned*>(raw) = *reinterpret_cast<const unsigned*>(src);
    } else if constexpr (bytes == 2) {
        *reinterpret_cast<unsigned short*>(raw) = *reinterpret_cast<const unsigned short*>(src);
    } else {
#pragma unroll
        for (int b = 0; b < bytes; ++b) raw[b] = src[b];
    }
#pragma unroll
    for (int e = 0; e < N; ++e) {
#if KV_BITS == 4
        const unsigned v = (e & 1) ? (raw[e >> 1] >> 4) : (raw[e >> 1] & 0x0Fu);
#else
        const unsigned v = raw[e];
#endif
        const int gi = (d0 + e) / group;
        out[e] = __fmul_rn((float)v, __half2float(srow[gi])) + __half2float(mrow[gi]);
    }
}
