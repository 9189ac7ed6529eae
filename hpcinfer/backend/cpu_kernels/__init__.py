"""Compiled CPU kernels for the NumPy backend (Numba): the CPU twins of cuda_src/'s fusions.

`[runtime] cpu_kernels` chooses them: numba (compiled kernels where they exist), numpy (NumPy/BLAS only: the
reference), auto (numba wherever it imports). NumPy stays the spec; every kernel here is tested against it.
"""

from __future__ import annotations

from ...errors import ConfigError

CHOICES = ("auto", "numba", "numpy")

try:
    import numba  # noqa: F401
    NUMBA_ERROR = None
except ImportError as exc:          # numba is a dependency; a broken install must not stop the NumPy reference
    NUMBA_ERROR = f"{type(exc).__name__}: {exc}"


def resolve(choice: str) -> str:
    """`[runtime] cpu_kernels` as it will run: numba or numpy; auto = numba when it imports. Asking for numba
    where it does not import is a ConfigError naming why."""
    if choice not in CHOICES:
        raise ConfigError(f"[runtime] cpu_kernels = {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "auto":
        return "numpy" if NUMBA_ERROR else "numba"
    if choice == "numba" and NUMBA_ERROR:
        raise ConfigError(f"[runtime] cpu_kernels = \"numba\" but numba does not import ({NUMBA_ERROR}); "
                          "install it (pip install numba) or set cpu_kernels = \"numpy\"")
    return choice
