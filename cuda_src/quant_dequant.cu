// Dequantize a block of rows of a quantized weight (quant layout, quant_core.cuh) into a reused tile:
//   tile[r, k] = scale[g, c] * q[c, k] (+ min[g, c])   c = rows[r] (or r0 + r when rows is null), k < in.
// Two uses (hpcinfer/backend/cupy_quant.py): the large-batch linear_q (T > 16) dequantizes TILE output rows at a
// time into one float tile and multiplies it with cuBLAS, so the whole weight never exists in float; embedding_q
// gathers the token ids' rows of a quantized table. Reference: quant.formats.dequantize / take_rows.
//
// kernel quant_dequant(const unsigned char* q, const float* scale, const float* mn, const long long* rows,
//                      act_t* tile, int R, int r0, int in, int out, long long ldt)
//   q        quant layout [ceil(B / 16), out, 16] bytes, 16-byte aligned; scale, mn [G, out] float32 (mn: HAS_MIN)
//   rows     [R] int64 row indices in [0, out), or null for the rows r0 .. r0 + R - 1
//   tile     [R, in] act_t, rows ldt elements apart (ldt >= in)
// Each thread decodes whole 16-byte vectors (QVEC elements) in a grid-stride loop over R * ceil(B / 16) vectors,
// the fastest index running over rows, so that consecutive threads read consecutive 16-byte vectors of one kv.
// Launch: grid (any, e.g. min(ceil(R * kvecs / BLOCK), 32 waves)), block (BLOCK).
//
// Defines: QBITS, QSIGNED, HAS_MIN, GROUP (quant_core.cuh); T_ACT (the tile's type: float or __half); BLOCK (256).
#include "quant_core.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
quant_dequant(const unsigned char* q, const float* scale, const float* mn, const long long* rows, act_t* tile,
              int R, int r0, int in, int out, long long ldt) {
    const int kvecs = (in + QVEC - 1) / QVEC;
    const long long n = (long long)R * kvecs;
    const uint4* qv = reinterpret_cast<const uint4*>(q);
    for (long long e = (long long)blockIdx.x * BLOCK + threadIdx.x; e < n; e += (long long)gridDim.x * BLOCK) {
        const int r = (int)(e % R), kv = (int)(e / R);
        const long long c = rows ? rows[r] : (long long)(r0 + r);
        const long long g = (long long)quant_group(kv) * out + c;
        float w[QVEC];
        quant_decode(__ldg(qv + (long long)kv * out + c), __ldg(scale + g), HAS_MIN ? __ldg(mn + g) : 0.0f, w);
        act_t* dst = tile + (long long)r * ldt + (long long)kv * QVEC;
        const int count = min(QVEC, in - kv * QVEC);
#pragma unroll
        for (int i = 0; i < QVEC; ++i)
            if (i < count) dst[i] = from_float<act_t>(w[i]);
    }
}
