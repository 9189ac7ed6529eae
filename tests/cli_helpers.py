"""Run `python -m hpcinfer ...` from a test: alone, or on n ranks under the venv's mpiexec.

The child never inherits the PMI/MPI variables of a surrounding mpiexec (a test rank that spawns a job
would otherwise make the child join the outer job's PMI), runs in its own process group, and is killed
whole when it overruns: a hang becomes an AssertionError, never a stuck test suite.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# Variables a process manager (Hydra, Slurm's PMI/PMIx, Open MPI) sets for its ranks.
LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "MPIR_", "HYDRA_", "HYDI_", "MPI_", "OMPI_")
# Hydra kills the job this long after our own timeout, should the test process die before killing it.
MPIEXEC_GRACE_S = 10


def mpiexec_path():
    """The mpiexec beside the running interpreter (the venv's MPICH), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(f"no mpiexec beside {sys.executable} nor on PATH")
    return found


def build_command(args, n=1, python=None, mpiexec=None):
    """The argv that runs hpcinfer with `args` on `n` ranks (n=1: no mpiexec, a singleton MPI world)."""
    if isinstance(args, (str, bytes)):
        raise TypeError("args must be a list of strings, not one string")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    python = python or sys.executable
    cmd = [python, "-m", "hpcinfer", *map(str, args)]
    if n == 1:
        return cmd
    return [mpiexec or mpiexec_path(), "-n", str(n), *cmd]


def clean_env(env=None, extra=None):
    """A copy of `env` (default os.environ) without launcher variables, updated with `extra`."""
    source = os.environ if env is None else env
    out = {k: v for k, v in source.items() if not k.startswith(LAUNCHER_ENV_PREFIXES)}
    out.update(extra or {})
    return out


def run_command(cmd, timeout, env=None, cwd=None):
    """Run `cmd` in a new process group; on timeout kill the group and raise AssertionError (it hung)."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"hung: no exit after {timeout}s, process group killed: {' '.join(map(str, cmd))}\n"
            f"--- stdout (tail)\n{stdout[-4000:]}\n--- stderr (tail)\n{stderr[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_cli(args, n=1, timeout=120, cwd=None, env=None):
    """Run `python -m hpcinfer *args` on n ranks; return a CompletedProcess with text stdout/stderr.

    `env` adds or overrides variables. Under mpiexec, MPIEXEC_TIMEOUT backs up our own timeout.
    """
    cmd = build_command(args, n=n)
    extra = dict(env or {})
    if n > 1:
        extra.setdefault("MPIEXEC_TIMEOUT", str(int(timeout) + MPIEXEC_GRACE_S))
    return run_command(cmd, timeout=timeout, env=clean_env(extra=extra), cwd=cwd)
