"""Small-batch GEMM y[T, O] = x[T, I] @ W[O, I]^T for the NumPy backend (Numba), with the fused norm before it and
the epilogue after it (bias, activation or gate-up, residual): the CPU twin of cuda_src/fused_norm_gemv.cu.

Layout. The kernel reads W as it is held, row-major [O, I] float32: a block of ROWS consecutive rows is one
contiguous stretch of memory (ROWS streams the prefetchers follow), and each row is unit-stride along the input
dimension, which is what LLVM's loop vectorizer needs to run the dot products in AVX2 lanes (8 floats). A layout
interleaving the rows ([O/8, I, 8], SIMD over outputs) was tried: Numba's LLVM does not vectorize it (48 scalar
FMAs per iteration, 4x slower), so there is nothing to repack for float32 weights; quantized weights keep
quant/formats.py's layout too (gemm_quant.py).

Register blocking: blocks of ROWS (8) output rows, each token pair of the step as two 4-row x 2-token register
blocks and a last odd token as one 8-row x 1-token block: 8 vector accumulators either way, and no FMA spent on a
padding token. A block's rows stay in L1/L2 while every token of the step passes over them, so W is read from
memory once per call.

Batch invariance: every output y[t, o] is summed in the same order whatever T and wherever t sits in the step (the
two register blocks sum alike, tested bit for bit; O % ROWS rows are computed in a block whose spare rows repeat
the last row and are not stored), and by one thread (prange over row blocks). So a token's row is the same bits
alone or among others: static and continuous batching give the same tokens. The order of the sum is LLVM's
vectorized reduction over I (8 lanes, then a horizontal sum, then the I % 8 tail), fixed by I alone.

Shape legend: T=tokens, Tp=tokens padded to TOKENS, I=input features, O=output features, F=gated outputs (O / 2).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

F32 = np.float32
ROWS = 8              # output rows per block: a token pair runs as two 4-row x 2-token register blocks, a last odd
                      # token as one 8-row x 1-token block; both are 8 accumulators, which LLVM vectorizes with the
                      # same 8 lanes and no interleave, so they sum in the same order (a 4 x 1 block interleaves by
                      # 2 and does not): tested bit for bit
TOKENS = 2            # tokens per register block (the quantized kernels pad an odd step with a zero token)
FASTMATH = {"reassoc", "contract"}   # reassoc: the vectorized reduction over I; contract: FMA. No nnan/ninf: -inf
                                     # and NaN stay IEEE, as in NumPy.
ACTIVATIONS = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
NORMS = {None: 0, "rmsnorm": 1, "layernorm": 2}
NONE_1D = np.zeros(0, F32)           # "no bias / no norm weight": one compiled signature for every combination
NONE_2D = np.zeros((0, 0), F32)      # "no residual"
THREAD_WORK = 1 << 17                # multiply-adds a thread gets at least: a smaller product runs on fewer threads
                                     # (waking a thread costs ~10 us, more on a busy machine; 2^17 MACs ~ 10 us)


@njit(fastmath=FASTMATH, cache=True)
def _dot4x2(xp, w, o0, o1, o2, o3, t):
    """The 8 dot products of rows o0..o3 of w [O, I] with tokens t, t+1 of xp [Tp, I]."""
    s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = F32(0)
    for k in range(xp.shape[1]):
        x0 = xp[t, k]
        x1 = xp[t + 1, k]
        w0, w1, w2, w3 = w[o0, k], w[o1, k], w[o2, k], w[o3, k]
        s00 += w0 * x0
        s01 += w0 * x1
        s10 += w1 * x0
        s11 += w1 * x1
        s20 += w2 * x0
        s21 += w2 * x1
        s30 += w3 * x0
        s31 += w3 * x1
    return (s00, s10, s20, s30), (s01, s11, s21, s31)


@njit(fastmath=FASTMATH, cache=True)
def _dot8x1(xp, w, rows, t):
    """The 8 dot products of rows `rows` (8) of w with token t of xp: the same sums as _dot4x2's."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0)
    r0, r1, r2, r3, r4, r5, r6, r7 = rows
    for k in range(xp.shape[1]):
        x0 = xp[t, k]
        s0 += w[r0, k] * x0
        s1 += w[r1, k] * x0
        s2 += w[r2, k] * x0
        s3 += w[r3, k] * x0
        s4 += w[r4, k] * x0
        s5 += w[r5, k] * x0
        s6 += w[r6, k] * x0
        s7 += w[r7, k] * x0
    return (s0, s1, s2, s3, s4, s5, s6, s7)


@njit(cache=True)
def _block_rows(o, last):
    """The 8 rows of the block at row o, the ones past `last` repeating it (computed, never stored)."""
    return (o, min(o + 1, last), min(o + 2, last), min(o + 3, last), min(o + 4, last), min(o + 5, last),
            min(o + 6, last), min(o + 7, last))


@njit(fastmath=FASTMATH, cache=True)
def _products(xp, w, rows, t, T, out, base):
    """out[t, base:base + 8] (and out[t + 1, ...] when t + 1 < T) = rows `rows` of w times tokens t (, t + 1),
    for the columns that exist (out's width)."""
    n = min(ROWS, out.shape[1] - base)
    if t + 1 < T:
        a0, a1 = _dot4x2(xp, w, rows[0], rows[1], rows[2], rows[3], t)
        b0, b1 = _dot4x2(xp, w, rows[4], rows[5], rows[6], rows[7], t)
        first, second = a0 + b0, a1 + b1
        for r in range(n):
            out[t, base + r] = first[r]
            out[t + 1, base + r] = second[r]
    else:
        single = _dot8x1(xp, w, rows, t)
        for r in range(n):
            out[t, base + r] = single[r]


@njit(fastmath={"contract"}, cache=True)
def activate(v, act):
    """One value of Ops.activation (act: ACTIVATIONS code). GELU uses math.erf (NumPy's reference: an A&S fit)."""
    if act == 1:
        return v / (F32(1) + math.exp(-v))
    if act == 2:
        return F32(0.5) * v * (F32(1) + math.erf(v * F32(0.7071067811865476)))
    if act == 3:
        return F32(0.5) * v * (F32(1) + math.tanh(F32(0.7978845608028654) * (v + F32(0.044715) * v * v * v)))
    if act == 4:
        return max(v, F32(0))
    return v


@njit(fastmath={"contract"}, cache=True)
def padded_rows(x, norm, norm_w, norm_b, eps, xp):
    """xp[:T] = norm(x) (norm: NORMS code; 0 = a copy), xp[T:] = 0. x [T, I] -> xp [T or Tp, I]. Sums in
    float64."""
    T, n = x.shape
    for t in range(T):
        if norm == 0:
            for k in range(n):
                xp[t, k] = x[t, k]
            continue
        mean = 0.0
        if norm == 2:
            for k in range(n):
                mean += x[t, k]
            mean /= n
        square = 0.0
        for k in range(n):
            d = x[t, k] - mean
            square += d * d
        rstd = 1.0 / math.sqrt(square / n + eps)
        for k in range(n):
            v = F32((x[t, k] - mean) * rstd) * norm_w[k]
            xp[t, k] = v + norm_b[k] if norm_b.size else v
    for t in range(T, xp.shape[0]):
        for k in range(n):
            xp[t, k] = F32(0)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemm(xp, w, bias, act, residual, out):
    """out[T, O] = act(xp @ w.T + bias) + residual. xp [T, I], w [O, I], bias [O] or [0], residual [T, O] or
    [0, 0]."""
    T, O = out.shape
    for block in prange((O + ROWS - 1) // ROWS):
        o = block * ROWS
        rows = _block_rows(o, O - 1)
        for t in range(0, T, TOKENS):
            _products(xp, w, rows, t, T, out, o)
        for t in range(T):                                  # the epilogue, on values still in cache
            for r in range(min(ROWS, O - o)):
                v = out[t, o + r]
                if bias.size:
                    v += bias[o + r]
                v = activate(v, act)
                if residual.size:
                    v += residual[t, o + r]
                out[t, o + r] = v


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemm_gated(xp, w, bias, act, out, up):
    """out[T, F] = act(gate) * up with [gate | up] = xp @ w.T + bias, w [2F, I] (gate rows first); up [T, F] is
    scratch for the up rows' products."""
    T, F = out.shape
    for block in prange((F + ROWS - 1) // ROWS):
        o = block * ROWS
        gate_rows = _block_rows(o, F - 1)
        up_rows = _block_rows(F + o, 2 * F - 1)
        for t in range(0, T, TOKENS):
            _products(xp, w, gate_rows, t, T, out, o)
            _products(xp, w, up_rows, t, T, up, o)
        for t in range(T):
            for r in range(min(ROWS, F - o)):
                g, u = out[t, o + r], up[t, o + r]
                if bias.size:
                    g, u = g + bias[o + r], u + bias[F + o + r]
                out[t, o + r] = activate(g, act) * u


KERNELS = (padded_rows, gemm, gemm_gated)        # what compiled.warm_up loads or compiles


def padded_input(x, norm=None, pad: bool = False):
    """x [T, I] -> xp [T, I] (pad: [Tp, I], the last row zero when T is odd) float32 C-contiguous, normalized when
    `norm` (a NormParams) is given."""
    T, n = x.shape
    xp = np.empty((T + (T % TOKENS if pad else 0), n), F32)
    x = np.ascontiguousarray(x, dtype=F32)
    if norm is None:
        padded_rows(x, 0, NONE_1D, NONE_1D, 0.0, xp)
    else:
        weight = np.ascontiguousarray(norm.weight, dtype=F32)
        bias = NONE_1D if norm.bias is None or norm.kind != "layernorm" else np.ascontiguousarray(norm.bias, F32)
        padded_rows(x, NORMS[norm.kind], weight, bias, float(norm.eps), xp)
    return xp


def use_threads(threads: int, work: int) -> None:
    """Run the next kernel on `threads` threads, fewer when `work` (multiply-adds) is small. Numba's setting is
    the calling thread's: set on each call, so that the Ops that calls decides."""
    numba.set_num_threads(max(1, min(threads, work // THREAD_WORK, numba.config.NUMBA_NUM_THREADS)))


def fused_gemm(x, w, bias=None, norm=None, act=None, gated=False, residual=None, threads: int = 1):
    """act(norm(x) @ w.T + bias) (+ residual), gated: act(gate) * up, as Ops.fused_linear -> [T, O or O/2].
    w: float32 C-contiguous [O, I] (the caller checks: takes()). threads: at most this many."""
    xp = padded_input(x, norm)
    T = x.shape[0]
    use_threads(threads, xp.size * w.shape[0])
    bias = NONE_1D if bias is None else np.ascontiguousarray(bias, dtype=F32)
    if gated:
        out = np.empty((T, w.shape[0] // 2), F32)
        gemm_gated(xp, w, bias, ACTIVATIONS[act], out, np.empty_like(out))
        return out if residual is None else residual + out
    out = np.empty((T, w.shape[0]), F32)
    res = NONE_2D if residual is None else np.ascontiguousarray(residual, dtype=F32)
    gemm(xp, w, bias, ACTIVATIONS[act], res, out)
    return out


# Tokens up to which the compiled kernels beat BLAS (OpenBLAS through NumPy). Measured 2026-11-28 on the shared
# 2-core AMD EPYC (AVX2; load average 11-17 from other jobs, so compute-starved; 1 thread; ms per matrix, >= 64 MB
# of copies so that weights come from memory, medians of 5 taken in turns, numba / numpy):
#   float32     T=1          2            4            8            16           32           64
#   3072x576    4.0/3.0      8.1/15.6     7.4/10.6     8.9/9.4      10.6/10.4    18.3/15.3    33.7/25.1
#   576x1536    1.4/1.2      2.2/3.3      3.0/3.5      4.1/4.7      6.0/6.1      9.4/8.3      17.9/13.8
#   49152x576   50/57        63/127       85/139       115/149      184/199      329/305      456/350
#   int8        T=1          2            4            8            16
#   3072x576    8.2/7.7      15.3/18.2    16.2/18.0    25.6/17.3    31.9/16.3
#   576x1536    3.3/4.2      4.3/5.6      7.5/6.8      15.1/6.4     30.4/8.8
#   49152x576   141/189      87/225       186/284      382/272      946/376
# float32: ahead from 2 to 8 tokens, even at 16, behind from 32 (OpenBLAS's packed GEMM is the better compute
# kernel when the cores, not memory, are the limit); 1 token stays compiled although OpenBLAS's gemv was 20% ahead
# here, so that a token's bits do not depend on the step's size from 1 to CROSSOVER (batch invariance; past it a
# step runs BLAS). int8 (the NumPy path dequantizes the weight once per call and shares it among the tokens): ahead
# to 2-4 tokens. Re-measure on a quiet machine with `make bench-ops` (the issue's own quiet-machine trial had a
# Numba kernel ahead of OpenBLAS up to 64 tokens).
CROSSOVER = 16
QUANT_CROSSOVER = 4


def max_tokens(rows: int, cols: int, quantized: bool = False) -> int:
    """The most tokens for which the compiled kernel is faster than BLAS on a weight [rows, cols] (float32, or
    quantized: gemm_quant.py). The measurements above found no dependence on the shape worth a rule."""
    return QUANT_CROSSOVER if quantized else CROSSOVER


def takes(x, w, act=None) -> bool:
    """Whether the compiled GEMM runs this product: a float32 C-contiguous weight [O, I], a known activation, and
    few enough tokens that it beats BLAS (crossover.py)."""
    return (isinstance(w, np.ndarray) and w.dtype == F32 and w.ndim == 2 and w.flags.c_contiguous
            and act in ACTIVATIONS and x.shape[0] <= max_tokens(*w.shape))
