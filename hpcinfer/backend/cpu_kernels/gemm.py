"""Small-batch GEMM y[T, O] = x[T, I] @ W[O, I]^T for the NumPy backend (Numba), with the fused norm before it and
the epilogue after it (bias, activation or gate-up, residual): the CPU twin of cuda_src/fused_norm_gemv.cu.

Layout. The kernel reads W as it is held, row-major [O, I] float32, one row at a time in order: the weight is ONE
sequential stream per thread, which this machine's prefetchers follow at full speed (AMD EPYC Zen 4, one thread, a
98304 x 576 float32 weight from memory: 29.7 GB/s one row at a time, 13.7 GB/s in the earlier kernel's blocks of 8
rows read side by side, 8 streams). Each row is unit-stride along I, which LLVM's loop vectorizer needs. Nothing is
repacked (a layout interleaving rows, [O/8, I, 8], did not vectorize in Numba's LLVM: 4x slower).

Loop shape: blocks of up to L1_FLOATS weights (R = 4096 / I rows: 7 of 576 columns, 2 of 1536); within a block,
token pair by token pair, each pair's dots with every row of the block, a row's dot with both tokens in one loop
(_dot2: LLVM sums each token in 16 lanes x 4 zmm accumulators on AVX-512, vfmadd231ps, then an 8-lane tail and a
scalar one). The first pair reads the block from memory, the other pairs find it in L1, so W is read from memory
once per call. An odd last token runs as a pair with itself (no padding copy; at 1 token the spare dot costs
nothing measurable, as the row comes from memory). This replaced register blocks of 4 rows x 2 tokens and 8 x 1
(8 streams): 1.1-1.45x faster at 1-4 tokens, even at 8-16, 10-19% slower at 32-64, where BLAS runs
(docs/cpu-kernels.md, ABAB).

Batch invariance: every output y[t, o] is one _dot2 of row o with token t in one of its two places, which sum alike
(one loop), whatever T is and wherever t sits in the step, and by one thread (prange over row blocks; the block
size depends on I alone and no sum crosses a row). So a token's row is the same bits alone or among others (tested
bit for bit): static and continuous batching give the same tokens. The order of the sum is LLVM's vectorized
reduction over I, fixed by I alone.

Shape legend: T=tokens, I=input features, O=output features, F=gated outputs (O / 2), R=rows per block.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

F32 = np.float32
L1_FLOATS = 4096      # weights per block of rows (16 KB, half of Zen 4's L1d): the rows every token pair of the step
                      # passes over, read from memory once
FASTMATH = {"reassoc", "contract"}   # reassoc: the vectorized reduction over I; contract: FMA. No nnan/ninf: -inf
                                     # and NaN stay IEEE, as in NumPy.
ACTIVATIONS = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
NORMS = {None: 0, "rmsnorm": 1, "layernorm": 2}
NONE_1D = np.zeros(0, F32)           # "no bias / no norm weight": one compiled signature for every combination
NONE_2D = np.zeros((0, 0), F32)      # "no residual"
THREAD_WORK = 1 << 17                # multiply-adds a thread gets at least: a smaller product runs on fewer threads
                                     # (waking a thread costs ~10 us, more on a busy machine; 2^17 MACs ~ 10 us)


@njit(fastmath=FASTMATH, cache=True)
def _dot2(x0, x1, w):
    """The dot products of row w [I] with tokens x0, x1 [I]: one reduction each, in the same loop, so LLVM
    vectorizes both alike (16 lanes x 4 on AVX-512) and a token sums in the same order in either place."""
    s0 = s1 = F32(0)
    for k in range(w.shape[0]):
        s0 += w[k] * x0[k]
        s1 += w[k] * x1[k]
    return s0, s1


@njit(fastmath=FASTMATH, cache=True)
def _products(xp, w, first, n, out, base):
    """out[:, base:base + n] = xp @ w[first:first + n].T, token pair by token pair, each pair over all n rows (a
    block that stays in L1 after the first pair read it from memory in one stream); an odd last token runs as a
    pair with itself."""
    T = xp.shape[0]
    for t in range(0, T, 2):
        u = min(t + 1, T - 1)
        for r in range(n):
            out[t, base + r], out[u, base + r] = _dot2(xp[t], xp[u], w[first + r])


@njit(cache=True)
def _block(I):
    """Rows per block of a weight with I columns: as many as fit in L1_FLOATS, at least 1."""
    return max(1, L1_FLOATS // I)


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
def normalized_rows(x, norm, norm_w, norm_b, eps, xp):
    """xp = norm(x) (norm: NORMS code; 0 = a copy). x, xp [T, I]. Sums in float64."""
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


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemm(xp, w, bias, act, residual, out):
    """out[T, O] = act(xp @ w.T + bias) + residual. xp [T, I], w [O, I], bias [O] or [0], residual [T, O] or
    [0, 0]."""
    T, O = out.shape
    R = _block(w.shape[1])
    for block in prange((O + R - 1) // R):
        o = block * R
        n = min(R, O - o)
        _products(xp, w, o, n, out, o)
        for t in range(T):                                  # the epilogue, on values still in cache
            for r in range(n):
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
    R = _block(w.shape[1])
    for block in prange((F + R - 1) // R):
        o = block * R
        n = min(R, F - o)
        _products(xp, w, o, n, out, o)                      # the gate rows, then the up rows: one stream at a time
        _products(xp, w, F + o, n, up, o)
        for t in range(T):
            for r in range(n):
                g, u = out[t, o + r], up[t, o + r]
                if bias.size:
                    g, u = g + bias[o + r], u + bias[F + o + r]
                out[t, o + r] = activate(g, act) * u


KERNELS = (normalized_rows, gemm, gemm_gated)        # what compiled.warm_up loads or compiles


def kernel_input(x, norm=None):
    """x [T, I] -> xp [T, I] float32 C-contiguous, normalized when `norm` (a NormParams) is given."""
    T, n = x.shape
    xp = np.empty((T, n), F32)
    x = np.ascontiguousarray(x, dtype=F32)
    if norm is None:
        normalized_rows(x, 0, NONE_1D, NONE_1D, 0.0, xp)
    else:
        weight = np.ascontiguousarray(norm.weight, dtype=F32)
        bias = NONE_1D if norm.bias is None or norm.kind != "layernorm" else np.ascontiguousarray(norm.bias, F32)
        normalized_rows(x, NORMS[norm.kind], weight, bias, float(norm.eps), xp)
    return xp


def use_threads(threads: int, work: int) -> None:
    """Run the next kernel on `threads` threads, fewer when `work` (multiply-adds) is small. Numba's setting is
    the calling thread's: set on each call, so that the Ops that calls decides."""
    numba.set_num_threads(max(1, min(threads, work // THREAD_WORK, numba.config.NUMBA_NUM_THREADS)))


def fused_gemm(x, w, bias=None, norm=None, act=None, gated=False, residual=None, threads: int = 1):
    """act(norm(x) @ w.T + bias) (+ residual), gated: act(gate) * up, as Ops.fused_linear -> [T, O or O/2].
    w: float32 C-contiguous [O, I] (the caller checks: takes()). threads: at most this many."""
    xp = kernel_input(x, norm)
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


# Tokens up to which the compiled kernels beat BLAS (OpenBLAS through NumPy).
# float32, measured 2026-12-02 on the shared 2-core AMD EPYC Zen 4 (AVX-512; another engineer's jobs running, load
# average 0.7-2.2), SmolLM2's 121 matrices (538 MB) per call, 2 threads, ABAB rounds in one process, medians of 13,
# ms (docs/cpu-kernels.md has the GB/s and a second run of 11 rounds):
#   tokens         1      2      4      8      16     32     64
#   compiled       26.2   29.0   39.4   53.4   75.4   132.7  221.0
#   OpenBLAS       30.3   85.0   86.8   88.0   98.7   123.7  163.2
# Ahead from 1 to 16 tokens there, behind from 32 (OpenBLAS's packed GEMM reuses each loaded weight across more
# tokens than the row path's pair). On a quiet machine OpenBLAS is ahead at 1 token and from 8 (docs/cpu-kernels.md,
# bench/results/cpu-ops-2026-12-02b.md), yet end to end a crossover of 4 ran the chat workload at 0.89x and batch 16
# at 0.84x of 16 (bench/results/abab-crossover4-2026-12-02.md): 16 stays. Every T from 1 to CROSSOVER runs the
# compiled kernel, so that a token's bits do not depend on its step's size there (batch invariance).
# int8, measured 2026-11-28 on the shared 2-core AMD EPYC (AVX2; load average 11-17, compute-starved; 1 thread; ms
# per matrix, >= 64 MB of copies so that weights come from memory, medians of 5 taken in turns, numba / numpy):
#   int8        T=1          2            4            8            16
#   3072x576    8.2/7.7      15.3/18.2    16.2/18.0    25.6/17.3    31.9/16.3
#   576x1536    3.3/4.2      4.3/5.6      7.5/6.8      15.1/6.4     30.4/8.8
#   49152x576   141/189      87/225       186/284      382/272      946/376
# int8 (the NumPy path dequantizes the weight once per call and shares it among the tokens): ahead to 2-4 tokens,
# measured before gemm_quant.py's row kernel; re-measure with `make bench-ops`.
CROSSOVER = 16
QUANT_CROSSOVER = 4


def max_tokens(rows: int, cols: int, quantized: bool = False) -> int:
    """The most tokens for which the compiled kernel is faster than BLAS on a weight [rows, cols] (float32, or
    quantized: gemm_quant.py). The per-shape measurements (git history) found no dependence on the shape
    worth a rule."""
    return QUANT_CROSSOVER if quantized else CROSSOVER


def takes(x, w, act=None) -> bool:
    """Whether the compiled GEMM runs this product: a float32 C-contiguous weight [O, I], a known activation, and
    few enough tokens that it beats BLAS (crossover.py)."""
    return (isinstance(w, np.ndarray) and w.dtype == F32 and w.ndim == 2 and w.flags.c_contiguous
            and act in ACTIVATIONS and x.shape[0] <= max_tokens(*w.shape))
