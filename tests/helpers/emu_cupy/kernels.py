"""Kernels of the fake cupy (tests/helpers/emu_cupy/): RawModule / RawKernel compile the given CUDA source with its -D
options for the CPU emulator (tests/helpers/kernel_emulator.py) and check every launch's arguments; ElementwiseKernel
turns its snippet into a grid-stride kernel compiled the same way. Launches run between poisoned guard margins."""

from __future__ import annotations

import re

import numpy as np

import kernel_emulator as emulate

from . import state
from .arrays import _is_host_array, ndarray
from .functions import empty
from .state import GUARD_BYTES, POISON_BYTE, CompileException, CUDARuntimeError


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
        ops = state._state.device_work(f"kernel {self.name}", stream)
        module, name = self._module, self.name
        touched = [v for v in values if isinstance(v, np.ndarray)]
        state._state.check_pending(touched, f"kernel {self.name}")

        pnames = [p for _, p in params]

        def run():
            _guarded_launch(module, name, grid, block, values, pnames)

        run()
        if ops is not None:
            run.touched = touched
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
        ops = state._state.device_work(f"ElementwiseKernel {self.name}", stream)
        touched = [m for m in memories if isinstance(m, np.ndarray)]
        state._state.check_pending(touched, f"ElementwiseKernel {self.name}")

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
            run.touched = touched
            ops.append(run)
        if self.no_return:
            return None
        return outs[0] if n_out == 1 and not self.return_tuple else tuple(outs)
