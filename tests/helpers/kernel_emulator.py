"""Run the kernels of cuda_src/ on the CPU, on NumPy arrays, to check their logic against the NumPy ops with no GPU.

Test-only (it does not ship in the package): the kernel tests, tests/helpers/emu_cupy/ and emu_ops.py import it by
name, tests/helpers/ being on sys.path (tests/conftest.py). `build(name, defines)` compiles cuda_src/{name}.cu with
g++ and cuda_emu.h (beside this file) forced in (blocks run in turn, one fiber per CUDA thread, barriers for
__syncthreads and warp shuffles) into a shared library, cached under build/kernel-emu/ by a hash of the sources,
defines and flags; `module.launch(function, grid, block, *args)` runs one kernel. cuda_emu.h (with cuda_fp16.h,
most of a build's time) is precompiled once per checkout (`precompiled_header`): a build then takes 0.6 s instead
of 1.5 s, which matters on a fresh clone, where `make test` builds about 360 of them. Arguments follow the kernel's C
signature, read from the source: NumPy arrays (or None, a null pointer) for pointers, Python numbers for scalars.
`build_source(code, defines)` does the same for a source text (what tests/helpers/emu_cupy/, a CPU stand-in for
cupy, gets from cupy.RawModule and ElementwiseKernel).

This checks indexing, reductions, masking, tails and the epilogues; it says nothing about speed, and it is no
memory-model checker (a missing __syncthreads can pass here): the GPU parity tests and compute-sanitizer are the
judges. Needs g++ (C++20) and CUDA toolkit headers (cuda_fp16.h with crt/host_defines.h, as nvcc has).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from hpcinfer.kernels.loader import CUDA_SRC, define_options

EMU_HEADER = Path(__file__).resolve().parent / "cuda_emu.h"
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "kernel-emu"       # the checkout's build/
CODE_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-w",
              "-ffp-contract=off",                     # no fused multiply-add: float results as IEEE operation by operation
              "-fno-gnu-unique", "-fvisibility=hidden")  # each library keeps its own static (shared-memory) variables
FLAGS = (*CODE_FLAGS, "-shared")                  # a library; the precompiled header takes CODE_FLAGS alone (as gcc
                                                  # requires: the same code-generation options as the build using it)

_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
_SCALARS = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "long long": ctypes.c_longlong, "float": ctypes.c_float}
_lock = threading.Lock()


def toolkit_include() -> Path | None:
    """A CUDA toolkit include directory whose cuda_fp16.h compiles as host C++ (nvcc's own, or /usr/local/cuda)."""
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for path in candidates:
        if (path / "cuda_fp16.h").is_file() and (path / "crt" / "host_defines.h").is_file():
            return path
    return None


def unavailable() -> str | None:
    """Why kernels cannot be emulated here (None when they can)."""
    if shutil.which("g++") is None:
        return "g++ is not on the PATH"
    if toolkit_include() is None:
        return "no CUDA toolkit headers (cuda_fp16.h with crt/host_defines.h) next to nvcc or in /usr/local/cuda"
    return None


def signatures(name: str) -> dict[str, list[tuple[str, str]]]:
    """{kernel: [(C type, parameter name), ...]} of the extern "C" kernels of cuda_src/{name}.cu."""
    return source_signatures((CUDA_SRC / f"{name}.cu").read_text())


def source_signatures(text: str) -> dict[str, list[tuple[str, str]]]:
    """{kernel: [(C type, parameter name), ...]} of the extern "C" kernels of a CUDA source text."""
    found = {}
    for function, params in _SIGNATURE.findall(text):
        typed = []
        for param in params.split(","):
            match = re.match(r"(.*?)(\w+)$", " ".join(param.split()))
            typed.append((match.group(1).strip(), match.group(2)))
        found[function] = typed
    return found


def _launchers(sigs) -> str:
    """A C entry point per kernel: emu_launch_<kernel>(grid, block, void** args) unpacks the arguments by type."""
    code = []
    for function, params in sigs.items():
        unpack = "\n".join(f"    {t} p{i} = *({t}*)a[{i}];" for i, (t, _) in enumerate(params))
        call = ", ".join(f"p{i}" for i in range(len(params)))
        code.append(
            f'extern "C" __attribute__((visibility("default"))) int emu_launch_{function}(\n'
            f"        unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, void** a) {{\n"
            f"{unpack}\n"
            f"    return emu::launch(dim3(gx, gy, gz), dim3(bx, by, bz), [=] {{ {function}({call}); }});\n}}\n")
    return "\n".join(code)


class EmulatedModule:
    def __init__(self, library: ctypes.CDLL, sigs, path: Path):
        self.library, self.sigs, self.path = library, sigs, path

    def set_block_order(self, seed: int) -> None:
        """Run this library's later launches with their blocks in an order drawn from `seed` (0: x fastest, then y,
        then z, the default): a kernel whose result must not depend on which block finishes last is run in several
        (cuda_emu.h, emu_set_block_order)."""
        with _lock:
            self.library.emu_set_block_order(ctypes.c_uint(seed))

    def launch(self, function: str, grid, block, *args) -> None:
        params = self.sigs[function]
        if len(args) != len(params):
            raise TypeError(f"{function} takes {len(params)} arguments ({', '.join(p for _, p in params)}), "
                            f"got {len(args)}")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        values = []
        slots = (ctypes.c_void_p * len(args))()
        for i, ((ctype, pname), arg) in enumerate(zip(params, args)):
            if ctype.endswith("*"):
                if isinstance(arg, np.uint64) and arg == 0:              # a null pointer, as a RawKernel takes it
                    arg = None
                if arg is not None and not isinstance(arg, np.ndarray):
                    raise TypeError(f"{function}: argument {pname} ({ctype}) must be a NumPy array, None or "
                                    f"numpy.uint64(0)")
                value = ctypes.c_void_p(None if arg is None else arg.ctypes.data)
            else:
                value = _SCALARS[ctype](arg)
            values.append(value)
            slots[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
        with _lock:   # the emulator's state is per library, and a launch is not reentrant
            status = getattr(self.library, f"emu_launch_{function}")(*(ctypes.c_uint(v) for v in grid + block), slots)
        if status == 1:
            raise ValueError(f"{function}: block {block} is not a whole number of warps")
        if status == 2:
            raise RuntimeError(f"{function}: deadlock (a __syncthreads or shuffle not reached by every thread)")
        if status == 3:
            fault = self.library.emu_fault
            fault.restype = ctypes.c_char_p
            raise RuntimeError(f"{function}: {fault().decode()}")


_modules: dict = {}


def build(name: str, defines: dict | None = None) -> EmulatedModule:
    """cuda_src/{name}.cu with `defines`, compiled for the CPU emulator (cached on disk and in this process)."""
    sources = [CUDA_SRC / f"{name}.cu", EMU_HEADER, *sorted(CUDA_SRC.glob("*.cuh"))]
    return _build(name, f'#include "{name}.cu"\n', signatures(name), define_options(defines),
                  [p.read_text() for p in sources])


def build_source(code: str, defines: dict | None = None, label: str = "source",
                 options: list[str] | tuple[str, ...] = ()) -> EmulatedModule:
    """A CUDA source text (local includes inlined, as loader.kernel_source gives it, or self-contained) compiled
    for the CPU emulator with `defines` and extra -D `options` (cached like build). tests/helpers/emu_cupy/ compiles
    what cupy.RawModule and cupy.ElementwiseKernel are given through this."""
    options = [*define_options(defines), *options]
    bad = [o for o in options if not o.startswith("-D")]
    if bad:
        raise ValueError(f"build_source: only -D options, got {bad}")
    return _build(label, code + "\n", source_signatures(code), options,
                  [EMU_HEADER.read_text(), *(p.read_text() for p in sorted(CUDA_SRC.glob("*.cuh")))])


@functools.cache
def precompiled_header() -> Path:
    """cuda_emu.h as `-include` should name it: a copy beside its precompiled form (gcc takes X.gch for an
    `-include X` found beside it, and falls back to X itself, with a -Winvalid-pch warning, where the .gch does not
    fit), under build/kernel-emu/ by a hash of the header and the flags; built once, by whichever process first
    needs it (the files appear whole, by rename: a process building at the same time wastes only its time)."""
    text = EMU_HEADER.read_text()
    digest = hashlib.sha256("\0".join([text, *CODE_FLAGS, str(toolkit_include())]).encode()).hexdigest()[:20]
    folder = BUILD_DIR / f"pch-{digest}"
    header, compiled = folder / EMU_HEADER.name, folder / f"{EMU_HEADER.name}.gch"
    if compiled.exists():
        return header
    folder.mkdir(parents=True, exist_ok=True)
    unique = f"{os.getpid()}.{threading.get_ident()}"
    staged = folder / f"{EMU_HEADER.name}.{unique}.tmp"
    staged.write_text(text)
    staged.replace(header)
    tmp = folder / f"{compiled.name}.{unique}.tmp"
    cmd = ["g++", *CODE_FLAGS, f"-I{toolkit_include()}", "-x", "c++-header", str(header), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"precompiling {EMU_HEADER.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-8000:]}")
    tmp.replace(compiled)
    return header


def _build(label: str, prelude: str, sigs, options: list[str], source_texts: list[str]) -> EmulatedModule:
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot emulate kernels: {reason}")
    code = f"{prelude}\n{_launchers(sigs)}"
    digest = hashlib.sha256("\0".join([code, *options, *FLAGS, *source_texts]).encode())
    key = f"{label}-{digest.hexdigest()[:20]}"
    module = _modules.get(key)
    if module is not None:
        return module
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    library = BUILD_DIR / f"{key}.so"
    if not library.exists():
        # Files of this process and thread alone: MPI ranks building the same key at once (thread ids repeat
        # across processes) must not write one file while another's g++ reads it.
        unique = f"{os.getpid()}.{threading.get_ident()}"
        cpp = BUILD_DIR / f"{key}.{unique}.cpp"
        cpp.write_text(code)
        tmp = library.with_suffix(f".{unique}.tmp")
        cmd = ["g++", *FLAGS, f"-I{toolkit_include()}", f"-I{CUDA_SRC}", "-include", str(precompiled_header()),
               "-Winvalid-pch", *options, str(cpp), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"emulator build of {label} failed:\n{' '.join(cmd)}\n{proc.stderr[-8000:]}")
        tmp.replace(library)   # atomic: a concurrent build of the same key is harmless
        cpp.replace(BUILD_DIR / f"{key}.cpp")      # the source kept beside it, to read
    module = EmulatedModule(ctypes.CDLL(str(library)), sigs, library)
    _modules[key] = module
    return module
