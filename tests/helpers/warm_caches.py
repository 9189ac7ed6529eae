"""Fill the compile caches a test run reads, once, before the suites start (tests/run_all.sh runs it).

On a fresh clone every cache is cold: Numba's (the CPU kernels, `cache=True`, in hpcinfer/backend/cpu_kernels/
__pycache__) and the kernel emulator's (build/kernel-emu/: its precompiled header, then a library per kernel
build). Left to the suites, each test process that first needs a Numba kernel compiles it (pytest-xdist's workers
and every `python -m hpcinfer` rank a CLI test starts, at the same time, each for itself) until one of them has
written the cache. Compiled here first, every one of them loads it instead. Every signature the suites use:
the GEMMs (compiled.warm_up) and the attention kernels over float32 and quantized (uint8) stores, dense and top-k.
The emulator's precompiled header is built here too; its per-kernel libraries are many, and built as needed.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import kernel_emulator
from hpcinfer.backend.cpu_kernels import NUMBA_ERROR, compiled
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.quant.kv import QuantizedKV, kv_format


def attention_kernels(mode: str) -> None:
    """One decode step and one prefill step over a store of `mode` ("none": float32; "int8", whose uint8 arrays are
    int4's signature too), dense attention and top-k."""
    rng = np.random.default_rng(0)
    heads, kv_heads, hd, lmax = 4, 2, 32, 16
    ops = NumpyOps(1, "numba")
    for topk in (0.0, 0.5):
        for counts in ([1, 1], [3, 2]):
            caches = [rng.standard_normal((2, kv_heads, lmax, hd), dtype=np.float32) for _ in range(2)]
            if mode != "none":
                caches = [QuantizedKV.zeros(ops, kv_format(mode, 32, hd), c.shape) for c in caches]
            T = sum(counts)
            q = rng.standard_normal((T, heads, hd), dtype=np.float32)
            k, v = (rng.standard_normal((T, kv_heads, hd), dtype=np.float32) for _ in range(2))
            ops.attention(q, k, v, *caches, StepLayout.build([0, 1], [4, 5], counts), 0.3, topk)

PARTS = ("float", "quantized", "rest")   # the attention kernels over float and over quantized stores (most of the
                                         # compile time), everything else: three processes


def main(parts: list[str]) -> int:
    start = time.perf_counter()
    done = []
    if "rest" in parts and kernel_emulator.unavailable() is None:
        kernel_emulator.precompiled_header()
        done.append("the emulator's precompiled header")
    if "rest" in parts and NUMBA_ERROR is None:
        compiled.warm_up()
        done.append("the Numba GEMMs")
    for part, mode in (("float", "none"), ("quantized", "int8")):
        if part in parts and NUMBA_ERROR is None:
            attention_kernels(mode)
            done.append(f"the Numba attention kernels over {part} stores")
    print(f"warm_caches: {', '.join(done) or 'nothing to warm'} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(PARTS)
    if unknown:
        sys.exit(f"warm_caches.py: unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)} (none: all)")
    sys.exit(main(sys.argv[1:] or list(PARTS)))
