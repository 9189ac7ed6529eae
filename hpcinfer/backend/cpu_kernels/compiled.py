"""The compiled kernels' compile cache: loaded (or filled) once per process, timed and logged.

Numba's cache (`cache=True`) keeps each kernel's machine code in `__pycache__` beside its module; where that folder
is not writable (an installed, read-only package) Numba falls back to a per-user folder (~/.cache/numba, or
$NUMBA_CACHE_DIR when set): a job loads the code a previous job compiled in either place, and only the very first
job compiles (docs/cpu-kernels.md, measured cold and warm start).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import numpy as np

from ...quant.formats import quantize
from . import gemm, gemm_quant

class WarmUp(NamedTuple):
    seconds: float       # to compile the kernels, or load them from the compile cache
    compiled: bool       # anything had to be compiled (the first job on a machine, or after a change)

    def describe(self) -> str:
        how = "compiled (first run, now cached)" if self.compiled else "loaded from the compile cache"
        return f"{how} in {self.seconds:.2f} s"


@functools.cache
def warm_up() -> WarmUp:
    """Compile the kernels, or load them from the cache, once per process -> how long it took and whether anything
    was compiled (the runtime prints it on rank 0's console: runtime._print_kernels)."""
    start = time.perf_counter()
    x = np.ones((3, 8), np.float32)
    for rows in (5, 6):                                   # odd and even row counts: one signature each kernel
        gemm.fused_gemm(x, np.ones((rows, 8), np.float32), np.ones(rows, np.float32), act="silu",
                        residual=np.ones((3, rows), np.float32) if rows == 5 else None, gated=rows == 6)
    w = np.arange(64, dtype=np.float32).reshape(4, 16)
    for mode in ("int8", "int4"):                        # int8 and uint8 q: one signature each
        gemm_quant.linear_q(np.ones((3, 16), np.float32), quantize(w, mode, group_size=8))
    compiled = any(kernel.stats.cache_misses for kernel in gemm.KERNELS + gemm_quant.KERNELS)
    return WarmUp(time.perf_counter() - start, compiled)
