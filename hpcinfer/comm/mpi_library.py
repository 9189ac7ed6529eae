"""Loading mpi4py's MPI module, with one clear error when there is no MPI to load.

`from mpi4py import MPI` fails two ways: ImportError (mpi4py not installed) and RuntimeError ("cannot load MPI
library": mpi4py is there, but the MPI shared library it was built or configured for is not findable, e.g. the
mpich wheel installed with `pip install --target`, which drops its lib/ folder; docs/gpu.md). Both become a
ConfigError naming the fix, so `hpcinfer run` exits with one line instead of a traceback.
"""

from __future__ import annotations

from ..errors import ConfigError

# What a process manager (Hydra, Slurm's PMI/PMIx, Open MPI's orterun) sets for the ranks it starts: a job started
# from inside a rank (a test, a benchmark cell) must not inherit them, or it would try to join the outer job.
LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "MPIR_", "HYDRA_", "HYDI_", "MPI_", "OMPI_")
# Settings a user or a site gives Open MPI, kept although they share the OMPI_ prefix: in a container without ssh,
# run as root (the lent GPU machine's Debian Open MPI, 2026-11-27), a singleton MPI_Init aborts unless
# OMPI_MCA_plm=isolated, and mpiexec refuses root without the consent variables (docs/gpu.md).
USER_MPI_SETTINGS = frozenset({"OMPI_MCA_plm", "OMPI_MCA_rmaps_base_oversubscribe",
                               "OMPI_MCA_btl_vader_single_copy_mechanism", "OMPI_ALLOW_RUN_AS_ROOT",
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"})


def launcher_free_env(env) -> dict:
    """A copy of `env` without the variables a process manager sets for its ranks (USER_MPI_SETTINGS kept)."""
    return {k: v for k, v in env.items() if k in USER_MPI_SETTINGS or not k.startswith(LAUNCHER_ENV_PREFIXES)}


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
