"""The test harness itself: the command line run_cli builds, the environment it cleans, the hang it catches."""

import sys
import time
from pathlib import Path

import pytest

from cli_helpers import build_command, clean_env, mpiexec_path, run_command


def test_single_rank_runs_the_module_with_this_interpreter():
    assert build_command(["run", "inputs/demo.toml"]) == [sys.executable, "-m", "hpcinfer", "run", "inputs/demo.toml"]


def test_several_ranks_go_through_mpiexec():
    cmd = build_command(["info", Path("x.h5")], n=4, mpiexec="/opt/mpi/bin/mpiexec")
    assert cmd == ["/opt/mpi/bin/mpiexec", "-n", "4", sys.executable, "-m", "hpcinfer", "info", "x.h5"]


def test_default_mpiexec_is_the_venvs():
    if not (Path(sys.executable).parent / "mpiexec").exists():
        pytest.skip("no mpiexec in this interpreter's bin/ (not the project's venv)")
    assert mpiexec_path() == str(Path(sys.executable).parent / "mpiexec")
    assert build_command([], n=2)[0] == mpiexec_path()


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_rank_counts_are_refused(n):
    with pytest.raises(ValueError):
        build_command(["run"], n=n)


def test_a_single_string_is_refused():
    with pytest.raises(TypeError):
        build_command("run inputs/demo.toml")


def test_launcher_variables_are_stripped_and_others_kept():
    outer = {"PMI_RANK": "1", "PMI_FD": "7", "HYDRA_CONTROL_FD": "5", "MPIR_CVAR_X": "1", "MPI_LOCALRANKID": "1",
             "OMPI_COMM_WORLD_RANK": "1", "OMPI_MCA_orte_hnp_uri": "x", "OMPI_MCA_plm": "isolated",
             "OMPI_ALLOW_RUN_AS_ROOT": "1", "PATH": "/usr/bin", "MPIEXEC_TIMEOUT": "900", "OMP_NUM_THREADS": "1"}
    env = clean_env(outer, extra={"HPCINFER_X": "y"})
    assert env == {"PATH": "/usr/bin", "MPIEXEC_TIMEOUT": "900", "OMP_NUM_THREADS": "1", "HPCINFER_X": "y",
                   "OMPI_MCA_plm": "isolated", "OMPI_ALLOW_RUN_AS_ROOT": "1"}   # Open MPI's user settings stay
    assert "PMI_RANK" in outer  # the caller's mapping is not modified


def test_child_sees_no_pmi_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    code = "import os; print(sorted(k for k in os.environ if k.startswith('PMI_')))"
    done = run_command([sys.executable, "-c", code], timeout=30, env=clean_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_exit_status_and_output_come_back():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = run_command([sys.executable, "-c", code], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_a_hang_is_killed_and_reported():
    # The child starts a grandchild in the same process group: both must go.
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    start = time.monotonic()
    with pytest.raises(AssertionError, match="hung"):
        run_command([sys.executable, "-c", code], timeout=2)
    assert time.monotonic() - start < 15
