"""hpcinfer: MPI-launched SPMD transformer inference (a NumPy reference backend; a CuPy one with CUDA kernels)."""

import os

__version__ = "0.1.0"

# OpenBLAS's idle worker threads spin for about 2^28 cycles after each threaded call before they sleep; the NumPy
# backend's decode attention runs its own threads between those calls (backend/numpy_decode.py), and a spinning
# worker takes the core they need (measured on 2 cores, 30 layers of 8 x 400 positions: attention 17.4 ms spinning,
# 10.2 ms not; 8-token projections 22.6 and 23.2 ms). Read once when OpenBLAS loads, so set before numpy is imported;
# a value the user exported wins (docs/config.md, [runtime] threads).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# Numba's parallel kernels (backend/cpu_kernels, `[runtime] cpu_kernels`) run on its OpenMP pool, whose idle workers
# spin between kernels (libgomp's default) and take the cores the next kernel, BLAS or another rank needs (measured
# on a shared 2-core AMD EPYC, load average 12-16: the 120 projections of SmolLM2's layers at 1 token on 2 threads
# 5.9 s spinning, 0.22 s passive; 0.79 s on one thread). Read when libgomp loads, so set here; a value the user
# exported wins. (torch's own libgomp reads it too: the transformers baselines run with it.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
