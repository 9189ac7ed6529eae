"""Compile and cache the CUDA kernels of cuda_src/ (see cuda_src/README.md for every kernel's interface).

- `load_module(name, defines, device)` -> cupy.RawModule of cuda_src/{name}.cu compiled with NVRTC (what
  RawModule uses), once per (device, name, defines); `kernel(name, function, defines)` -> its RawKernel.
- `compile_check(name, defines, arch)` compiles the same source through cupy's low-level NVRTC bindings with no
  GPU (CI); `nvcc_check(path, arch)` does the same with nvcc when it is on the PATH.

The source handed to NVRTC is the .cu file with its local `#include "x.cuh"` lines replaced by the headers' text,
so that CuPy's on-disk kernel cache, keyed on the source text and options, sees an edit to a header too. cupy is
imported lazily: this module imports without it.

Where the sources are (CUDA_SRC): setup.cfg ships the repository's top-level cuda_src/ as package data of
`hpcinfer.cuda_src` (package_dir), so an installed wheel holds them in hpcinfer/cuda_src/, inside this package; a
source checkout (`pip install -e .`, or PYTHONPATH set to it) keeps them where they are, in the checkout's cuda_src/
beside hpcinfer/. A kernel file that is missing is a KernelSourceError and one that does not compile a
KernelCompileError, both naming the file: the CuPy backend never falls back to plain CuPy for a missing kernel.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..errors import HpcinferError

STD = "-std=c++17"

# Every kernel file and the extern "C" functions it defines: the interface the wrappers launch (and the compile
# check verifies that each of these names is in the compiled code).
KERNELS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("rms_norm",),
    "layer_norm": ("layer_norm",),
    "activation": ("activation", "gated_activation"),
    "embedding": ("embedding",),
    "rotary": ("rotary",),
    "kv_append": ("kv_append",),
    "decode_attention": ("decode_attention",),
    "decode_attention_quant": ("decode_attention_quant",),
    "paged_attention": ("paged_kv_append", "paged_decode_attention"),
    "kv_quant": ("kv_quantize_append", "kv_dequantize_rows"),
    "prefill_attention": ("prefill_attention",),
    "sbi_gemv": ("sbi_gemv", "sbi_gemv_reduce"),
    "fused_norm_gemv": ("fused_norm_gemv", "fused_norm_gemv_reduce"),
    "quant_gemv": ("quant_gemv", "quant_gemv_reduce"),
    "tc_gemm": ("tc_gemm", "tc_gemm_reduce"),
    "tc_quant_gemm": ("tc_quant_gemm", "tc_quant_gemm_reduce"),
    "quant_dequant": ("quant_dequant",),
    "moe_gating": ("moe_topk_gating", "moe_route", "moe_gate_dispatch", "moe_permute", "moe_unpermute"),
}

# numpy dtype name -> the C type for T_STORAGE / T_ACT
C_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class KernelSourceError(HpcinferError):
    """A kernel source (.cu) or a header it includes is missing; the message names the file."""


class KernelCompileError(HpcinferError, RuntimeError):
    """A kernel source failed to compile; the message names the file and holds the compiler log."""


# ---- where the sources are -------------------------------------------------------------------------------------
_PACKAGE = Path(__file__).resolve().parent.parent          # hpcinfer/


def _cuda_src_dir() -> Path:
    """The kernel folder: hpcinfer/cuda_src/ of an installed package (the package data setup.cfg ships), else the
    cuda_src/ beside the package in the source checkout it runs from (the folder setup.cfg maps to
    hpcinfer.cuda_src; setup.cfg beside it says that this is the checkout). Neither there: the installed place,
    which source_path then names in its error."""
    installed = _PACKAGE / "cuda_src"
    checkout = _PACKAGE.parent / "cuda_src"
    if not installed.is_dir() and checkout.is_dir() and (_PACKAGE.parent / "setup.cfg").is_file():
        return checkout
    return installed


CUDA_SRC = _cuda_src_dir()   # tests may point it elsewhere (then clear_cache()): every lookup reads it at call time


# ---- source and options ----------------------------------------------------------------------------------------
def source_path(name: str) -> Path:
    """CUDA_SRC/{name}.cu; KernelSourceError naming the path when it is not there."""
    path = CUDA_SRC / f"{name}.cu"
    if not path.is_file():
        raise KernelSourceError(
            f"kernel source {path} not found (kernel files: {', '.join(sorted(KERNELS))}): the CuPy backend needs "
            f"every file of cuda_src/, which an installed hpcinfer holds in hpcinfer/cuda_src/ and a source checkout "
            f"in its cuda_src/; reinstall hpcinfer (pip install . or a wheel from `pip wheel .`), or build the ops "
            f"with CupyOps(kernels=False) to run plain CuPy code without the kernels")
    return path


def kernel_source(name: str) -> str:
    """cuda_src/{name}.cu with its quoted local includes inlined (each header once)."""
    return _inline(source_path(name), set())


def _inline(path: Path, seen: set) -> str:
    def include(match: re.Match) -> str:
        header = (path.parent / match.group(1)).resolve()
        if not header.is_file():
            raise KernelSourceError(f"{path}: #include \"{match.group(1)}\" not found ({header} is missing): "
                                    f"reinstall hpcinfer, or use CupyOps(kernels=False)")
        if header in seen:
            return f"// (already included: {match.group(1)})"
        seen.add(header)
        return f"// ---- begin {match.group(1)}\n{_inline(header, seen)}\n// ---- end {match.group(1)}"

    return _INCLUDE.sub(include, path.read_text())


def define_options(defines: dict | None) -> list[str]:
    """{"T_STORAGE": "__half", "HAS_BIAS": True, "DEBUG": None} -> ["-DT_STORAGE=__half", "-DHAS_BIAS=1", "-DDEBUG"],
    sorted by name (so that equal dicts give equal options, hence one cache entry)."""
    options = []
    for key in sorted(defines or {}):
        if not _NAME.match(key):
            raise ValueError(f"bad #define name {key!r}")
        value = defines[key]
        if value is None:
            options.append(f"-D{key}")
        else:
            if isinstance(value, bool):
                value = int(value)
            text = str(value)
            if not text or any(ch.isspace() for ch in text):
                raise ValueError(f"#define {key}: value {text!r} must be non-empty with no spaces")
            options.append(f"-D{key}={text}")
    return options


def _define_key(defines: dict | None) -> tuple:
    return tuple(define_options(defines))


def _cudart_version(include_dir: Path) -> int | None:
    header = include_dir / "cuda_runtime_api.h"
    try:
        match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _header_candidates() -> list[Path]:
    """Directories that may hold cuda_fp16.h and the runtime headers it includes, best first: the pip wheels
    (nvidia-cuda-runtime-cu12 / cu13, found as cupy finds them), then cupy's CUDA path, then /usr/local/cuda."""
    found = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory   # what cupy >= 14 itself uses

        path = find_nvidia_header_directory("cudart")
        if path:
            found.append(Path(path))
    except Exception:   # noqa: BLE001 - an absent or older pathfinder: fall through to the other places
        pass
    try:
        import nvidia

        for base in nvidia.__path__:
            found += [Path(base) / "cuda_runtime" / "include", Path(base) / "cu13" / "include",
                      Path(base) / "cu12" / "include"]
    except ImportError:
        pass
    try:
        from cupy.cuda import get_cuda_path

        if get_cuda_path():
            found.append(Path(get_cuda_path()) / "include")
    except Exception:   # noqa: BLE001
        pass
    found.append(Path("/usr/local/cuda/include"))
    return [p for p in dict.fromkeys(found) if (p / "cuda_fp16.h").is_file()]


@functools.lru_cache(maxsize=None)
def cuda_include_dirs(nvrtc_major: int) -> tuple[str, ...]:
    """The -I directory for cuda_fp16.h / cuda_bf16.h whose runtime headers match NVRTC's major version (headers
    of another major version do not compile under it). Empty when none is found: NVRTC then reports the missing
    header in its log."""
    for path in _header_candidates():
        version = _cudart_version(path)
        if version is not None and version // 1000 == nvrtc_major:
            return (str(path),)
    return ()


def _nvrtc():
    from cupy.cuda import nvrtc      # cupy_backends' bindings; loads libnvrtc (from the wheel) on first use

    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def nvrtc_options(defines: dict | None) -> list[str]:
    """Options as load_module passes them to RawModule (RawModule adds -arch itself)."""
    major = nvrtc_version()[0]
    return [STD, *define_options(defines), *(f"-I{d}" for d in cuda_include_dirs(major))]


def _arch_option(arch: str) -> str:
    """'sm_90' / 'compute_80' / '90' -> '-arch=sm_90' / '-arch=compute_80' / '-arch=sm_90'."""
    arch = arch.strip()
    if arch.isdigit():
        arch = f"sm_{arch}"
    if not re.match(r"^(sm|compute)_\d+[a-z]?$", arch):
        raise ValueError(f"arch {arch!r}: expected sm_XY, compute_XY or XY")
    return f"-arch={arch}"


# ---- GPU-free checks -------------------------------------------------------------------------------------------
def nvrtc_compile(name: str, defines: dict | None, arch: str) -> tuple[bytes, str]:
    """Compile cuda_src/{name}.cu with NVRTC for `arch` (no GPU needed) -> (PTX or cubin bytes, compiler log).
    The options mirror RawModule's: those of nvrtc_options, plus -arch, --device-as-default-execution-space and
    -ftz=true which cupy adds. Raises KernelCompileError with the log."""
    nvrtc = _nvrtc()
    arch_option = _arch_option(arch)
    options = [*nvrtc_options(defines), arch_option, "--device-as-default-execution-space", "-ftz=true"]
    prog = nvrtc.createProgram(kernel_source(name), f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"NVRTC {'.'.join(map(str, nvrtc_version()))} failed on {source_path(name)} "
                                     f"({' '.join(options)}): {exc}\n{log}") from None
        log = nvrtc.getProgramLog(prog)
        binary = nvrtc.getCUBIN(prog) if arch_option.startswith("-arch=sm_") else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(binary, str):
        binary = binary.encode()
    return binary, log


def compile_check(name: str, defines: dict | None, arch: str) -> None:
    """Compile cuda_src/{name}.cu with NVRTC for `arch` (sm_80, compute_90, ...) and check that every kernel of
    KERNELS[name] is in the result. Needs cupy and the NVRTC wheel, no GPU. Raises KernelCompileError."""
    binary, log = nvrtc_compile(name, defines, arch)
    missing = [k for k in KERNELS.get(name, ()) if k.encode() not in binary]
    if missing:
        raise KernelCompileError(f"{name}.cu compiled but lacks kernel(s) {', '.join(missing)}\n{log}")


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def nvcc_check(path, arch: str, defines: dict | None = None) -> None:
    """nvcc -cubin of one .cu file for `arch` (sm_80, sm_90), with -I cuda_src for its headers. Raises
    FileNotFoundError when nvcc is not on the PATH, KernelCompileError with nvcc's output on failure."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on the PATH")
    path = Path(path)
    arch = arch if not arch.isdigit() else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", f"-arch={arch}", STD, f"-I{path.parent}", *define_options(defines),
               "-o", os.path.join(tmp, "out.cubin"), str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelCompileError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")


# ---- loading on a GPU ------------------------------------------------------------------------------------------
_modules: dict = {}
_lock = threading.Lock()


def load_module(name: str, defines: dict | None = None, device: int | None = None):
    """cupy.RawModule of cuda_src/{name}.cu with `defines`, compiled (NVRTC) and loaded on `device` (default: the
    current one) once per (device, name, defines) in this process; CuPy's disk cache makes later processes fast."""
    import cupy

    if device is None:
        device = cupy.cuda.Device().id
    key = (device, name, _define_key(defines))
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                with cupy.cuda.Device(device):
                    module = cupy.RawModule(code=kernel_source(name), options=tuple(nvrtc_options(defines)),
                                            backend="nvrtc")
                    try:
                        module.compile()
                    except cupy.cuda.compiler.CompileException as exc:
                        raise KernelCompileError(f"{source_path(name)} does not compile (NVRTC) with "
                                                 f"{define_options(defines)}: {exc}") from exc
                _modules[key] = module
    return module


_kernels: dict = {}


def kernel(name: str, function: str, defines: dict | None = None, device: int | None = None):
    """The RawKernel `function` of cuda_src/{name}.cu compiled with `defines` (see load_module)."""
    import cupy

    if device is None:
        device = cupy.cuda.Device().id
    key = (device, name, function, _define_key(defines))
    fn = _kernels.get(key)
    if fn is None:
        with cupy.cuda.Device(device):
            fn = load_module(name, defines, device).get_function(function)
        _kernels[key] = fn
    return fn


def clear_cache() -> None:
    """Forget the loaded modules of this process (tests; CuPy's disk cache stays)."""
    with _lock:
        _modules.clear()
        _kernels.clear()
