"""Device arrays of the fake cupy (tests/helpers/emu_cupy/): `ndarray` wraps NumPy memory that host code reaches only
through .get() / .set() (synchronous, or queued on a stream as an async copy: _HostToDevice, _DeviceToHost); `_op` runs
a NumPy function on that memory (and records it while a stream captures)."""

from __future__ import annotations

import operator
import types

import numpy as np
from numpy.lib.array_utils import byte_bounds
from numpy.lib.mixins import NDArrayOperatorsMixin

from . import pageable, state
from .devices import Device
from .state import POISON_BYTE, StreamOrderError, raise_pending


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
    stream captures, also record it (a closure that writes the same output memory), unless it made a view. Memory
    with a pending async host -> device copy may only be viewed (StreamOrderError otherwise)."""
    kwargs = kwargs or {}
    what = what or getattr(fn, "__name__", "operation")
    ops = state._state.device_work(what)
    found: list = []
    a, k = _unwrap(args, found, strict), _unwrap(kwargs, found, strict)
    hits = state._state.pending_hits(found)
    result = _run_checked(fn, a, k, hits, what) if hits else fn(*a, **k)
    if isinstance(result, np.generic):
        result = np.asarray(result)               # cupy gives 0-d device arrays, never scalars
    if ops is not None:
        _record(ops, fn, a, k, result, found)
    originals = {id(v._a): v for v in _leaves((args, kwargs), ndarray)}
    return _wrap(result, originals)


def _run_checked(fn, a, k, hits, what):
    """fn on memory that a pending copy writes: allowed only when it makes a view (no memory is touched)."""
    try:
        result = fn(*a, **k)
    except Exception as exc:
        raise StreamOrderError(f"{what} failed on device memory with a pending async copy ({exc})") from exc
    if not _is_view(result, k, list(_leaves((a, k), np.ndarray))):
        raise_pending(hits, what)
    return result


def _leaves(x, kind):
    """Every `kind` instance in nested lists, tuples and dict values."""
    if isinstance(x, kind):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v, kind)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v, kind)


def _is_view(result, k, inputs) -> bool:
    """The op only made a view of an input (reshape, transpose, basic slice, astype(copy=False))."""
    return (isinstance(result, np.ndarray) and "out" not in k
            and any(np.may_share_memory(result, i) for i in inputs))


def _record(ops: list, fn, a, k, result, inputs):
    if result is None or "out" in k:
        return _append(ops, lambda: fn(*a, **k), inputs)
    outputs = result if isinstance(result, tuple) else (result,)
    if not all(isinstance(r, np.ndarray) for r in outputs):
        return _append(ops, lambda: fn(*a, **k), inputs)
    if len(outputs) == 1 and _is_view(result, k, inputs):
        return                                    # a view (reshape, transpose, basic slice, astype(copy=False))

    def replay():
        fresh = fn(*a, **k)
        for r, f in zip(outputs, fresh if isinstance(result, tuple) else (fresh,)):
            r[...] = f

    _append(ops, replay, [*inputs, *outputs])


def _append(ops: list, closure, touched):
    """Record a closure with the device memory it uses (Graph.launch checks it for pending copies)."""
    closure.touched = list(touched)
    ops.append(closure)


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
        """Device -> host. Synchronous (as before) unless blocking=False on a non-null stream (the given one, or the
        current one): then queued on that stream (see _copy_to_host_async)."""
        state._state.host_sync("ndarray.get() (device -> host copy)")
        target = state._state.current() if stream is None else stream
        if not blocking and not target.is_null:
            return _copy_to_host_async(self, target, out, order)
        self._ordered_read("ndarray.get()", target)
        pageable.download_of(self, out, "ndarray.get()")
        if out is not None:
            _check_out(self, out)[...] = self._a
            return out
        return np.array(self._a, copy=True, order=order)

    def set(self, arr, stream=None):
        """Host -> device. Synchronous (as before) without a stream or on the null stream; on another stream,
        queued there (see _copy_from_host_async)."""
        state._state.host_sync("ndarray.set() (host -> device copy)")
        arr = np.asarray(arr)
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        if stream is not None and not stream.is_null:
            return _copy_from_host_async(self, arr, stream)
        state._state.order_before(state._state.current())
        state._state.check_pending([self._a], "ndarray.set()")
        pageable.upload(arr, "ndarray.set()")
        self._a[...] = arr

    def _read_to_host(self, what):
        state._state.host_sync(f"{what} (device -> host copy)")
        self._ordered_read(what)
        pageable.download_of(self, None, what)

    def _ordered_read(self, what, stream=None):
        """A synchronous device -> host read: after the queued copies it is ordered after, never of memory that a
        copy on another stream is still writing."""
        state._state.order_before(stream or state._state.current())
        state._state.check_pending([self._a], what)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def item(self, *args):
        self._read_to_host("ndarray.item()")
        return self._a.item(*args)

    def tolist(self):
        self._read_to_host("ndarray.tolist()")
        return self._a.tolist()

    def _scalar(self, kind, what):
        self._read_to_host(f"{what}(device array)")
        return kind(self._a)

    def __int__(self):
        return self._scalar(int, "int")

    def __float__(self):
        return self._scalar(float, "float")

    def __bool__(self):
        return self._scalar(bool, "bool")

    def __index__(self):
        self._read_to_host("operator.index(device array)")
        return operator.index(self._a)

    def __complex__(self):
        return self._scalar(complex, "complex")

    # --- numpy protocols
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul:
            state._state.library_call("the @ operator (cupy.matmul)")
        return _op(getattr(ufunc, method), inputs, kwargs, what=f"{ufunc.__name__}.{method}")

    def __array_function__(self, func, types_, args, kwargs):
        if func.__name__ in ("matmul", "dot", "vdot", "inner", "tensordot", "einsum"):
            state._state.library_call(f"numpy.{func.__name__} on device arrays (cuBLAS)")
        return _op(func, args, kwargs, what=func.__name__)

    # --- indexing
    def __getitem__(self, key):
        if _has_host_data(key):
            state._state.host_sync("a host index array (host -> device copy)")
            pageable.upload_parts(key, "a host index array")
        if any(isinstance(k, ndarray) and k.dtype == np.bool_ for k in (key if isinstance(key, tuple) else (key,))):
            state._state.host_sync("boolean mask indexing (the selected count goes to the host)")
        return _op(operator.getitem, (self, key), strict=False, what="__getitem__")

    def __setitem__(self, key, value):
        if _has_host_data(key) or _has_host_data(value):
            state._state.host_sync("a host index or value array (host -> device copy)")
            pageable.upload_parts((key, value), "a host index or value array")
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
                if name == "dot":
                    state._state.library_call("ndarray.dot (cuBLAS)")
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


# --- async copies: queued on a stream, run when it is flushed (devices.Stream._flush)
def _check_out(src: ndarray, out):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != src.shape or out.dtype != src.dtype:
        raise ValueError(f"out ({out.shape}, {out.dtype}) does not match the array ({src.shape}, {src.dtype})")
    if not (out.flags.c_contiguous or out.flags.f_contiguous):
        raise RuntimeError("Cannot copy to a non-contiguous out array")
    return out


def _copy_from_host_async(dst: ndarray, host: np.ndarray, stream):
    """set(host, stream=s): from pinned memory, queued on s (dst pending until it runs, host bytes snapshotted);
    from pageable memory, run now (CUDA stages pageable memory synchronously) and counted."""
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)        # a staging copy: pageable
    upload_async(dst._a, host, stream, "ndarray.set(stream=...) into")


def upload_async(dst: np.ndarray, host: np.ndarray, stream, what: str):
    """A host -> device copy on `stream` between the memory of two NumPy views (the device one the fake's
    memory): from pinned memory queued (dst pending until it runs), from pageable memory run now and counted."""
    st = state._state
    if _ran_pageable(dst, host, stream, what, dst, host):
        return
    # not poisoned now: a copy queued before this one on the same stream (a download of the old contents) must
    # still read them; device work that touches the range before the copy ran raises (state.check_pending)
    copy = _HostToDevice(dst, host, stream)
    with st.lock:
        st.pending.append(copy)
        stream._enqueue(copy)


def _ran_pageable(device: np.ndarray, host: np.ndarray, stream, what: str, dst, src) -> bool:
    """Check the device side against pending copies; with a pageable host side, copy now (CUDA stages pageable
    memory synchronously, in stream order), count it and return True."""
    st = state._state
    st.check_pending([device], what, allow=stream)
    if st.is_pinned(host):
        return False
    pageable.note(host, host.nbytes, pageable.DEVICE_TO_HOST if dst is host else pageable.HOST_TO_DEVICE, what)
    st.pageable_async_copies += 1
    st.order_before(stream)
    dst[...] = src
    return True


def _copy_to_host_async(src: ndarray, stream, out, order):
    """get(stream=s, out=pinned, blocking=False): queued on s (out poisoned until it runs, the device memory read
    when it runs); into pageable memory (or no out), run now and counted."""
    if out is None:
        state._state.check_pending([src._a], "ndarray.get(stream=..., blocking=False)", allow=stream)
        state._state.pageable_async_copies += 1
        pageable.download_of(src, None, "ndarray.get(stream=..., blocking=False)")
        state._state.order_before(stream)
        return np.array(src._a, copy=True, order=order)
    return download_async(src._a, _check_out(src, out), stream, "ndarray.get(stream=..., blocking=False)")


def download_async(src: np.ndarray, out: np.ndarray, stream, what: str):
    """A device -> host copy on `stream` between the memory of two NumPy views: into pinned memory queued (out
    poisoned until it runs, the device memory read when it runs), into pageable memory run now and counted."""
    if _ran_pageable(src, out, stream, what, out, src):
        return out
    out[...] = np.frombuffer(bytes([POISON_BYTE]) * out.dtype.itemsize, dtype=out.dtype)[0]   # any view, any dtype
    stream._enqueue(_DeviceToHost(src, out))
    return out


class _HostToDevice:
    """A queued host -> device copy: its destination [lo, hi) is pending (state.pending) until it runs."""

    def __init__(self, dst: np.ndarray, host: np.ndarray, stream):
        self.dst, self.host, self.snapshot, self.stream = dst, host, host.tobytes(), stream
        self.lo, self.hi = byte_bounds(dst)

    def run(self):
        try:
            if self.host.tobytes() != self.snapshot:
                raise StreamOrderError(
                    f"the host buffer of an async host->device copy (stream {self.stream!r}, {self.host.nbytes} "
                    "bytes) changed before the copy ran: keep pinned sources unchanged until the copy's event has "
                    "completed")
            self.dst[...] = self.host
            _count(self.host.nbytes)
        finally:
            with state._state.lock:
                state._state.pending.remove(self)


class _DeviceToHost:
    """A queued device -> host copy: copies what the device memory holds when it runs."""

    def __init__(self, src: np.ndarray, out: np.ndarray):
        self.src, self.out = src, out

    def run(self):
        self.out[...] = self.src
        _count(self.out.nbytes)


def _count(nbytes: int):
    state._state.async_copies += 1
    state._state.async_copy_bytes += int(nbytes)
