"""Reading cached K/V rows inside the compiled attention kernels (cpu_kernels/attention.py): a chunk of one KV
head's positions in one block of a pool, float32 as it lies or dequantized from quant/kv.py's int8 / int4 rows.

A pool is what a KV store holds for one layer, as plain arrays: values [NB, Hkv, bs, X] (X = hd float32, or the
packed bytes of a quantized pool: hd for int8, hd / 2 for int4, low nibble first) and, when quantized, scale and
min [NB, Hkv, bs, G] float16 (passed as their uint16 bits: Numba has no float16 on the CPU). A float pool passes
empty uint16 arrays there. The dense cache [N, Hkv, Lmax, hd] is such a pool with one block of Lmax positions per
sequence (its slot).

Shape legend: NB=blocks, Hkv=KV heads, bs=positions per block, hd=head dim, G=groups per row, g=values per group,
C=positions of a chunk.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

F32 = np.float32
FAST = {"reassoc", "contract", "arcp", "nsz"}   # vectorized reductions; no assumption that values are finite


@njit(fastmath=FAST, cache=True, inline="always")
def half_to_float(bits) -> float:
    """A float16, given as its uint16 bits, as float32 (normal and subnormal; scale and min are finite)."""
    h = np.int32(bits)
    exponent, mantissa = (h >> 10) & 0x1F, h & 0x3FF
    if exponent == 0:
        value = F32(mantissa) * F32(2.0 ** -24)                      # subnormal
    else:
        value = F32(mantissa + 1024) * F32(math.ldexp(1.0, exponent - 25))
    return -value if h & 0x8000 else value


def block_rows(values, scales, mins, group, block, head, offset, count, buf):
    """Rows offset .. offset + count - 1 of `head` in `block` as float32: (rows [*, hd], first row index).
    A float pool's rows are returned where they lie (the block's [bs, hd] view, offset); a quantized pool's are
    dequantized into buf [>= count, hd] (buf, 0). Compiled per pool type (the overload below)."""
    raise NotImplementedError("block_rows runs compiled only")


@overload(block_rows, jit_options={"fastmath": FAST})
def _block_rows(values, scales, mins, group, block, head, offset, count, buf):
    if values.dtype == types.float32:
        def rows_in_place(values, scales, mins, group, block, head, offset, count, buf):
            return values[block, head], offset
        return rows_in_place

    def rows_dequantized(values, scales, mins, group, block, head, offset, count, buf):
        dequantize_rows(values[block, head], scales[block, head], mins[block, head], group, offset, count, buf)
        return buf, 0
    return rows_dequantized


@njit(fastmath=FAST, cache=True)
def dequantize_rows(packed, scales, mins, group, offset, count, buf):
    """packed [bs, X] uint8, scales / mins [bs, G] uint16 (float16 bits): rows offset .. offset + count - 1 ->
    buf[:count] [hd] float32 = q * scale + min per group (quant/kv.dequantize_rows; int4 when X = hd / 2)."""
    hd = buf.shape[1]
    groups = hd // group
    nibbles = packed.shape[1] * 2 == hd
    for c in range(count):
        row, out = packed[offset + c], buf[c]
        for gi in range(groups):
            scale = half_to_float(scales[offset + c, gi])
            low = half_to_float(mins[offset + c, gi])
            first = gi * group
            if nibbles:
                for b in range(group // 2):
                    byte = row[first // 2 + b]
                    out[first + 2 * b] = F32(byte & 15) * scale + low
                    out[first + 2 * b + 1] = F32(byte >> 4) * scale + low
            else:
                for e in range(group):
                    out[first + e] = F32(row[first + e]) * scale + low


@njit(fastmath=FAST, cache=True)
def read_row(values, scales, mins, group, block, head, offset, buf):
    """One cached row as float32 [hd] (buf[0] filled when the pool is quantized)."""
    rows, first = block_rows(values, scales, mins, group, block, head, offset, 1, buf)
    return rows[first]


# Cephes' expf (its degree-5 polynomial on [-ln2/2, ln2/2]), written so that LLVM vectorizes it: np.exp in a
# loop calls the scalar libm function (about 3 ns an element here, a third of a decode step's arithmetic).
_LOG2E, _LN2_HI, _LN2_LO = F32(1.4426950408889634), F32(0.693359375), F32(-2.12194440e-4)


@njit(fastmath=FAST, cache=True, inline="always")
def exp_in_place(x, count, bits):
    """x[:count] <- exp(x[:count]) for x <= 0, within 2 ulp; below -87.3 the result is 0 (-88 and less: exactly
    0, as a masked score needs). bits: int32 scratch [>= count]."""
    for p in range(count):
        v = max(x[p], F32(-88.0))
        k = np.floor(v * _LOG2E + F32(0.5))                       # float32
        r = v - k * _LN2_HI - k * _LN2_LO
        y = F32(1.9875691500e-4)
        y = y * r + F32(1.3981999507e-3)
        y = y * r + F32(8.3334519073e-3)
        y = y * r + F32(4.1665795894e-2)
        y = y * r + F32(1.6666665459e-1)
        y = y * r + F32(5.0000001201e-1)
        x[p] = y * r * r + r + F32(1)
        bits[p] = (np.int32(k) + np.int32(127)) << np.int32(23)   # 2^k as float32 bits (k = -127: 0.0)
    scale = bits[:count].view(np.float32)
    for p in range(count):
        x[p] *= scale[p]
