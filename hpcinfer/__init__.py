"""hpcinfer: MPI-launched SPMD transformer inference (a NumPy reference backend; a CuPy one with CUDA kernels)."""

__version__ = "0.1.0"
