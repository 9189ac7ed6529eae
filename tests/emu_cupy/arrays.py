"""Device arrays of the fake cupy (tests/emu_cupy/): `ndarray` wraps NumPy memory that host code reaches only through
.get() / .set(); `_op` runs a NumPy function on that memory (and records it while a stream captures)."""

from __future__ import annotations

import operator
import types

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from . import state
from .devices import Device
from .state import POISON_BYTE


def _is_host_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.ndim > 0


def _unwrap(x, found: list, strict: bool):
    """Device arrays -> their NumPy memory (collected in `found`); host arrays -> TypeError when `strict`."""
    if isinstance(x, ndarray):
        found.append(x._a)
        return x._a
    if strict and _is_host_array(x):
        raise TypeError(f"Unsupported type {type(x)}: a host NumPy array given to a device operation "
                        "(cupy refuses it; upload it with cupy.asarray first)")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, found, strict) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, found, strict) for k, v in x.items()}
    return x


def _wrap(x, originals: dict | None = None):
    if isinstance(x, np.ndarray):
        if originals and id(x) in originals:
            return originals[id(x)]
        return ndarray._of(x)
    if isinstance(x, tuple):
        return tuple(_wrap(v, originals) for v in x)
    if isinstance(x, list):
        return [_wrap(v, originals) for v in x]
    return x


def _has_host_data(x) -> bool:
    """An index or value that cupy would upload (host arrays, lists of numbers)."""
    if isinstance(x, tuple):
        return any(_has_host_data(v) for v in x)
    return _is_host_array(x) or isinstance(x, list)


def _op(fn, args, kwargs=None, *, strict=True, what=None):
    """Run fn (a NumPy function) on the memory of device arrays and wrap the results as device arrays; while a
    stream captures, also record it (a closure that writes the same output memory), unless it made a view."""
    kwargs = kwargs or {}
    ops = state._state.device_op(what or getattr(fn, "__name__", "operation"))
    found: list = []
    a, k = _unwrap(args, found, strict), _unwrap(kwargs, found, strict)
    result = fn(*a, **k)
    if isinstance(result, np.generic):
        result = np.asarray(result)               # cupy gives 0-d device arrays, never scalars
    if ops is not None:
        _record(ops, fn, a, k, result, found)
    originals = {id(v._a): v for v in _iter_wrapped((args, kwargs))}
    return _wrap(result, originals)


def _iter_wrapped(x):
    if isinstance(x, ndarray):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _iter_wrapped(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _iter_wrapped(v)


def _record(ops: list, fn, a, k, result, inputs):
    if result is None or "out" in k:
        ops.append(lambda: fn(*a, **k))
        return
    outputs = result if isinstance(result, tuple) else (result,)
    if not all(isinstance(r, np.ndarray) for r in outputs):
        ops.append(lambda: fn(*a, **k))
        return
    if len(outputs) == 1 and any(np.may_share_memory(result, i) for i in inputs):
        return                                    # a view (reshape, transpose, basic slice, astype(copy=False))

    def replay():
        fresh = fn(*a, **k)
        for r, f in zip(outputs, fresh if isinstance(result, tuple) else (fresh,)):
            r[...] = f

    ops.append(replay)


class ndarray(NDArrayOperatorsMixin):
    """A device array: NumPy memory that host code may only reach through .get() / .set() / cupy.asnumpy."""

    __slots__ = ("_a",)

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = _empty(shape, dtype, order)

    @classmethod
    def _of(cls, array: np.ndarray) -> "ndarray":
        kind, size = array.dtype.kind, array.dtype.itemsize
        if kind not in "biufc" or (kind == "f" and size > 8) or (kind == "c" and size > 16):
            raise TypeError(f"Unsupported dtype {array.dtype} (cupy has no such device dtype; bfloat16 lives on the "
                            "device as uint16 bits)")
        obj = cls.__new__(cls)
        obj._a = array
        return obj

    # --- host <-> device
    def get(self, stream=None, order="C", out=None, blocking=True):
        state._state.host_sync("ndarray.get() (device -> host copy)")
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, copy=True, order=order)

    def set(self, arr, stream=None):
        state._state.host_sync("ndarray.set() (host -> device copy)")
        arr = np.asarray(arr)
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        self._a[...] = arr

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def item(self, *args):
        state._state.host_sync("ndarray.item() (device -> host copy)")
        return self._a.item(*args)

    def tolist(self):
        state._state.host_sync("ndarray.tolist() (device -> host copy)")
        return self._a.tolist()

    def _scalar(self, kind, what):
        state._state.host_sync(f"{what}(device array) (device -> host copy)")
        return kind(self._a)

    def __int__(self):
        return self._scalar(int, "int")

    def __float__(self):
        return self._scalar(float, "float")

    def __bool__(self):
        return self._scalar(bool, "bool")

    def __index__(self):
        state._state.host_sync("operator.index(device array) (device -> host copy)")
        return operator.index(self._a)

    def __complex__(self):
        return self._scalar(complex, "complex")

    # --- numpy protocols
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _op(getattr(ufunc, method), inputs, kwargs, what=f"{ufunc.__name__}.{method}")

    def __array_function__(self, func, types_, args, kwargs):
        return _op(func, args, kwargs, what=func.__name__)

    # --- indexing
    def __getitem__(self, key):
        if _has_host_data(key):
            state._state.host_sync("a host index array (host -> device copy)")
        if any(isinstance(k, ndarray) and k.dtype == np.bool_ for k in (key if isinstance(key, tuple) else (key,))):
            state._state.host_sync("boolean mask indexing (the selected count goes to the host)")
        return _op(operator.getitem, (self, key), strict=False, what="__getitem__")

    def __setitem__(self, key, value):
        if _has_host_data(key) or _has_host_data(value):
            state._state.host_sync("a host index or value array (host -> device copy)")
        _op(operator.setitem, (self, key, value), strict=False, what="__setitem__")

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        for i in range(len(self._a)):
            yield self[i]

    # --- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: types.SimpleNamespace(ptr=self._a.ctypes.data, mem=None))
    device = property(lambda self: Device())

    def __getattr__(self, name):
        if name.startswith("__") or name == "_a":
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if callable(attr):
            if name in ("nonzero", "tobytes", "tofile", "dump", "dumps"):
                state._state.host_sync(f"ndarray.{name}() (device -> host)")

            def method(*args, **kwargs):
                return _op(lambda a, *rest, **kw: getattr(a, name)(*rest, **kw), (self, *args), kwargs,
                           what=f"ndarray.{name}")
            return method
        return _wrap(attr)                 # .T, .real, .imag: views of the same memory

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def __repr__(self):
        return repr(self._a).replace("array(", "emulated_device_array(", 1)

    __str__ = __repr__


def _empty(shape, dtype=float, order="C"):
    a = np.empty(shape, dtype=dtype, order=order)
    a.view(np.uint8).fill(POISON_BYTE) if a.flags.c_contiguous and a.dtype.itemsize else None
    return a
