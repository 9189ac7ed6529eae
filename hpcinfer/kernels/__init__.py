"""CUDA kernels: cuda_src/*.cu compiled through NVRTC (cupy.RawModule), cached per device and #defines, plus the
GPU-free compile checks and the weight layouts the kernels read. Importing this package does not import cupy."""

from .layout import sbi_pack, sbi_unpack, sbi_vec
from .loader import (C_TYPES, CUDA_SRC, KERNELS, KernelCompileError, compile_check, kernel, kernel_source,
                     load_module, nvcc_check, nvrtc_compile)

__all__ = ["C_TYPES", "CUDA_SRC", "KERNELS", "KernelCompileError", "compile_check", "kernel", "kernel_source",
           "load_module", "nvcc_check", "nvrtc_compile", "sbi_pack", "sbi_unpack", "sbi_vec"]
