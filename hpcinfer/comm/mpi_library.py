"""Loading mpi4py's MPI module, with one clear error when there is no MPI to load.

`from mpi4py import MPI` fails two ways: ImportError (mpi4py not installed) and RuntimeError ("cannot load MPI
library": mpi4py is there, but the MPI shared library it was built or configured for is not findable, e.g. the
mpich wheel installed with `pip install --target`, which drops its lib/ folder; docs/gpu.md). Both become a
ConfigError naming the fix, so `hpcinfer run` exits with one line instead of a traceback.
"""

from __future__ import annotations

from ..errors import ConfigError


def load_mpi():
    """mpi4py.MPI, or a ConfigError saying which part is missing and how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"mpi4py is not installed ({exc}): pip install mpi4py mpich (or build mpi4py against "
                          f"your cluster's MPI); see docs/slurm.md") from None
    except RuntimeError as exc:
        raise ConfigError(f"mpi4py cannot load an MPI library ({exc}): install one (pip install mpich, or load "
                          f"your cluster's MPI module) and make its lib/ folder findable (LD_LIBRARY_PATH); "
                          f"see docs/gpu.md") from None
    return MPI
