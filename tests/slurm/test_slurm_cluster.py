"""The test cluster itself (tests/helpers/slurm_cluster.py): why it skips, and that it leaves nothing behind: not
after stop() with a job running, not when the process that started it is killed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from slurm_cluster import SlurmCluster, unavailable_reason

HELPERS = Path(slurm_cluster.__file__).parent


def test_skip_reason_when_not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "not root" in unavailable_reason()


def test_skip_reason_when_a_package_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster.shutil, "which",
                        lambda name, path=None: None if name == "slurmd" else f"/usr/bin/{name}")
    reason = unavailable_reason()
    assert "slurmd not on PATH" in reason and "make slurm-packages" in reason


@pytest.fixture
def available():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _wait_gone(pids, timeout=15.0):
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_the_slurm_config_is_the_recipes(available):
    """docs/slurm.md's recipe names the settings the harness uses (the same cluster, by hand)."""
    cluster = SlurmCluster()
    try:
        conf = cluster.slurm_conf()
    finally:
        cluster.stop()
    doc = (HELPERS.parents[1] / "docs" / "slurm.md").read_text()
    for key in ("MpiDefault=pmi2", "SelectType=select/cons_tres", "ProctrackType=proctrack/linuxproc",
                "cred_expire=5", "sched_interval=1,bf_interval=1",
                "OverSubscribe=FORCE:8", "ReturnToService=2"):
        assert key in conf and key in doc, key


def test_clusters_number_their_jobs_apart(available):
    """Two clusters at once (pytest-xdist workers) must not both start at job 1: MPICH keys a job's shared state by
    its job id, and their ranks' messages crossed."""
    clusters = [SlurmCluster(), SlurmCluster()]
    try:
        firsts = [int(c.slurm_conf().split("FirstJobId=")[1].split()[0]) for c in clusters]
    finally:
        for c in clusters:
            c.stop()
    assert firsts[0] != firsts[1] and all(slurm_cluster.JOB_ID_RANGE[0] <= f < 67_043_328 for f in firsts)


def test_stop_ends_daemons_and_a_running_job(available):
    cluster = SlurmCluster().start()
    try:
        daemons = [p.pid for p in cluster._daemons.values()]
        job = cluster.sbatch(["--wrap", "srun sleep 300"], env=dict(os.environ), cwd="/")
        cluster.wait_for(job, {"RUNNING"}, timeout=30)
        deadline = time.monotonic() + 10
        while len(cluster.job_processes(job)) < 2 and time.monotonic() < deadline:   # the shell, srun, sleep
            time.sleep(0.1)
        job_pids = cluster.job_processes(job)
        assert job_pids
    finally:
        cluster.stop()
    assert _wait_gone(daemons + job_pids) == []
    assert slurm_cluster._pids_with_env({f"SLURM_CONF={cluster.conf}"}) == []
    assert not cluster.root.exists()


CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from slurm_cluster import SlurmCluster
c = SlurmCluster().start()
print(c.root, *(p.pid for p in c._daemons.values()), flush=True)
time.sleep(300)
"""


def test_daemons_die_with_the_test_process(available):
    """SIGKILL to the process that started the cluster (no finalizer, no atexit runs): the parent-death signal
    still ends munged, slurmctld and slurmd."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(HELPERS)], stdout=subprocess.PIPE, text=True)
    root = None
    try:
        root, *pids = child.stdout.readline().split()
        daemons = [int(p) for p in pids]
        assert len(daemons) == 3 and all(_alive(p) for p in daemons)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert _wait_gone(daemons) == []
    if root:
        shutil.rmtree(root, ignore_errors=True)             # what only the killed process's stop() would remove
