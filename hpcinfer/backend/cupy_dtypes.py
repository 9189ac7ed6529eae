"""How the CuPy backend stores floats on the device. CuPy has no bfloat16 dtype, so a bfloat16 array lives on the
device as uint16 holding its bits (the upper half of a float32): on the device, uint16 always means bfloat16 bits.
cupy_ops.py (the ops) and cupy_transfer.py (the copy engine) both follow this rule; it lives below both.
"""

from __future__ import annotations

import numpy as np

BF16_BITS = np.dtype(np.uint16)          # device dtype of bfloat16 storage


def is_bf16(dtype) -> bool:
    return dtype is not None and np.dtype(dtype).name == "bfloat16"
