"""Small-batch GEMM over quantized weights (quant/formats.py), dequantized in registers: y[T, O] = x[T, I] @
dequantize(qt)[O, I]^T (+ bias), reading 1 byte (8 bits) or half a byte (4 bits) per weight instead of 4.

Every mode is w = scale * q + min per group of g inputs of one output row, so a group's share of a dot product is
    sum_k (s q_k + m) x_k = s * (sum_k q_k x_k) + m * (sum_k x_k):
the kernel sums q * x over the group in AVX-512 lanes (bytes widened to float32 in registers: vpmovsxbd /
vpmovzxbd, vcvtdq2ps, vfmadd231ps on zmm), then scales it once per group; sum_k x_k is per token and group,
computed once per call. int8 (symmetric, one group per row) is one dot per output and one multiply; q8_0 and asym8
are groups of 8-bit values; int4 and q4_1 (two values per byte, low nibble first: element 2j in bits 0-3 of byte j)
read each byte once against the even and the odd inputs (x split into its even and odd columns once per call), its
nibbles split in float32 (v - 16 floor(v / 16), exact), as Numba widens integer arithmetic to 64-bit lanes. The
layout is quant/formats.py's own: nothing is repacked.

Loop shape: one output row at a time, its dot for every token of the step while the row is in L1. The weight is
then read as ONE sequential stream, which this machine's prefetchers follow at full speed; gemm.py's register
blocks of 8 rows read 8 streams at once, which they do not (AMD EPYC Zen 4, one thread, a 98304 x 576 int8 weight
read from memory: 18.6 GB/s one row at a time, 5.9 GB/s in blocks of 8 rows; float32 29.7 against 13.7). A 1-row
dot is a single reduction, which LLVM vectorizes 16 lanes x 4 over I (and a group's dot the same, its tail in 8
lanes). So there is no register block to share with gemm.py, and no padding token: 1 token does no spare work.

Batch invariance: every output y[t, o] is computed by the same code whatever T is and wherever t sits in the step
(there is one path, per row and token, and one thread per row: prange over row blocks), so a token's row is the
same bits alone or among others (tested for every mode).
Shape legend: T=tokens, I=inputs, O=outputs, G=groups per row (I / g), B=bytes per row (I / 2 at 4 bits),
W=q's columns per group (g, or g / 2 at 4 bits).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quant.formats import QuantizedTensor
from .gemm import FASTMATH, NONE_1D, NONE_2D, kernel_input, use_threads

ROWS = 16                                                # output rows per parallel work item (one stretch of q)

F32 = np.float32
MODES = ("int8", "q8_0", "asym8", "int4", "q4_1")        # every mode of quant/formats.py


@njit(fastmath=FASTMATH, cache=True)
def _dot(x, q):
    """sum_k q[k] * x[k] over 1-D rows: x float32, q 8-bit (widened to float32 in registers)."""
    s = F32(0)
    for k in range(x.shape[0]):
        s += q[k] * x[k]
    return s


@njit(fastmath=FASTMATH, cache=True)
def _dot_nibbles(xe, xo, q):
    """sum_j low(q[j]) * xe[j] + high(q[j]) * xo[j] over 1-D rows of bytes q and the even / odd inputs xe, xo."""
    s = F32(0)
    for j in range(q.shape[0]):
        v = F32(q[j])
        high = np.floor(v * F32(0.0625))
        s += (v - F32(16) * high) * xe[j] + high * xo[j]
    return s


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemm_q(xp, xe, xo, xsum, q, scale, mins, bias, out):
    """out[T, O] = xp @ dequantize(q, scale, mins)^T + bias. 8 bits: q [O, I], xe, xo empty; 4 bits: q [O, B],
    xe, xo [T, B] the even and odd inputs. scale [O, G]; mins [O, G] or [0, 0]; xsum [T, G] (used with mins);
    bias [O] or [0]."""
    T, O = out.shape
    G = scale.shape[1]
    packed = xe.shape[1] > 0
    W = q.shape[1] // G
    groups = q.reshape(O, G, W)                                          # [O, G, W], a view
    for block in prange((O + ROWS - 1) // ROWS):
        for o in range(block * ROWS, min(block * ROWS + ROWS, O)):
            for t in range(T):                                           # row o is in L1 after the first token
                if packed:
                    even, odd = xe[t].reshape(G, W), xo[t].reshape(G, W)
                else:
                    x = xp[t].reshape(G, W)
                acc = bias[o] if bias.size else F32(0)
                for g in range(G):
                    if packed:
                        part = _dot_nibbles(even[g], odd[g], groups[o, g])
                    else:
                        part = _dot(x[g], groups[o, g])
                    acc += scale[o, g] * part
                    if mins.size:
                        acc += mins[o, g] * xsum[t, g]
                out[t, o] = acc


KERNELS = (gemm_q,)                      # what compiled.warm_up loads or compiles


def linear_q(x, qt, bias=None, threads: int = 1):
    """x [T, I] @ dequantize(qt)^T (+ bias) -> [T, O] float32, qt a QuantizedTensor of MODES."""
    rows, cols = qt.shape
    xp = kernel_input(x)                                             # [T, I] float32, C-contiguous
    packed = qt.bits == 4
    xe = np.ascontiguousarray(xp[:, 0::2]) if packed else NONE_2D     # [T, B]
    xo = np.ascontiguousarray(xp[:, 1::2]) if packed else NONE_2D
    mins = NONE_2D if qt.min is None else qt.min
    xsum = NONE_2D if qt.min is None else xp.reshape(len(xp), cols // qt.group_size, qt.group_size).sum(axis=-1)
    out = np.empty((x.shape[0], rows), F32)
    use_threads(threads, xp.size * rows)
    gemm_q(xp, xe, xo, xsum, qt.q, qt.scale, mins,
           NONE_1D if bias is None else np.ascontiguousarray(bias, dtype=F32), out)
    return out


def contiguous(qt):
    """qt with C-contiguous arrays (itself when they are): the layout the kernel reads."""
    arrays = [qt.q, qt.scale, qt.min]
    if all(a is None or a.flags.c_contiguous for a in arrays):
        return qt
    q, scale, mins = (None if a is None else np.ascontiguousarray(a) for a in arrays)
    return QuantizedTensor(qt.mode, q, scale, mins, qt.group_size)


def takes(x, qt, max_tokens: int) -> bool:
    """Whether the compiled kernel runs this product: a mode it knows, C-contiguous arrays, few enough tokens."""
    arrays = (qt.q, qt.scale) + (() if qt.min is None else (qt.min,))
    return (qt.mode in MODES and x.shape[0] <= max_tokens and all(a.flags.c_contiguous for a in arrays)
            and qt.scale.dtype == F32)
