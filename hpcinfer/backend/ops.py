"""make_ops: the Ops of a rank, chosen by `[runtime] backend`. The top of backend/: it imports the implementations
(numpy_ops.py, the spec; cupy_ops.py, which imports cupy only when a CupyOps is built), and they import the
interface they share from backend/interface.py, so nothing below imports this module.
"""

from __future__ import annotations

from ..errors import ConfigError
from . import cupy_ops
from .cpu_kernels import resolve as resolve_cpu_kernels
from .interface import BACKENDS, Ops
from .numpy_ops import NumpyOps


def resolve_backend(requested: str) -> str:
    """`[runtime] backend` as it will run: numpy or cupy as asked; auto = cupy when cupy sees a GPU, else numpy."""
    if requested != "auto":
        return requested
    return "cupy" if cupy_ops.gpu_available() else "numpy"


def make_ops(backend: str, device: int | None = None, threads: int | None = None,
             cpu_kernels: str = "auto", kv_dtype: str = "float32") -> Ops:
    """Resolve `[runtime] backend`: numpy; cupy (a CUDA GPU, or a ConfigError saying why not); auto = cupy when
    cupy sees a GPU, else numpy. `device` (cupy only): the GPU among the visible ones, taken modulo their count;
    the runtime passes the node-local rank. None selects no device and touches no GPU (a check of the config).
    `threads`: the rank's BLAS threads, over which the NumPy decode attention splits its sequences (on cupy: CPU
    attention delegation's); default the usable cores. `cpu_kernels`: `[runtime] cpu_kernels` (backend/cpu_kernels),
    the NumPy backend's compiled kernels (on cupy: CPU attention delegation's). `kv_dtype` (cupy only;
    config.gpu_kv_dtype): a float KV cache's storage on the GPU, float32 / float16 / bfloat16; the NumPy backend
    keeps float32."""
    backend = resolve_backend(backend)
    if backend == "numpy":
        return NumpyOps(threads, resolve_cpu_kernels(cpu_kernels))
    if backend == "cupy":
        return cupy_ops.CupyOps(device, host_threads=threads, host_kernels=resolve_cpu_kernels(cpu_kernels),
                                kv_dtype=kv_dtype)
    raise ConfigError(f"[runtime] backend = {backend!r} is not one of {', '.join(BACKENDS)}")
