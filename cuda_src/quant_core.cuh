// Quantized weights (hpcinfer/quant/formats.py), shared by quant_gemv.cu and quant_dequant.cu:
//   W[c, k] = scale[g, c] * q[c, k] (+ min[g, c])   with g = k / GROUP (GROUP = 0: one group per row, g = 0).
//
// Weight layout ("quant layout", made once when the weight reaches the device by
// hpcinfer.kernels.layout.quant_pack): the packed bytes of W's rows, [out, B] (B = in bytes at 8 bits, in / 2 at 4
// bits, two values per byte low nibble first), re-laid as
//   Qp[kv, c, j] = bytes[c, kv * 16 + j]   shape [ceil(B / 16), out, 16], zero past B,
// so one output column's 16-byte vector holds QVEC = 128 / QBITS consecutive input elements (16 int8 / uint8, or 32
// int4 with element 2j in the low nibble of byte j), and the 32 lanes of a warp on 32 consecutive columns read 512
// contiguous bytes per load: the SBI layout (sbi_core.cuh) over bytes. Scales and minimums are float32 transposed to
//   scale[g, c], min[g, c]   shape [G, out]   (G = in / GROUP, or 1)
// so the lanes' per-group parameters are contiguous too.
//
// Defines (one compile per weight format):
//   QBITS    8 or 4 (default 8)
//   QSIGNED  1: q is int8 (symmetric modes int8, q8_0); 0: q is unsigned (asym8 uint8, 4-bit nibbles); default 1
//   HAS_MIN  1: + min (asymmetric modes; default 0)
//   GROUP    group size in input elements, a multiple of QVEC; 0 (default) for one group per row (per-channel int8,
//            any `in`). A vector never straddles two groups, so each one needs one scale (and min).
#pragma once
#include "common.cuh"

#ifndef QBITS
#define QBITS 8
#endif
#ifndef QSIGNED
#define QSIGNED 1
#endif
#ifndef HAS_MIN
#define HAS_MIN 0
#endif
#ifndef GROUP
#define GROUP 0
#endif

#define QVEC (128 / QBITS)   // input elements per 16-byte weight vector

static_assert(QBITS == 8 || QBITS == 4, "QBITS must be 8 or 4");
static_assert(QBITS == 8 || !QSIGNED, "4-bit values are unsigned nibbles (QSIGNED=0)");
static_assert(GROUP % QVEC == 0, "GROUP must be 0 or a multiple of the vector's QVEC elements");

// The group of the 16-byte vector kv (elements kv * QVEC .. kv * QVEC + QVEC - 1).
__device__ __forceinline__ int quant_group(int kv) {
#if GROUP == 0
    return 0;
#else
    return kv / (GROUP / QVEC);
#endif
}

// One 16-byte vector of quantized values -> QVEC floats scale * q (+ mn), in registers.
__device__ __forceinline__ void quant_decode(const uint4& raw, float s, float mn, float (&w)[QVEC]) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&raw);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#if QBITS == 8
#if QSIGNED
        const float q = (float)(signed char)b[j];
#else
        const float q = (float)b[j];
#endif
        w[j] = HAS_MIN ? s * q + mn : s * q;
#else
        const float lo = (float)(b[j] & 0x0F), hi = (float)(b[j] >> 4);
        w[2 * j] = HAS_MIN ? s * lo + mn : s * lo;
        w[2 * j + 1] = HAS_MIN ? s * hi + mn : s * hi;
#endif
    }
}
