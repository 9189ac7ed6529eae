"""A minimal stand-in for CupyOps over NumPy arrays, for testing a backend wrapper module (backend/cupy_*.py)
without the fake cupy: `xp` is numpy and `_kernel` launches the cuda_src/ kernel on the CPU emulator (or gives
None with kernels=False: the wrapper's plain-array path). Subclass it with what else the wrapper asks of its ops.
The fake cupy (tests/helpers/emu_cupy/) runs the real CupyOps instead; this is the lighter tool for one module."""

from __future__ import annotations

import numpy as np

import kernel_emulator as emulate


class EmulatedKernelOps:
    xp = np

    def __init__(self, kernels: bool = True):
        self.kernels = kernels
        self.launched = []                  # names of the kernel functions launched, in order
        self.library_calls = 0              # as CupyOps: matmuls (cuBLAS on a GPU)

    def matmul(self, a, b):
        self.library_calls += 1
        return np.matmul(a, b)

    def _kernel(self, name, function, **defines):
        if not self.kernels:
            return None
        module = emulate.build(name, {"T_STORAGE": "float", "T_ACT": "float", **defines})

        def launch(grid, block, args):
            self.launched.append(function)
            module.launch(function, grid, block, *args)
        return launch
