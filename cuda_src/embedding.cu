// Token embedding: a row gather with vocab-parallel masking. Reference: NumpyOps.embedding and
// VocabParallelEmbedding.embed (the masking: a token outside this rank's rows gets a zero row, summed over tp).
//
// kernel embedding(const storage_t* table, const long long* ids, act_t* out, int T, int D, long long row_start,
//                  long long rows, long long ld_out)
//   table [rows, D] contiguous: this rank's vocabulary rows row_start .. row_start + rows - 1
//   ids   [T] int64 global token ids
//   out   [T, D] rows ld_out apart: out[t] = table[ids[t] - row_start] if 0 <= ids[t] - row_start < rows, else 0.
//   Unsharded: row_start = 0, rows = V (an id outside the vocabulary then gives a zero row instead of a fault).
// Launch: grid (T), block (BLOCK).
// Defines: T_STORAGE (table), T_ACT (out), BLOCK (default 256).
#include "common.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
embedding(const storage_t* table, const long long* ids, act_t* out, int T, int D, long long row_start,
          long long rows, long long ld_out) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const long long local = ids[t] - row_start;
    act_t* o = out + (long long)t * ld_out;
    if (local >= 0 && local < rows) {
        const storage_t* src = table + local * D;
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = from_float<act_t>(to_float(src[d]));
    } else {
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = from_float<act_t>(0.0f);
    }
}
