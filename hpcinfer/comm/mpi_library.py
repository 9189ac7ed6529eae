"""Loading mpi4py's MPI module, with one clear error when there is no MPI to load.

`from mpi4py import MPI` fails two ways: ImportError (mpi4py not installed) and RuntimeError ("cannot load MPI
library": mpi4py is there, but the MPI shared library it was built or configured for is not findable, e.g. the
mpich wheel installed with `pip install --target`, which drops its lib/ folder; docs/gpu.md). Both become a
ConfigError naming the fix, so `hpcinfer run` exits with one line instead of a traceback.

The first import initializes MPI (MPI_Init_thread), which waits on the launcher's process manager: a PMI exchange
that never completes would hold every rank until the job's time limit. It runs under a deadline,
HPCINFER_MPI_INIT_TIMEOUT seconds (default 300; 0: none): past it the process prints each thread's stack
("Timeout (0:05:00)!", then the frames, the innermost in load_mpi) and exits 1, so srun --kill-on-bad-exit ends
the step. faulthandler's timer is a C thread: MPI_Init holds the GIL, so a Python thread could not fire.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys

from ..errors import ConfigError

MPI_INIT_TIMEOUT_ENV = "HPCINFER_MPI_INIT_TIMEOUT"
DEFAULT_MPI_INIT_TIMEOUT_S = 300.0

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


def mpi_init_timeout(env=os.environ) -> float:
    """HPCINFER_MPI_INIT_TIMEOUT in seconds (0: no deadline), or a ConfigError naming the variable."""
    text = env.get(MPI_INIT_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_MPI_INIT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{MPI_INIT_TIMEOUT_ENV}={text!r}: expected a number of seconds >= 0 (0: no deadline on "
                          f"MPI_Init)")
    return seconds


def load_mpi():
    """mpi4py.MPI, or a ConfigError saying which part is missing and how to get it. The call that initializes MPI
    does it under the HPCINFER_MPI_INIT_TIMEOUT deadline (module docstring)."""
    deadline = mpi_init_timeout() if "mpi4py.MPI" not in sys.modules and sys.__stderr__ is not None else 0.0
    if deadline:                                     # the process's own stderr (sys.stderr may be a capture)
        faulthandler.dump_traceback_later(deadline, exit=True, file=sys.__stderr__)
    try:
        from mpi4py import MPI                       # MPI_Init_thread: a timeout here means the PMI exchange hung
    except ImportError as exc:
        raise ConfigError(f"mpi4py is not installed ({exc}): pip install mpi4py mpich (or build mpi4py against "
                          f"your cluster's MPI); see docs/slurm.md") from None
    except RuntimeError as exc:
        raise ConfigError(f"mpi4py cannot load an MPI library ({exc}): install one (pip install mpich, or load "
                          f"your cluster's MPI module) and make its lib/ folder findable (LD_LIBRARY_PATH); "
                          f"see docs/gpu.md") from None
    finally:
        if deadline:
            faulthandler.cancel_dump_traceback_later()
    return MPI
