"""hpcinfer: MPI-launched SPMD transformer inference (NumPy reference backend, CUDA later)."""

__version__ = "0.1.0"
