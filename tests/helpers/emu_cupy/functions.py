"""The fake `cupy` module's functions (tests/helpers/emu_cupy/): transfers, allocation, any other NumPy function run on
device arrays (`_module_getattr`, the module's __getattr__), cupyx.scatter_add, and cupyx's pinned host arrays
(NumPy arrays registered as pinned: async copies from / to them are queued on their stream)."""

from __future__ import annotations

import types

import numpy as np

from . import pageable, state
from .arrays import _empty, _has_host_data, _op, ndarray


def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype)
    state._state.host_sync("cupy.asarray of host data (host -> device copy)")
    pageable.upload(a, "cupy.asarray")
    return ndarray._of(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        return _op(lambda a: np.array(a, dtype=dtype, copy=copy, order=order, ndmin=ndmin), (obj,), what="array")
    state._state.host_sync("cupy.array of host data (host -> device copy)")
    pageable.upload(obj, "cupy.array")
    return ndarray._of(np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        return asarray(np.ascontiguousarray(a, dtype=dtype))
    return _op(lambda x: np.ascontiguousarray(x, dtype=dtype), (a,), what="ascontiguousarray")


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C"):
    state._state.device_op("empty")
    return ndarray._of(_empty(shape, dtype, order))


def empty_like(a, dtype=None, order="K", subok=None, shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def get_array_module(*args):
    return state._fake if any(isinstance(a, ndarray) for a in args) else np


def is_available():
    return True


# cupy functions that call cuBLAS (GEMM / GEMV / dot) for float inputs: refused while the stream captures
CUBLAS = {"matmul", "dot", "vdot", "inner", "tensordot", "einsum"}
_SYNCING = {"nonzero", "argwhere", "flatnonzero", "unique", "compress", "extract", "array_equal", "allclose"}


def _numpy_function(name):
    fn = getattr(np, name)

    def device_function(*args, **kwargs):
        if name in CUBLAS:
            state._state.library_call(f"cupy.{name}")
        if name in _SYNCING or (name == "where" and len(args) == 1):
            state._state.host_sync(f"cupy.{name} (its result size or value goes to the host)")
        return _op(fn, args, kwargs, what=f"cupy.{name}")

    device_function.__name__ = name
    return device_function


def _module_getattr(name):
    """cupy.<name> for any NumPy function (run on device arrays) or type and constant (as NumPy's)."""
    if name.startswith("__") or not hasattr(np, name):
        raise AttributeError(f"module 'cupy' (emulated) has no attribute {name!r}")
    attr = getattr(np, name)
    if isinstance(attr, types.ModuleType):           # cupy.random, cupy.linalg, ...: NumPy's would give host arrays
        raise AttributeError(f"cupy.{name} is not emulated (tests/helpers/emu_cupy/)")
    if isinstance(attr, type) or not callable(attr):
        return attr
    return _numpy_function(name)


def _scatter_add(a, slices, value):
    if _has_host_data(slices):
        state._state.host_sync("cupyx.scatter_add with a host index array (host -> device copy)")
        pageable.upload_parts(slices, "cupyx.scatter_add's host index array")
    _op(np.add.at, (a, slices, value), strict=False, what="cupyx.scatter_add")


def empty_pinned(shape, dtype=float, order="C"):
    """cupyx.empty_pinned: a NumPy array in pinned memory, uninitialised (0xFF bytes here, as cp.empty)."""
    a = np.empty(shape, dtype=dtype, order=order)
    state.poison(a)
    state._state.pin(a)
    return a


def zeros_pinned(shape, dtype=float, order="C"):
    a = empty_pinned(shape, dtype, order)
    a[...] = 0
    return a


def empty_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return empty_pinned(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return zeros_pinned(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)
