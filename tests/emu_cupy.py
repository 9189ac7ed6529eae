"""A CPU stand-in for cupy, so that the CuPy backend (hpcinfer/backend/cupy_ops.py) and its cuda_src/ kernels run,
and are tested, on a machine with no GPU.

What it is: a fake `cupy` module (and `cupy.cuda`, `cupyx`) over NumPy. Device arrays are `ndarray` objects that
wrap a NumPy array (their "device memory"); NumPy arrays are host arrays. As cupy's, device arrays are not
`np.ndarray` instances (a subclass would let `isinstance(x, np.ndarray)` host checks and `np.asarray(x)` pass here
and fail on a GPU); a test may peek at the memory as `x._a` without a transfer. Kernels are really run:
`RawModule(code=..., options=...)` compiles the *given source* with its -D options for the CPU emulator
(hpcinfer.kernels.emulate: g++ + cuda_src/emu/cuda_emu.h, one fiber per CUDA thread, cached under
build/kernel-emu/), and `ElementwiseKernel` turns its CUDA snippet into a kernel (a grid-stride loop over i; raw
params are pointers, other arrays are indexed by i, scalars by value) compiled the same way: the real snippets run.

Use it (pytest; tests/ is on sys.path through conftest.py):
    # the fixture `emu_cupy` (tests/conftest.py, function scope) yields the fake module:
    def test_x(emu_cupy): ops = CupyOps(device=0)       # or make_ops("cupy", 0); nests in installed()
    import emu_cupy as emu                              # any scope: `with emu.installed() as cp:` (module fixtures),
    emu.install(monkeypatch, devices=1, sm_count=2)     # or with a MonkeyPatch; both return the fake module
    # a whole GPU-only test module on the fake, as a plugin (CLI subprocesses do not see the fake: deselect them):
    #   PYTHONPATH=tests .venv/bin/python -m pytest -p emu_cupy tests/test_cupy_ops.py -k "not smollm2 and not cli"

What it checks, as a GPU would refuse it:
- host/device separation: `np.asarray(device_array)` raises (as cupy), mixing host NumPy arrays into device math
  raises TypeError, device arrays are not `np.ndarray`; `cp.empty` memory starts as 0xFF bytes (NaN, -1) so an
  op that leaves part of its output unwritten shows it;
- kernel launches: argument count, pointer dtypes against the kernel's C types (T_STORAGE / T_ACT from the -D
  options), scalar sizes (cupy passes a numpy scalar's bytes as they are, a Python int as int64, a float as
  float64: `int` params need np.int32, `long long` np.int64, `float` np.float32), host arrays given as pointers,
  the emulator's deadlock check (a __syncthreads or shuffle not reached by every thread), and bounds: a kernel
  gets each array's whole allocation between 4 KiB margins of 0xFF bytes, so a read just past it reads NaN / -1
  and a write past it is reported;
- ElementwiseKernel: its snippet compiles as C++ and array dtypes equal the declared ones ("Type is mismatched");
- CUDA graphs: while a stream captures, every device computation runs AND is recorded (a closure writing the same
  output memory); views are not recorded. Host <-> device transfers and syncs inside capture (`cp.asarray(host)`,
  `.get()`, `.set()`, `synchronize()`, `int()`/`bool()`/`float()` of a device array, host index arrays, boolean
  mask indexing, nonzero/unique, ...)
  raise `cuda.runtime.CUDARuntimeError` (cudaErrorStreamCaptureUnsupported) and invalidate the capture (its
  end_capture raises too); device work on another stream during a capture raises cudaErrorStreamCaptureImplicit.
  `end_capture()` returns a Graph whose `launch()` replays the closures in order with the same memory and the same
  scalars, as a CUDA graph does: a value baked in from the host at capture time gives wrong results at replay.
- NCCL is absent (`cupy.cuda.nccl.available` is False), as on a machine without the library.

What it cannot check: speed (an emulated launch costs ~0.01-0.1 s: keep models tiny); the memory model (blocks
run one after another, threads switch only at barriers: a missing __syncthreads or a race can pass; an access far
outside an allocation is not caught); real NVRTC (a source g++ accepts may still fail NVRTC:
tests/test_kernels_compile.py checks that); cuBLAS numerics (matmul is NumPy's); concurrency between streams;
memory pools and allocators are no-ops (no out-of-memory); a capture runs the work eagerly too (CUDA only records
it), so results computed inside a capture are already there before the first launch.
"""

from __future__ import annotations

import contextlib
import operator
import re
import sys
import types

import numpy as np
import pytest
from numpy.lib.mixins import NDArrayOperatorsMixin

from hpcinfer.kernels import emulate

__version__ = "14.0.0+emulated"
POISON_BYTE = 0xFF          # cp.empty memory: NaN in every float dtype (and bfloat16 bits), -1 in signed ints
GUARD_BYTES = 4096          # poisoned margins around each allocation a kernel gets (see _guarded_launch)


# ------------------------------------------------------------------------------------------------ errors, state

class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError."""


class CompileException(Exception):
    """As cupy.cuda.compiler.CompileException."""

    def __init__(self, msg, source=None, name=None, options=(), backend="nvrtc"):
        super().__init__(msg)
        self.source, self.name, self.options, self.backend = source, name, options, backend


class _State:
    def __init__(self, devices: int = 1, sm_count: int = 2):
        self.devices, self.sm_count, self.device = devices, sm_count, 0
        self.stack: list = []           # streams entered with `with stream:`
        self.base = None                # stream made current with .use() (None: the null stream)
        self.capturing = None           # the stream whose capture is in progress

    def current(self):
        return self.stack[-1] if self.stack else (self.base or Stream.null)

    def device_op(self, what: str):
        """Called before device work: returns the op list to record into (or None), or raises when a capture is
        in progress on another stream (CUDA's global capture mode forbids that)."""
        capturing = self.capturing
        if capturing is None:
            return None
        if self.current() is not capturing:
            self._fail(capturing, "cudaErrorStreamCaptureImplicit", f"{what} on another stream")
        return capturing._ops

    def host_sync(self, what: str):
        """A host <-> device transfer or a host sync: not allowed while a stream captures."""
        if self.capturing is not None:
            self._fail(self.capturing, "cudaErrorStreamCaptureUnsupported", what)

    @staticmethod
    def _fail(stream, code: str, what: str):
        reason = (f"{code}: operation not permitted when stream is capturing ({what} during CUDA graph capture: "
                  "no host <-> device copy or sync may happen inside a captured region)")
        stream._invalid = stream._invalid or reason
        raise CUDARuntimeError(reason)


_state = _State()
_fake = None                # the cupy module of the latest build()


# -------------------------------------------------------------------------------------------- device arrays

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
    ops = _state.device_op(what or getattr(fn, "__name__", "operation"))
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
        _state.host_sync("ndarray.get() (device -> host copy)")
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, copy=True, order=order)

    def set(self, arr, stream=None):
        _state.host_sync("ndarray.set() (host -> device copy)")
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
        _state.host_sync("ndarray.item() (device -> host copy)")
        return self._a.item(*args)

    def tolist(self):
        _state.host_sync("ndarray.tolist() (device -> host copy)")
        return self._a.tolist()

    def _scalar(self, kind, what):
        _state.host_sync(f"{what}(device array) (device -> host copy)")
        return kind(self._a)

    def __int__(self):
        return self._scalar(int, "int")

    def __float__(self):
        return self._scalar(float, "float")

    def __bool__(self):
        return self._scalar(bool, "bool")

    def __index__(self):
        _state.host_sync("operator.index(device array) (device -> host copy)")
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
            _state.host_sync("a host index array (host -> device copy)")
        if any(isinstance(k, ndarray) and k.dtype == np.bool_ for k in (key if isinstance(key, tuple) else (key,))):
            _state.host_sync("boolean mask indexing (the selected count goes to the host)")
        return _op(operator.getitem, (self, key), strict=False, what="__getitem__")

    def __setitem__(self, key, value):
        if _has_host_data(key) or _has_host_data(value):
            _state.host_sync("a host index or value array (host -> device copy)")
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
                _state.host_sync(f"ndarray.{name}() (device -> host)")

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


# ------------------------------------------------------------------------------------------- module functions

def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype)
    _state.host_sync("cupy.asarray of host data (host -> device copy)")
    return ndarray._of(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        return _op(lambda a: np.array(a, dtype=dtype, copy=copy, order=order, ndmin=ndmin), (obj,), what="array")
    _state.host_sync("cupy.array of host data (host -> device copy)")
    return ndarray._of(np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        return asarray(np.ascontiguousarray(a, dtype=dtype))
    return _op(lambda x: np.ascontiguousarray(x, dtype=dtype), (a,), what="ascontiguousarray")


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C"):
    _state.device_op("empty")
    return ndarray._of(_empty(shape, dtype, order))


def empty_like(a, dtype=None, order="K", subok=None, shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def get_array_module(*args):
    return _fake if any(isinstance(a, ndarray) for a in args) else np


def is_available():
    return True


_SYNCING = {"nonzero", "argwhere", "flatnonzero", "unique", "compress", "extract", "array_equal", "allclose"}


def _numpy_function(name):
    fn = getattr(np, name)

    def device_function(*args, **kwargs):
        if name in _SYNCING or (name == "where" and len(args) == 1):
            _state.host_sync(f"cupy.{name} (its result size or value goes to the host)")
        return _op(fn, args, kwargs, what=f"cupy.{name}")

    device_function.__name__ = name
    return device_function


def _module_getattr(name):
    """cupy.<name> for any NumPy function (run on device arrays) or type and constant (as NumPy's)."""
    if name.startswith("__") or not hasattr(np, name):
        raise AttributeError(f"module 'cupy' (emulated) has no attribute {name!r}")
    attr = getattr(np, name)
    if isinstance(attr, types.ModuleType):           # cupy.random, cupy.linalg, ...: NumPy's would give host arrays
        raise AttributeError(f"cupy.{name} is not emulated (tests/emu_cupy.py)")
    if isinstance(attr, type) or not callable(attr):
        return attr
    return _numpy_function(name)


# ----------------------------------------------------------------------------------------------- kernels

_C_DTYPES = {"float": np.float32, "double": np.float64, "__half": np.float16, "half": np.float16,
             "__nv_bfloat16": np.uint16, "long long": np.int64, "long long int": np.int64, "int64_t": np.int64,
             "int": np.int32, "int32_t": np.int32, "unsigned": np.uint32, "unsigned int": np.uint32,
             "uint32_t": np.uint32, "unsigned long long": np.uint64, "uint64_t": np.uint64,
             "unsigned short": np.uint16, "short": np.int16, "bool": np.bool_, "char": np.int8,
             "signed char": np.int8, "unsigned char": np.uint8, "int8_t": np.int8, "uint8_t": np.uint8}


def _defines_of(options) -> dict:
    defines = {}
    for option in options:
        if option.startswith("-D"):
            key, _, value = option[2:].partition("=")
            defines[key] = value or None
    return defines


class RawModule:
    """cupy.RawModule over the CPU emulator: the given code is compiled with the -D options (others, such as -I
    and -std, are ignored)."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, log_stream=None, jitify=False):
        if code is None:
            if path is None:
                raise TypeError("RawModule needs code or path")
            with open(path) as f:
                code = f.read()
        if not isinstance(options, (tuple, list)) or not all(isinstance(o, str) for o in options):
            raise TypeError(f"RawModule options must be a tuple of str, got {options!r}")
        self.code, self.options, self.backend = code, tuple(options), backend
        self._module = None

    def compile(self, log_stream=None):
        if self._module is None:
            defines = [o for o in self.options if o.startswith("-D")]
            names = list(emulate.source_signatures(self.code))
            label = "raw-" + (names[0] if names else "module")
            try:
                self._module = emulate.build_source(self.code, options=defines, label=label)
            except RuntimeError as exc:
                raise CompileException(str(exc), self.code, label, self.options) from exc
        return self._module

    def get_function(self, name):
        module = self.compile()
        if name not in module.sigs:
            raise CUDARuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name} (kernels here: "
                                   f"{', '.join(module.sigs)})")
        return RawKernel._bound(module, name, _defines_of(self.options))


def _dims(d):
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(d) <= 3 or any(int(v) < 1 for v in d):
        raise ValueError(f"bad launch dimensions {d!r}")
    return tuple(int(v) for v in d)


class RawKernel:
    """A kernel of a RawModule: fn(grid, block, args, shared_mem=0, stream=None)."""

    def __init__(self, code, name, options=(), backend="nvrtc", **_):
        module = RawModule(code=code, options=options, backend=backend)
        self._module, self.name, self._defines = module.compile(), name, _defines_of(options)

    @classmethod
    def _bound(cls, module, name, defines):
        obj = cls.__new__(cls)
        obj._module, obj.name, obj._defines = module, name, defines
        return obj

    def _pointee(self, ctype: str):
        base = ctype.replace("const", " ").replace("*", " ").replace("__restrict__", " ")
        base = " ".join(base.split())
        if base == "storage_t":
            base = self._defines.get("T_STORAGE") or "float"
        elif base == "act_t":
            base = self._defines.get("T_ACT") or self._defines.get("T_STORAGE") or "float"
        return base, _C_DTYPES.get(base)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        params = self._module.sigs[self.name]
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{self.name}: args must be a tuple, got {type(args).__name__}")
        if len(args) != len(params):
            raise TypeError(f"{self.name} takes {len(params)} arguments ({', '.join(p for _, p in params)}), "
                            f"got {len(args)}")
        values = []
        for (ctype, pname), arg in zip(params, args):
            where = f"{self.name}: argument {pname} ({ctype})"
            if ctype.endswith("*"):
                if arg is None or (isinstance(arg, np.uint64) and arg == 0):
                    values.append(None)
                    continue
                if not isinstance(arg, ndarray):
                    raise TypeError(f"{where}: expected a device array (or None / numpy.uint64(0)), got "
                                    f"{type(arg).__name__}" + (" (a host array)" if isinstance(arg, np.ndarray)
                                                               else ""))
                base, dtype = self._pointee(ctype)
                if dtype is not None and arg.dtype != dtype:
                    raise TypeError(f"{where}: device array of {arg.dtype}, but the kernel reads {base} "
                                    f"({np.dtype(dtype).name})")
                values.append(arg._a)
            else:
                dtype = _C_DTYPES.get(" ".join(ctype.replace("const", " ").split()))
                if isinstance(arg, ndarray):
                    raise TypeError(f"{where}: a device array given for a scalar parameter")
                given = (np.int64(arg) if isinstance(arg, int) and not isinstance(arg, bool) else
                         np.float64(arg) if isinstance(arg, float) else arg)
                if not isinstance(given, np.generic):
                    raise TypeError(f"{where}: unsupported argument type {type(arg).__name__}")
                if dtype is not None and given.dtype != dtype:
                    raise TypeError(f"{where}: got {given.dtype} ({given.dtype.itemsize} bytes; a Python int goes as "
                                    f"int64, a float as float64): pass numpy.{np.dtype(dtype).name}, or the kernel "
                                    f"reads the wrong bytes on a GPU")
                values.append(given.item())
        grid, block = _dims(grid), _dims(block)
        ops = _state.device_op(f"kernel {self.name}")
        module, name = self._module, self.name

        pnames = [p for _, p in params]

        def run():
            _guarded_launch(module, name, grid, block, values, pnames)

        run()
        if ops is not None:
            ops.append(run)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _guarded_launch(module, name, grid, block, values, pnames):
    """Launch with every array argument moved, for the launch, into a copy of its whole allocation between two
    GUARD_BYTES margins of POISON_BYTE (views of one allocation keep sharing memory): a read past an allocation
    reads NaN / -1, and a write past it is reported."""
    copies, args = {}, []
    for value in values:
        if not isinstance(value, np.ndarray):
            args.append(value)
            continue
        root = _root(value)
        if value.size == 0 or not root.flags.writeable or not (root.flags.c_contiguous or root.flags.f_contiguous):
            args.append(value)
            continue
        if id(root) not in copies:
            padded = np.full(root.nbytes + 2 * GUARD_BYTES, POISON_BYTE, dtype=np.uint8)
            padded[GUARD_BYTES:GUARD_BYTES + root.nbytes] = root.reshape(-1, order="A").view(np.uint8)
            copies[id(root)] = (root, padded)
        root_, padded = copies[id(root)]
        offset = value.ctypes.data - root.ctypes.data
        args.append(np.ndarray(value.shape, value.dtype, buffer=padded, offset=GUARD_BYTES + offset,
                               strides=value.strides))
    try:
        module.launch(name, grid, block, *args)
    finally:
        for root, padded in copies.values():
            root.reshape(-1, order="A").view(np.uint8)[...] = padded[GUARD_BYTES:GUARD_BYTES + root.nbytes]
    for root, padded in copies.values():
        margins = np.concatenate([padded[:GUARD_BYTES], padded[GUARD_BYTES + root.nbytes:]])
        if (margins != POISON_BYTE).any():
            touched = [p for p, v in zip(pnames, values) if isinstance(v, np.ndarray) and _root(v) is root]
            raise RuntimeError(f"kernel {name} wrote outside the allocation of argument(s) {', '.join(touched)} "
                               f"({root.nbytes} bytes): an out-of-bounds write, which corrupts memory on a GPU")


_EW_TYPES = {"float32": "float", "float64": "double", "int64": "long long", "int32": "int", "int16": "short",
             "int8": "signed char", "uint64": "unsigned long long", "uint32": "unsigned int",
             "uint16": "unsigned short", "uint8": "unsigned char", "bool": "bool"}
_EW_PRELUDE = """
#include <cmath>
#include <cstring>
static inline float __emu_uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __emu_float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
#define __uint_as_float __emu_uint_as_float
#define __float_as_uint __emu_float_as_uint
using std::isnan;
using std::isinf;
"""


def _parse_params(text: str):
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        raw = words[0] == "raw"
        if raw:
            words = words[1:]
        if len(words) != 2 or words[0] not in _EW_TYPES or not re.match(r"^[A-Za-z_]\w*$", words[1]):
            raise NotImplementedError(f"emulated ElementwiseKernel: parameter {part!r} (only concrete dtypes "
                                      f"{', '.join(_EW_TYPES)}, optionally raw)")
        params.append((raw, np.dtype(words[0]), words[1]))
    return params


class ElementwiseKernel:
    """cupy.ElementwiseKernel with concrete parameter types, compiled for the CPU emulator: the operation runs in
    a grid-stride loop over i (one block of 32 threads), raw parameters are pointers (indexed by the caller's
    flat index), other arrays are broadcast to the loop shape and read (inputs) or bound by reference (outputs)
    at i, scalars are passed by value."""

    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True, preamble="",
                 no_return=False, return_tuple=False, loop_prep="", after_loop="", options=()):
        self.in_params, self.out_params = _parse_params(in_params), _parse_params(out_params)
        self.operation, self.name, self.preamble = operation, name, preamble
        self.no_return, self.return_tuple = no_return, return_tuple
        self.loop_prep, self.after_loop = loop_prep, after_loop
        self._compiled: dict = {}

    def _source(self, kinds) -> tuple[str, str]:
        fname = f"ew_{self.name}"
        sig, body = ["long long _n"], []
        for j, ((raw, dtype, pname), kind) in enumerate(zip(self.in_params + self.out_params, kinds)):
            ctype = _EW_TYPES[dtype.name]
            sig.append(f"{ctype}* _p{j}")
            is_out = j >= len(self.in_params)
            if raw:
                body.append(f"{ctype}* const {pname} = _p{j};")
            elif kind == "scalar":
                body.append(f"{ctype} {pname} = *_p{j};")
            elif is_out:
                body.append(f"{ctype}& {pname} = _p{j}[i];")
            else:
                body.append(f"const {ctype} {pname} = _p{j}[i];")
        inner = "\n            ".join(body)
        code = (f"{_EW_PRELUDE}\n{self.preamble}\n"
                f'extern "C" __global__ void {fname}({", ".join(sig)}) {{\n'
                f"    {self.loop_prep}\n"
                f"    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < _n;\n"
                f"         i += (long long)blockDim.x * gridDim.x) {{\n"
                f"        {{\n            {inner}\n            {self.operation};\n        }}\n    }}\n"
                f"    {self.after_loop}\n}}\n")
        return fname, code

    def __call__(self, *args, size=None, block_size=None, stream=None):
        n_in, n_out = len(self.in_params), len(self.out_params)
        if len(args) not in (n_in, n_in + n_out):
            raise TypeError(f"{self.name}: wrong number of arguments ({len(args)}; {n_in} inputs, {n_out} outputs)")
        given = list(args) + [None] * (n_in + n_out - len(args))
        params = self.in_params + self.out_params
        kinds, shapes = [], []
        for (raw, dtype, pname), arg in zip(params, given):
            if arg is None:
                kinds.append("array")
                continue
            if isinstance(arg, ndarray):
                if arg.dtype != dtype:
                    raise TypeError(f"Type is mismatched. {self.name} {dtype.name} {pname} {arg.dtype}")
                kinds.append("array")
                if not raw:
                    shapes.append(arg.shape)
            elif _is_host_array(arg):
                raise TypeError(f"{self.name}: argument {pname}: Unsupported type {type(arg)} (a host array)")
            else:
                if raw:
                    raise TypeError(f"{self.name}: raw parameter {pname} needs a device array")
                kinds.append("scalar")
        shape = np.broadcast_shapes(*shapes) if shapes else None
        if size is not None:
            n = int(size)
            if shape is not None and n != int(np.prod(shape)):
                raise ValueError(f"{self.name}: size = {n} but the arrays have {int(np.prod(shape))} elements")
        elif shape is None:
            raise ValueError(f"{self.name}: Loop size is undecided (give size= or a non-raw array)")
        else:
            n = int(np.prod(shape))
        outs = []
        for j in range(n_in, n_in + n_out):
            if given[j] is None:
                if shape is None:
                    raise ValueError(f"{self.name}: output {params[j][2]} cannot be allocated: no loop shape")
                given[j] = empty(shape, dtype=params[j][1])
            outs.append(given[j])
        key = tuple(kinds)
        if key not in self._compiled:
            fname, code = self._source(kinds)
            try:
                module = emulate.build_source(code, label=f"ew-{self.name}")
            except RuntimeError as exc:
                raise CompileException(str(exc), code, self.name) from exc
            self._compiled[key] = (module, fname)
        module, fname = self._compiled[key]
        memories = [a._a if isinstance(a, ndarray) else a for a in given]
        ops = _state.device_op(f"ElementwiseKernel {self.name}")

        def run():
            pointers, copy_back = [], []
            for j, ((raw, dtype, _), kind, mem) in enumerate(zip(params, kinds, memories)):
                if kind == "scalar":
                    pointers.append(np.array([mem], dtype=dtype))
                    continue
                view = mem if raw else np.broadcast_to(mem, shape) if j < n_in else mem
                flat = np.ascontiguousarray(view)
                if j >= n_in and flat is not mem:
                    copy_back.append((mem, flat))
                pointers.append(flat)
            if n:
                _guarded_launch(module, fname, (1,), (32,), [n, *pointers], ["_n", *(p for _, _, p in params)])
            for mem, flat in copy_back:
                mem[...] = flat

        run()
        if ops is not None:
            ops.append(run)
        if self.no_return:
            return None
        return outs[0] if n_out == 1 and not self.return_tuple else tuple(outs)


# ---------------------------------------------------------------------------------------- devices and streams

class Device:
    def __init__(self, device=None):
        self.id = _state.device if device is None else int(device)
        if not 0 <= self.id < _state.devices:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        self._previous = []

    def use(self):
        _state.device = self.id

    def __enter__(self):
        self._previous.append(_state.device)
        self.use()
        return self

    def __exit__(self, *exc):
        _state.device = self._previous.pop()

    def synchronize(self):
        _state.host_sync("Device.synchronize()")

    @property
    def attributes(self):
        return {"MultiProcessorCount": _state.sm_count, "MaxThreadsPerBlock": 1024, "WarpSize": 32,
                "MaxSharedMemoryPerBlock": 48 * 1024}

    compute_capability = property(lambda self: "90")
    pci_bus_id = property(lambda self: f"0000:{self.id + 1:02x}:00.0")
    mem_info = property(lambda self: (64 << 30, 80 << 30))

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id} (emulated)>"


class Graph:
    """A captured graph: launch() replays the recorded operations in order, on the same memory."""

    def __init__(self, ops):
        self._ops = list(ops)

    def launch(self, stream=None):
        _state.device_op("Graph.launch")
        for op in self._ops:
            op()

    def upload(self, stream=None):
        pass

    def __len__(self):
        return len(self._ops)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        _state.host_sync("Event.synchronize()")

    done = property(lambda self: True)


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.is_null, self.non_blocking = null, non_blocking
        self._ops, self._invalid = None, None

    ptr = property(lambda self: 0 if self.is_null else id(self))

    def __enter__(self):
        _state.stack.append(self)
        return self

    def __exit__(self, *exc):
        _state.stack.pop()

    def use(self):
        _state.base = self
        return self

    def begin_capture(self, mode=None):
        if self.is_null:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: the legacy null stream cannot be captured")
        if _state.capturing is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: a stream capture is already in progress")
        _state.capturing, self._ops, self._invalid = self, [], None

    def end_capture(self):
        if _state.capturing is not self:
            raise CUDARuntimeError("cudaErrorIllegalState: this stream is not capturing")
        _state.capturing = None
        ops, self._ops = self._ops, None
        if self._invalid:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureInvalidated: the capture was invalidated by an earlier "
                                   f"error ({self._invalid})")
        return Graph(ops)

    def is_capturing(self):
        return _state.capturing is self

    def synchronize(self):
        _state.host_sync("Stream.synchronize()")

    def record(self, event=None):
        return event or Event()

    def wait_event(self, event):
        pass

    def launch_host_func(self, callback, arg):
        _state.host_sync("Stream.launch_host_func")
        callback(arg)

    def __repr__(self):
        return f"<Stream {self.ptr} (emulated)>"


Stream.null = Stream(null=True)


def get_current_stream(device_id=None):
    return _state.current()


class _Memory:
    def __init__(self, nbytes):
        self.size, self._buf = nbytes, np.empty(max(int(nbytes), 1), dtype=np.uint8)
        self.ptr = self._buf.ctypes.data


class MemoryPool:
    def __init__(self, allocator=None):
        self._used = 0

    def malloc(self, nbytes):
        self._used += int(nbytes)
        return _Memory(nbytes)

    def used_bytes(self):
        return self._used

    def total_bytes(self):
        return self._used

    def free_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def n_free_blocks(self):
        return 0

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0


class PinnedMemoryPool(MemoryPool):
    pass


_default_pool, _pinned_pool = MemoryPool(), PinnedMemoryPool()


@contextlib.contextmanager
def using_allocator(allocator=None):
    yield


def _runtime_module():
    m = types.ModuleType("cupy.cuda.runtime")
    m.CUDARuntimeError = CUDARuntimeError
    m.getDeviceCount = lambda: _state.devices
    m.getDevice = lambda: _state.device
    m.setDevice = lambda i: Device(i).use()
    m.deviceSynchronize = lambda: _state.host_sync("cudaDeviceSynchronize")
    m.memGetInfo = lambda: (64 << 30, 80 << 30)
    m.runtimeGetVersion = lambda: 12080
    m.driverGetVersion = lambda: 12080
    m.is_hip = False
    m.getDeviceProperties = lambda i: {"name": b"Emulated CUDA device (CPU)", "totalGlobalMem": 80 << 30,
                                       "multiProcessorCount": _state.sm_count, "major": 9, "minor": 0}
    return m


# ------------------------------------------------------------------------------------------------ the module

def _scatter_add(a, slices, value):
    if _has_host_data(slices):
        _state.host_sync("cupyx.scatter_add with a host index array (host -> device copy)")
    _op(np.add.at, (a, slices, value), strict=False, what="cupyx.scatter_add")


def build(devices: int = 1, sm_count: int = 2) -> dict[str, types.ModuleType]:
    """A fresh fake cupy: {module name: module} for sys.modules (state reset: no capture, device 0)."""
    global _state
    _state = _State(devices, sm_count)
    Stream.null._ops = Stream.null._invalid = None

    cp = types.ModuleType("cupy")
    cp.__doc__ = "CuPy stand-in over NumPy and the CPU kernel emulator (tests/emu_cupy.py)"
    cp.__version__ = __version__
    cp.__path__ = []                       # a package: `import cupy.cuda` finds the fake submodules in sys.modules
    for name in ("ndarray", "asarray", "array", "ascontiguousarray", "asnumpy", "empty", "empty_like",
                 "get_array_module", "is_available", "RawModule", "RawKernel", "ElementwiseKernel"):
        setattr(cp, name, globals()[name])
    cp.asanyarray = asarray
    cp.get_default_memory_pool = lambda: _default_pool
    cp.get_default_pinned_memory_pool = lambda: _pinned_pool
    cp.__getattr__ = _module_getattr
    cp._emulated = True

    cuda = types.ModuleType("cupy.cuda")
    cuda.__path__ = []
    runtime = _runtime_module()
    compiler = types.ModuleType("cupy.cuda.compiler")
    compiler.CompileException = CompileException
    nvrtc = types.ModuleType("cupy.cuda.nvrtc")
    nvrtc.getVersion = lambda: (12, 8)
    nccl = types.ModuleType("cupy.cuda.nccl")   # as cupy without the NCCL library: imports, not available
    nccl.available = False
    graph = types.ModuleType("cupy.cuda.graph")
    graph.Graph = Graph
    for name, value in dict(runtime=runtime, compiler=compiler, nvrtc=nvrtc, nccl=nccl, graph=graph,
                            Device=Device, Stream=Stream, Event=Event, Graph=Graph, MemoryPool=MemoryPool,
                            PinnedMemoryPool=PinnedMemoryPool, using_allocator=using_allocator,
                            get_current_stream=get_current_stream, is_available=is_available,
                            set_allocator=lambda allocator=None: None,
                            set_pinned_memory_allocator=lambda allocator=None: None).items():
        setattr(cuda, name, value)
    cp.cuda = cuda
    cp.RawModule, cp.RawKernel = RawModule, RawKernel

    cupyx = types.ModuleType("cupyx")
    cupyx.scatter_add = _scatter_add
    global _fake
    _fake = cp
    return {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.compiler": compiler,
            "cupy.cuda.nvrtc": nvrtc, "cupy.cuda.nccl": nccl, "cupy.cuda.graph": graph, "cupyx": cupyx}


def install(monkeypatch, devices: int = 1, sm_count: int = 2) -> types.ModuleType:
    """Put a fresh fake cupy in sys.modules (hiding any real cupy module and submodule) and point
    hpcinfer.backend.cupy_ops at it, for the life of `monkeypatch`; the kernel loader's caches are cleared.
    Returns the fake cupy module."""
    from hpcinfer.backend import cupy_ops
    from hpcinfer.kernels import loader

    reason = emulate.unavailable()
    if reason:
        pytest.skip(f"the CuPy emulator runs kernels on the CPU emulator, which is unavailable: {reason}")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "_state", _state)     # no change now: restored as they are when monkeypatch undoes
    monkeypatch.setattr(this, "_fake", _fake)       # (an install nested in another one gives the outer one back)
    modules = build(devices, sm_count)
    for name in [n for n in sys.modules if n.split(".")[0] in ("cupy", "cupyx", "cupy_backends")]:
        monkeypatch.delitem(sys.modules, name)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    cp = modules["cupy"]
    monkeypatch.setattr(cupy_ops, "_import_cupy", lambda: cp)
    monkeypatch.setattr(cupy_ops, "gpu_available", lambda: True)
    loader.clear_cache()
    monkeypatch.setattr(loader, "_modules", {})       # kernels loaded on the fake stay with it
    monkeypatch.setattr(loader, "_kernels", {})
    return cp


@contextlib.contextmanager
def installed(devices: int = 1, sm_count: int = 2):
    """install() for any scope (module and session fixtures, plain code): yields the fake cupy module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield install(monkeypatch, devices, sm_count)


def pytest_configure(config):
    """As a plugin (`PYTHONPATH=tests python -m pytest -p emu_cupy tests/test_x.py`): the whole session runs on
    the fake cupy, installed before collection, so GPU-only test modules (whose skip checks call gpu_available at
    import) run here. Not a plugin otherwise: importing this module registers only the fixture."""
    monkeypatch = pytest.MonkeyPatch()
    config._emu_cupy_monkeypatch = monkeypatch
    reason = emulate.unavailable()
    if reason:
        raise pytest.UsageError(f"-p emu_cupy: the kernel emulator is unavailable: {reason}")
    install(monkeypatch)


def pytest_unconfigure(config):
    monkeypatch = getattr(config, "_emu_cupy_monkeypatch", None)
    if monkeypatch is not None:
        monkeypatch.undo()

