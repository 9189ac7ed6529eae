"""mpi4py that finds no MPI library (`from mpi4py import MPI` raises RuntimeError "cannot load MPI library", as
after `pip install --target` of the mpich wheel, which drops its lib/ folder): `hpcinfer profile` of one process
goes on without MPI and says why; `hpcinfer run` stops with one line naming the fix, not a traceback."""

from __future__ import annotations

import sys
import types

import pytest

from hpcinfer import cli
from hpcinfer.comm.mpi_library import load_mpi
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
