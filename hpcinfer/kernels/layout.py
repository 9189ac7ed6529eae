"""Weight layouts the kernels read, made once at load time (NumPy or CuPy arrays alike).

SBI layout (cuda_src/sbi_core.cuh): W [out, in] -> Wp [ceil(in / VEC), out, VEC] with Wp[kv, c, i] = W[c, kv*VEC + i]
(zero past `in`), VEC = 16 bytes / itemsize: each output column's VEC consecutive input elements are one 16-byte
vector, and a warp's 32 lanes on 32 consecutive columns read 512 contiguous bytes.
"""

from __future__ import annotations

import numpy as np


def sbi_vec(dtype) -> int:
    """Input elements per 16-byte vector: 8 for float16 / bfloat16, 4 for float32."""
    itemsize = np.dtype(dtype).itemsize
    if 16 % itemsize:
        raise ValueError(f"sbi layout: itemsize {itemsize} does not divide 16 bytes")
    return 16 // itemsize


def sbi_pack(w, xp=np):
    """W [out, in] -> the SBI layout [ceil(in / VEC), out, VEC], contiguous, same dtype (xp: numpy or cupy)."""
    if w.ndim != 2:
        raise ValueError(f"sbi_pack: weight must be [out, in], got shape {w.shape}")
    out, n_in = w.shape
    vec = sbi_vec(w.dtype)
    kvecs = -(-n_in // vec)
    if kvecs * vec != n_in:
        padded = xp.zeros((out, kvecs * vec), dtype=w.dtype)
        padded[:, :n_in] = w
        w = padded
    return xp.ascontiguousarray(w.reshape(out, kvecs, vec).transpose(1, 0, 2))


def sbi_unpack(wp, n_in: int, xp=np):
    """The inverse of sbi_pack: [ceil(in / VEC), out, VEC] -> W [out, in]."""
    kvecs, out, vec = wp.shape
    return xp.ascontiguousarray(wp.transpose(1, 0, 2).reshape(out, kvecs * vec)[:, :n_in])


# ---- quantized weights (cuda_src/quant_core.cuh) -------------------------------------------------------------
# Quant layout: the packed bytes of a quantized weight's rows, q [out, B] (B = in at 8 bits, in / 2 at 4 bits, low
# nibble first), as the SBI layout over bytes: Qp [ceil(B / 16), out, 16], zero past B, so each 16-byte vector
# holds 16 (8-bit) or 32 (4-bit) consecutive input elements of one output row; scales and minimums [out, G] are
# transposed to [G, out] so that a warp's 32 consecutive rows read them contiguously.
def quant_pack(q, scale, minimum=None, xp=np):
    """(q [out, B] int8 / uint8, scale [out, G], min [out, G] or None) -> (Qp [ceil(B / 16), out, 16] same dtype,
    scale [G, out] float32, min [G, out] float32 or None), all contiguous (xp: numpy or cupy)."""
    if q.ndim != 2 or q.dtype.itemsize != 1 or scale.ndim != 2 or scale.shape[0] != q.shape[0]:
        raise ValueError(f"quant_pack: q must be [out, bytes] of 1-byte values and scale [out, groups], got "
                         f"{q.dtype} {q.shape} and {scale.shape}")
    transpose = (lambda a: None if a is None else xp.ascontiguousarray(a.T, dtype=np.float32))
    return sbi_pack(q, xp), transpose(scale), transpose(minimum)


def quant_unpack(qp, n_bytes: int, scale_t, min_t=None, xp=np):
    """The inverse of quant_pack -> (q [out, B], scale [out, G], min [out, G] or None)."""
    transpose = (lambda a: None if a is None else xp.ascontiguousarray(a.T))
    return sbi_unpack(qp, n_bytes, xp), transpose(scale_t), transpose(min_t)
