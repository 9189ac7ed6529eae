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
