"""mpi4py that finds no MPI library (`from mpi4py import MPI` raises RuntimeError "cannot load MPI library", as
after `pip install --target` of the mpich wheel, which drops its lib/ folder): `hpcinfer profile` of one process
goes on without MPI and says why; `hpcinfer run` stops with one line naming the fix, not a traceback. An MPI_Init
that never returns ends the process at HPCINFER_MPI_INIT_TIMEOUT."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from hpcinfer import cli
from hpcinfer.comm.mpi_library import (DEFAULT_MPI_INIT_TIMEOUT_S, MPI_INIT_TIMEOUT_ENV, launcher_free_env, load_mpi,
                                       mpi_init_timeout)
from hpcinfer.errors import ConfigError
from hpcinfer.offload.profile import load_profile


@pytest.fixture
def mpi_without_library(monkeypatch):
    """An mpi4py package whose MPI submodule fails to load, as mpi4py 4 does when libmpi is not findable."""
    package = types.ModuleType("mpi4py")

    def missing(name):
        if name == "MPI":
            raise RuntimeError("cannot load MPI library: libmpi.so.12: cannot open shared object file")
        raise AttributeError(name)

    package.__getattr__ = missing
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_load_mpi_names_the_missing_library(mpi_without_library):
    with pytest.raises(ConfigError, match=r"mpi4py cannot load an MPI library \(cannot load MPI library: libmpi"
                                          r".*pip install mpich.*LD_LIBRARY_PATH"):
        load_mpi()


def test_load_mpi_names_a_missing_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)                  # import mpi4py -> ImportError
    with pytest.raises(ConfigError, match="mpi4py is not installed .*pip install mpi4py mpich"):
        load_mpi()


def test_profile_of_one_process_needs_no_mpi(mpi_without_library, tmp_path, capsys):
    out = tmp_path / "alone.toml"
    assert cli.main(["profile", "--backend", "numpy", "--out", str(out), "--size", "1MiB",
                     "--disk-dir", str(tmp_path)]) == 0
    assert "defaults, not measured" in load_profile(str(out)).notes
    assert "warning: profiling this process alone: mpi4py cannot load an MPI library" in capsys.readouterr().err


def test_run_stops_with_one_line(mpi_without_library, tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcinfer: error: mpi4py cannot load an MPI library") and "Traceback" not in err


# --- the MPI_Init deadline ---------------------------------------------------------------------------------------

HANGING_MPI4PY = "import time\ntime.sleep(60)   # stands for an MPI_Init whose PMI exchange never completes\n"


def _run_with_hanging_mpi(tmp_path, timeout: str):
    """`hpcinfer run` in a child whose mpi4py.MPI import never returns; its (exit code, stderr, seconds)."""
    package = tmp_path / "fake" / "mpi4py"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "MPI.py").write_text(HANGING_MPI4PY)
    repo = Path(__file__).resolve().parents[2]
    env = {**launcher_free_env(os.environ), "PYTHONPATH": f"{package.parent}{os.pathsep}{repo}",
           MPI_INIT_TIMEOUT_ENV: timeout}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpcinfer", "run", str(tmp_path / "job.toml")], env=env,
                          capture_output=True, text=True, timeout=50)
    return proc.returncode, proc.stderr, time.monotonic() - t0


def test_an_mpi_init_that_never_returns_ends_the_process_at_the_deadline(tmp_path):
    code, err, seconds = _run_with_hanging_mpi(tmp_path, "1.5")
    assert code == 1 and seconds < 30, (code, seconds, err)
    assert "Timeout (0:00:01" in err and "in load_mpi" in err, err       # every thread's stack, load_mpi innermost


@pytest.mark.parametrize("text", ["soon", "-1", "inf", "nan"])
def test_a_bad_mpi_init_timeout_is_a_clear_error(text):
    with pytest.raises(ConfigError, match=rf"HPCINFER_MPI_INIT_TIMEOUT='{text}': expected a number of seconds"):
        mpi_init_timeout({MPI_INIT_TIMEOUT_ENV: text})


def test_the_mpi_init_timeout_defaults_and_zero_turns_it_off():
    assert mpi_init_timeout({}) == DEFAULT_MPI_INIT_TIMEOUT_S == 300.0
    assert mpi_init_timeout({MPI_INIT_TIMEOUT_ENV: "0"}) == 0.0
    assert mpi_init_timeout({MPI_INIT_TIMEOUT_ENV: " 45 "}) == 45.0
