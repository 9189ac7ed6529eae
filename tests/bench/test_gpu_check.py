"""gpu/check.py (`make gpu-check`), the one-call GPU window, rehearsed without a GPU on the CPU stand-in of
cupy: its steps write their result files as they end (8 at most, as the device tool brings back), the budget cuts
steps instead of overrunning, and MPI is made loadable from the carried mpich wheel when the image's mpi4py finds
no library (simulated here with an mpi4py that loads only with that wheel's lib/ on LD_LIBRARY_PATH)."""

from __future__ import annotations

import json
import os
import re
import stat
import zipfile
from pathlib import Path

import pytest

from gpu import check as gpu_check

RETURNED_AT_MOST = 8                        # files the device tool brings back from $OUT


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_rehearsal_writes_each_steps_file(tmp_path):
    """The regression steps on the stand-in: a file per step, the summary, the report. The end-to-end step (the
    GPU CLI tests, 75 s on the stand-in) is rehearsed by the exhaustive test below."""
    out = tmp_path / "out"
    assert gpu_check.main(["--fake", "--steps", "env,decode,memcheck", "--out", str(out),
                           "--carry", str(tmp_path / "none")]) == 0
    s = summary(out)
    assert s["fake"] is True and s["failed_steps"] == 0
    assert [s["steps"][name]["rc"] for name in ("env", "decode", "memcheck")] == [0, 0, 0]
    assert s["steps"]["memcheck"]["skipped"] == "compute-sanitizer needs a GPU"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["decode.json", "env.json", "log.txt", "summary.json"]
    assert set(files) <= set(gpu_check.FILES.values()) | set(gpu_check.ALWAYS)
    assert len(files) <= RETURNED_AT_MOST
    env = json.loads((out / "env.json").read_text())
    assert env["emulated"] is True and env["commit"] and "mpi" in env and "nvrtc" in env
    decode = json.loads((out / "decode.json").read_text())["sections"]
    assert set(decode["decode"]) == {"tiny-dense", "tiny-dense x2"} and decode["copy"]["GBps"] > 0
    assert gpu_check.main(["--report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| decode | 0 |" in text and "tiny-dense x2:" in text


@pytest.mark.exhaustive
def test_rehearsal_of_the_end_to_end_step_reports_its_tests(tmp_path):
    out = tmp_path / "out"
    assert gpu_check.main(["--fake", "--steps", "e2e", "--out", str(out), "--carry", str(tmp_path / "none")]) == 0
    assert summary(out)["steps"]["e2e"]["rc"] == 0
    assert 'failures="0"' in (out / "e2e.xml").read_text()
    assert gpu_check.main(["--report", str(out)]) == 0
    text = (out / "report.md").read_text()
    e2e_tests = re.search(r'tests="(\d+)"', (out / "e2e.xml").read_text()).group(1)       # the e2e file's count
    assert int(e2e_tests) >= 9 and f"{e2e_tests} tests, 0 failed" in text and "| e2e | 0 |" in text


def test_issue_29_sweeps_report_into_the_summary(tmp_path):
    """The kernel sweeps (bench/gpu_gemm.py, bench/gpu_attention.py) run as steps on the stand-in, with no file of
    their own: their rows land in summary.json under the step."""
    out = tmp_path / "out"
    assert gpu_check.main(["--fake", "--steps", "gemm,attention", "--out", str(out),
                           "--carry", str(tmp_path / "none")]) == 0
    steps = summary(out)["steps"]
    assert [steps[name]["rc"] for name in gpu_check.SWEEPS] == [0, 0]
    assert steps["gemm"]["results"]["rows"] and steps["attention"]["results"]["rows"]
    assert steps["gemm"]["results"]["copy_GBps"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.json"]


def test_what_comes_back_fits_the_device_tool():
    """Every step's file, the summary and the log: at most 8 files, one per step that makes one."""
    assert set(gpu_check.FILES) == set(gpu_check.STEPS) - {"mpi", *gpu_check.SWEEPS, *gpu_check.SCENARIOS}  # summary
    assert len(set(gpu_check.FILES.values()) | set(gpu_check.ALWAYS)) <= RETURNED_AT_MOST


def test_the_budget_cuts_steps_instead_of_overrunning(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 5)
    out = tmp_path / "out"
    gpu_check.main(["--fake", "--steps", "env,decode", "--budget", "4", "--out", str(out)])
    s = summary(out)
    assert s["steps"]["env"]["rc"] is None and "out of time" in s["steps"]["env"]["skipped"]
    assert s["steps"]["decode"]["rc"] is None and s["elapsed_s"] < 4


def test_a_step_over_its_limit_is_killed_and_recorded(tmp_path):
    check = gpu_check.Check(tmp_path, True, gpu_check.time.monotonic() + 60, tmp_path, "c0ffee")
    rc, seconds, timed_out = check.run("sleeper", ["sleep", "30"], 1)
    assert timed_out and rc != 0 and seconds < 10
    assert "sleeper: rc" in (tmp_path / "log.txt").read_text()


FAKE_MPIEXEC = '#!/bin/sh\n[ "$1" = -n ] && shift 2\nexec "$@"\n'      # runs its command once
FAKE_WORLD = ("class _World:\n    def allreduce(self, x):\n        return x\n    def Get_size(self):\n        return 1\n"
              "COMM_WORLD = _World()\n")


def fake_mpi4py(site: Path, condition: str, library: str) -> None:
    """An mpi4py whose MPI module raises 'cannot load MPI library' unless `condition` (Python) holds."""
    package = site / "mpi4py"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "MPI.py").write_text(f"import os\nif not ({condition}):\n    raise RuntimeError('cannot load MPI library')\n"
                                    f"def Get_library_version():\n    return {library!r}\n" + FAKE_WORLD)


def fake_mpich_wheel(folder: Path) -> Path:
    """A wheel laid out as mpich's: <name>.data/data/{lib,bin}/..., mpiexec executable."""
    folder.mkdir(parents=True)
    wheel = folder / "mpich-9.9-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("mpich-9.9.dist-info/METADATA", "Name: mpich\n")
        z.writestr("mpich-9.9.data/data/lib/libmpi.so.12", "not a real library")
        info = zipfile.ZipInfo("mpich-9.9.data/data/bin/mpiexec")
        info.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(info, FAKE_MPIEXEC)
    return wheel


def test_unpack_keeps_the_library_folder_and_executables(tmp_path):
    wheel = fake_mpich_wheel(tmp_path / "whl")
    gpu_check.unpack_mpich(str(wheel), tmp_path / "mpich")
    assert (tmp_path / "mpich" / "lib" / "libmpi.so.12").read_text() == "not a real library"
    assert os.access(tmp_path / "mpich" / "bin" / "mpiexec", os.X_OK)


def test_mpi_step_falls_back_to_the_carried_mpich(tmp_path, monkeypatch):
    """The image's mpi4py raises 'cannot load MPI library' unless the carried lib/ is on LD_LIBRARY_PATH: the step
    unpacks the wheel, sets LD_LIBRARY_PATH and PATH for the later steps, and the probe then passes."""
    mpi_dir = tmp_path / "unpacked"
    monkeypatch.setattr(gpu_check, "MPI_DIR", mpi_dir)
    fake_mpich_wheel(tmp_path / "carry" / "whl")
    fake_mpi4py(tmp_path / "site", f"{str(mpi_dir / 'lib')!r} in os.environ.get('LD_LIBRARY_PATH', '').split(os.pathsep)",
                "fake MPICH from the carried wheel")
    check = gpu_check.Check(tmp_path, True, gpu_check.time.monotonic() + 120, tmp_path / "carry", "c0ffee")
    check.env["PYTHONPATH"] = str(tmp_path / "site")
    result = gpu_check.step_mpi(check)
    assert result["rc"] == 0 and "unpacked" in result["note"], result
    assert check.env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(mpi_dir / "lib")
    assert check.env["PATH"].split(os.pathsep)[0] == str(mpi_dir / "bin")
    assert "cannot load MPI library" in (tmp_path / "log.txt").read_text()     # the image's probe failed first


def test_without_a_wheel_the_mpi_step_says_what_to_carry(tmp_path):
    fake_mpi4py(tmp_path / "site", "False", "never")
    check = gpu_check.Check(tmp_path, True, gpu_check.time.monotonic() + 60, tmp_path / "carry", "c0ffee")
    check.env["PYTHONPATH"] = str(tmp_path / "site")
    result = gpu_check.step_mpi(check)
    assert result["rc"] == 1 and "make gpu-carry" in result["note"]


def test_open_mpi_without_ssh_gets_the_isolated_launcher(tmp_path):
    """The lent machine's Debian Open MPI aborts a singleton MPI_Init without an rsh agent and refuses root under
    mpiexec: the step retries with OPEN_MPI_LOCAL and keeps it for every later step, before any carried MPI."""
    fake_mpi4py(tmp_path / "site", "os.environ.get('OMPI_MCA_plm') == 'isolated'", "fake Open MPI")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpiexec").write_text(FAKE_MPIEXEC)
    (bin_dir / "mpiexec").chmod(0o755)
    check = gpu_check.Check(tmp_path, True, gpu_check.time.monotonic() + 60, tmp_path / "carry", "c0ffee")
    check.env.update(PYTHONPATH=str(tmp_path / "site"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result = gpu_check.step_mpi(check)
    assert result["rc"] == 0 and "OMPI_MCA_plm=isolated" in result["note"], result
    assert check.env["OMPI_MCA_plm"] == "isolated" and check.env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    log = (tmp_path / "log.txt").read_text()
    assert "cannot load MPI library" in log and "fake Open MPI ranks 1" in log


@pytest.mark.parametrize("steps", ["env,nonsense"])
def test_unknown_steps_are_refused(tmp_path, steps):
    with pytest.raises(SystemExit):
        gpu_check.main(["--fake", "--steps", steps, "--out", str(tmp_path)])


def test_the_open_mpi_settings_survive_the_launcher_filter():
    """The jobs the later steps start drop launcher variables (comm.mpi_library.launcher_free_env): the settings
    the mpi step found must not be among them, or every singleton `hpcinfer run` aborts again."""
    from hpcinfer.comm.mpi_library import launcher_free_env

    assert launcher_free_env(gpu_check.OPEN_MPI_LOCAL) == gpu_check.OPEN_MPI_LOCAL
