"""Small-batch GEMM over quantized weights (quant/formats.py), dequantized in registers: y[T, O] = x[T, I] @
dequantize(qt)[O, I]^T (+ bias), reading 1 byte (8 bits) or half a byte (4 bits) per weight instead of 4.

Every mode is x = scale * q + min per group of g inputs of one output row, so a group's share of a dot product is
    sum_k (s q_k + m) x_k = s * (sum_k q_k x_k) + m * (sum_k x_k):
the kernel sums q * x over the group in AVX2 lanes (bytes widened to float32 in registers), then scales it once per
group; sum_k x_k is per token and group, computed once per call. int8 (symmetric, one group per row) is one dot per
output and one multiply; q8_0 and asym8 are groups of 8-bit values; int4 and q4_1 (two values per byte, low nibble
first: element 2j in bits 0-3 of byte j) read each byte once against the even and the odd inputs (x split into
its even and odd columns once per call). The layout is quant/formats.py's own: nothing is repacked.

Blocking, threads and batch invariance as gemm.py: 4 rows x 2 tokens, one code path for every output.
Shape legend: T=tokens, Tp=padded, I=inputs, O=outputs, G=groups per row (I / g), B=bytes per row (I / 2 at 4 bits).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quant.formats import QuantizedTensor
from .gemm import FASTMATH, NONE_1D, NONE_2D, TOKENS, padded_input, use_threads

ROWS = 4                                                 # output rows per register block

F32 = np.float32
MODES = ("int8", "q8_0", "asym8", "int4", "q4_1")        # every mode of quant/formats.py


@njit(fastmath=FASTMATH, cache=True)
def _dot8(xp, q, o0, o1, o2, o3, t, start, stop):
    """sum over k in [start, stop) of q[o, k] * xp[t, k] for rows o0..o3 and tokens t, t + 1 (8-bit q)."""
    s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = F32(0)
    for k in range(start, stop):
        x0 = xp[t, k]
        x1 = xp[t + 1, k]
        w0, w1, w2, w3 = F32(q[o0, k]), F32(q[o1, k]), F32(q[o2, k]), F32(q[o3, k])
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
def _dot4(xe, xo, q, o0, o1, o2, o3, t, start, stop):
    """The same over bytes [start, stop) of 4-bit q [O, B]: low nibble x even input, high nibble x odd input."""
    s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = F32(0)
    for j in range(start, stop):
        e0, e1, d0, d1 = xe[t, j], xe[t + 1, j], xo[t, j], xo[t + 1, j]
        b0, b1, b2, b3 = q[o0, j], q[o1, j], q[o2, j], q[o3, j]
        lo, hi = F32(b0 & 15), F32(b0 >> 4)
        s00 += lo * e0 + hi * d0
        s01 += lo * e1 + hi * d1
        lo, hi = F32(b1 & 15), F32(b1 >> 4)
        s10 += lo * e0 + hi * d0
        s11 += lo * e1 + hi * d1
        lo, hi = F32(b2 & 15), F32(b2 >> 4)
        s20 += lo * e0 + hi * d0
        s21 += lo * e1 + hi * d1
        lo, hi = F32(b3 & 15), F32(b3 >> 4)
        s30 += lo * e0 + hi * d0
        s31 += lo * e1 + hi * d1
    return (s00, s10, s20, s30), (s01, s11, s21, s31)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemm_q(xp, xe, xo, xsum, q, scale, mins, group, bias, out):
    """out[T, O] = xp[:T] @ dequantize(q, scale, mins)^T + bias. 8 bits: q [O, I], xe, xo empty; 4 bits: q [O, B],
    xe, xo [Tp, B] the even and odd inputs. scale [O, G]; mins [O, G] or [0, 0]; xsum [Tp, G] (used with mins);
    group: inputs per group; bias [O] or [0]."""
    T, O = out.shape
    last = O - 1
    packed = xe.shape[1] > 0
    step = group // 2 if packed else group                     # q's columns per group
    for block in prange((O + ROWS - 1) // ROWS):
        o = block * ROWS
        rows = (o, min(o + 1, last), min(o + 2, last), min(o + 3, last))
        acc = np.empty((TOKENS, ROWS), F32)
        for t in range(0, T, TOKENS):
            acc[:] = 0
            for g in range(scale.shape[1]):
                if packed:
                    first, second = _dot4(xe, xo, q, rows[0], rows[1], rows[2], rows[3], t, g * step,
                                          (g + 1) * step)
                else:
                    first, second = _dot8(xp, q, rows[0], rows[1], rows[2], rows[3], t, g * step, (g + 1) * step)
                for r in range(ROWS):
                    acc[0, r] += scale[rows[r], g] * first[r]
                    acc[1, r] += scale[rows[r], g] * second[r]
                    if mins.size:
                        acc[0, r] += mins[rows[r], g] * xsum[t, g]
                        acc[1, r] += mins[rows[r], g] * xsum[t + 1, g]
            for r in range(min(ROWS, O - o)):
                extra = bias[o + r] if bias.size else F32(0)
                out[t, o + r] = acc[0, r] + extra
                if t + 1 < T:
                    out[t + 1, o + r] = acc[1, r] + extra


KERNELS = (gemm_q,)                      # what compiled.warm_up loads or compiles


def linear_q(x, qt, bias=None, threads: int = 1):
    """x [T, I] @ dequantize(qt)^T (+ bias) -> [T, O] float32, qt a QuantizedTensor of MODES."""
    rows, cols = qt.shape
    xp = padded_input(x, pad=True)                                   # [Tp, I]
    packed = qt.bits == 4
    xe = np.ascontiguousarray(xp[:, 0::2]) if packed else NONE_2D     # [Tp, B]
    xo = np.ascontiguousarray(xp[:, 1::2]) if packed else NONE_2D
    mins = NONE_2D if qt.min is None else qt.min
    xsum = NONE_2D if qt.min is None else xp.reshape(len(xp), cols // qt.group_size, qt.group_size).sum(axis=-1)
    out = np.empty((x.shape[0], rows), F32)
    use_threads(threads, xp.size * rows)
    gemm_q(xp, xe, xo, xsum, qt.q, qt.scale, mins, qt.group_size,
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
