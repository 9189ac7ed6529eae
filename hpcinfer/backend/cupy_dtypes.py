"""How the CuPy backend stores floats on the device. CuPy has no bfloat16 dtype, so a bfloat16 array lives on the
device as uint16 holding its bits (the upper half of a float32): on the device, uint16 always means bfloat16 bits.
cupy_ops.py (the ops) and cupy_transfer.py (the copy engine) both follow this rule; it lives below both.
"""

from __future__ import annotations

import numpy as np

BF16_BITS = np.dtype(np.uint16)          # device dtype of bfloat16 storage


def is_bf16(dtype) -> bool:
    if isinstance(dtype, str):                           # "bfloat16" needs no ml_dtypes import
        return dtype == "bfloat16"
    return dtype is not None and np.dtype(dtype).name == "bfloat16"


KV_DTYPES = ("float32", "float16", "bfloat16")     # a float KV cache's storage ([model] kv_dtype)


def c_type(dtype) -> str | None:
    """The kernels' T_STORAGE for a device dtype (uint16 holds bfloat16 bits); None for any other dtype."""
    return {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16"}.get(np.dtype(dtype).name)


def stored(ops, x, dtype):
    """Float32 rows x as a device array of storage `dtype` (float32, float16, or uint16 bfloat16 bits, rounded to
    nearest even as the kernels' from_float): what a cache of that dtype holds after an append."""
    dtype = np.dtype(dtype)
    if dtype == BF16_BITS:
        return x if x.dtype == BF16_BITS else ops.k.to_bf16(ops.xp.ascontiguousarray(x, dtype=np.float32))
    return x.astype(dtype, copy=False)
