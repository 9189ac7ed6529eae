"""jobs/requeue.slurm under a real Slurm (one node, 2 ranks, the tiny llama): requeue cycles on the time-limit
warning, preemption by `scontrol requeue`, a bad config, and `scancel` in the middle of a job.

Each requeued start resumes the committed output; the finished file must be byte for byte what an uninterrupted
one-rank run writes. The test cluster starts a requeued job ~6 s after it stopped (slurm_cluster.FAST_REQUEUE;
Slurm's defaults wait ~2-3 minutes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_helpers import clean_env, run_cli
from slurm_cluster import FINISHED
from slurm_jobs import JOBS, ROOT, job_env, read_log, sets, submit, token_prompts

COUNT = 40                      # prompts: 20 rounds (dp = 2, batch 1); each stop comes after a start's first
NEW_TOKENS = 8
STOP_LINE = "job: stopped with its results committed; requeueing job"
MESH_LINE = "hpcinfer: 2 ranks on 1 node(s)"
TERM_LINE = "job: stopped by SIGTERM with its results committed; Slurm requeues or ends job"


def _items(prompts: Path, output: Path, out: Path, *extra: str) -> list[str]:
    return [f"generate.prompts={prompts}", f"generate.output={output}", f"generate.metrics={out}/m.json",
            "generate.batch_size=1", f"generate.max_new_tokens={NEW_TOKENS}", "generate.ignore_eos=true", *extra]


@pytest.fixture(scope="module")
def reference(tiny_ckpt, tmp_path_factory):
    """The prompts and the output of an uninterrupted one-rank run of the job requeue.slurm runs (its default
    CONFIG, inputs/demo.toml, with the same overrides): (prompt file, output bytes)."""
    root = tmp_path_factory.mktemp("requeue-ref")
    prompts, output = token_prompts(root / "p.jsonl", COUNT), root / "ref.jsonl"
    args = ["run", "inputs/demo.toml", "--set", f'model.checkpoint="{tiny_ckpt}"']
    for item in _items(prompts, output, root):
        args += ["--set", item]
    done = run_cli(args, n=1, timeout=180, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    return prompts, output.read_bytes()


def _env(tiny_ckpt, prompts, output, out, *extra) -> dict:
    return job_env(HPCINFER_MODEL=str(tiny_ckpt), HPCINFER_OUT=str(out),
                   HPCINFER_SET=sets(*_items(prompts, output, out, *extra)))


def _wait_started(slurm, job, log: Path, start: int, timeout: float = 120) -> None:
    """Wait until start number `start` of the job runs its ranks: their mesh line is in the log, so every rank has
    its signal handlers (and the batch shell its traps). A signal now stops the job after its first round at the
    latest, however fast this machine runs the rest."""
    deadline = time.monotonic() + timeout
    while True:
        info = slurm.job(job)
        if info["JobState"] == "RUNNING" and read_log(log).count(MESH_LINE) >= start:
            return
        assert info["JobState"] not in FINISHED, (info, read_log(log))
        assert time.monotonic() < deadline, f"start {start} not running after {timeout} s: {info}"
        time.sleep(0.05)


def _wait_requeued(slurm, job, restarts: int, timeout: float = 90) -> dict:
    """Wait until the job has been requeued `restarts` times and its stopped start is over (no longer
    COMPLETING: every rank has exited, so the output holds what that start committed)."""
    deadline = time.monotonic() + timeout
    while True:
        info = slurm.job(job)
        if int(info["Restarts"]) >= restarts and info["JobState"] in {"PENDING", "RUNNING"} | FINISHED:
            return info
        assert time.monotonic() < deadline, f"not requeued {restarts} time(s) within {timeout} s: {info}"
        time.sleep(0.1)


def _assert_whole_lines(output: Path) -> list[dict]:
    data = output.read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.decode().splitlines()]


def test_requeue_cycles_end_in_the_uninterrupted_output(slurm, tiny_ckpt, reference, tmp_path):
    """Two stops on SIGUSR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit): each commits
    its rounds, exits 75 and requeues the job; the third start finishes the file."""
    prompts, expected = reference
    output = tmp_path / "o.jsonl"
    job, log = submit(slurm, "requeue.slurm", tmp_path, _env(tiny_ckpt, prompts, output, tmp_path))
    seen = 0
    for cycle in range(2):
        _wait_started(slurm, job, log, cycle + 1)
        slurm.scancel("--batch", "--signal=USR1", job)
        _wait_requeued(slurm, job, cycle + 1)
        stopped_at = len(_assert_whole_lines(output))
        assert seen < stopped_at < COUNT, (seen, stopped_at)      # each start commits at least one round
        seen = stopped_at
    info = slurm.wait_done(job, timeout=120)
    text = read_log(log)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), (info, text)
    assert output.read_bytes() == expected
    assert text.count(STOP_LINE) == 2 and text.count("hpcinfer: stopped by SIGUSR1 on rank") == 2, text
    for start in (1, 2, 3):
        assert f"job {job}: start {start} of inputs/demo.toml" in text, text
    assert f"tokens generated for {COUNT} prompts ({seen} of them done by an earlier run)" in text, text


def test_the_time_limit_warning_requeues(slurm, tiny_ckpt, tmp_path):
    """Slurm's own warning: with --time=2 --signal=B:USR1@50 (on the command line, over the script's 30 min and
    @120), slurmctld sends SIGUSR1 to the batch shell 50 s before the limit, or up to 60 s earlier (its time-limit
    check runs every 30 s; sbatch(1): "may be sent up to 60 seconds earlier"), so 10-70 s into the job: after the
    script has set its traps. (--time=1 could send it at second 0, before them, and kill the shell: exit 138.)
    The script stops the ranks and requeues itself. The job is then cancelled (resuming is tested above)."""
    prompts, output = token_prompts(tmp_path / "p.jsonl", 24000), tmp_path / "o.jsonl"   # > 140 s of work on EPYC
    job, log = submit(slurm, "requeue.slurm", tmp_path, _env(tiny_ckpt, prompts, output, tmp_path),
                      "--time=2", "--signal=B:USR1@50")
    started = slurm.wait_for(job, {"RUNNING"}, timeout=60)
    _wait_requeued(slurm, job, 1, timeout=150)
    slurm.scancel(job)
    info = slurm.wait_done(job, timeout=60)
    text = read_log(log)
    assert info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 1, (info, text)
    assert "job: SIGUSR1: every rank stops after its current batch" in text and text.count(STOP_LINE) == 1, text
    assert "hpcinfer: stopped by SIGUSR1 on rank" in text and "TIME LIMIT" not in text, text
    assert 0 < len(_assert_whole_lines(output)) < 24000, started


def test_preemption_stops_cleanly_and_resumes(slurm, tiny_ckpt, reference, tmp_path):
    """`scontrol requeue` of the running job (what preemption with PreemptMode=REQUEUE does): Slurm sends SIGTERM,
    the ranks commit their round and exit 75, Slurm requeues the job, and the next start finishes it."""
    prompts, expected = reference
    output = tmp_path / "o.jsonl"
    job, log = submit(slurm, "requeue.slurm", tmp_path, _env(tiny_ckpt, prompts, output, tmp_path))
    _wait_started(slurm, job, log, 1)
    slurm.scontrol("requeue", job)
    _wait_requeued(slurm, job, 1)
    assert 0 < len(_assert_whole_lines(output)) < COUNT
    info = slurm.wait_done(job, timeout=120)
    text = read_log(log)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (info, text)
    assert output.read_bytes() == expected
    assert "hpcinfer: stopped by SIGTERM on rank" in text and "DUE TO JOB REQUEUE" in text, text
    assert TERM_LINE in text and STOP_LINE not in text, text      # Slurm requeued it: the script did not ask
    assert f"job {job}: start 2 of inputs/demo.toml" in text


def test_bad_config_fails_with_exit_2_and_no_requeue(slurm, tiny_ckpt, reference, tmp_path):
    prompts, _ = reference
    output = tmp_path / "o.jsonl"
    env = _env(tiny_ckpt, prompts, output, tmp_path, "generate.batch_size=0")
    job, log = submit(slurm, "requeue.slurm", tmp_path, env)
    info = slurm.wait_done(job, timeout=60)
    text = read_log(log)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), (info, text)
    assert text.count("hpcinfer: error") == 1 and "batch_size" in text, text
    assert STOP_LINE not in text and not output.exists()
    time.sleep(2)                                           # the scheduler runs every second here
    assert slurm.job(job)["JobState"] == "FAILED"


def test_scancel_leaves_whole_lines_and_no_rank(slurm, tiny_ckpt, reference, tmp_path):
    """`scancel` mid-job: SIGTERM to every process of the job, the ranks commit their round and exit; the output
    ends in a whole line, no process of the job is left, and the job stays cancelled (not requeued)."""
    prompts, expected = reference
    output = tmp_path / "o.jsonl"
    job, log = submit(slurm, "requeue.slurm", tmp_path, _env(tiny_ckpt, prompts, output, tmp_path))
    _wait_started(slurm, job, log, 1)
    assert slurm.job_processes(job), "no process of the running job found by its environment"
    slurm.scancel(job)
    info = slurm.wait_for(job, {"CANCELLED"}, timeout=60)   # COMPLETING until every process of the job is gone
    assert slurm.job_processes(job) == []
    records = _assert_whole_lines(output)
    assert 0 < len(records) < COUNT
    assert set(output.read_bytes().splitlines()) <= set(expected.splitlines())     # finished records, as they end
    text = read_log(log)
    assert "hpcinfer: stopped by SIGTERM on rank" in text and TERM_LINE in text and STOP_LINE not in text, text
    time.sleep(2)
    info = slurm.job(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info


def test_sigterm_to_the_batch_shell_stops_without_a_requeue_here(tiny_ckpt, reference, tmp_path):
    """lib.sh's rule without a Slurm (jobs/run_local.sh, mpiexec, a recording `scontrol`): SIGTERM to the batch
    shell stops the ranks cleanly and the script exits 75 without asking for a requeue."""
    prompts, expected = reference
    output, bin_dir, calls = tmp_path / "o.jsonl", tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = clean_env(extra={**_env(tiny_ckpt, prompts, output, tmp_path), "SLURM_JOB_ID": "4242",
                           "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    log = tmp_path / "stdout.txt"
    with open(log, "w") as stdout_file:
        job = subprocess.Popen(["bash", str(JOBS / "run_local.sh"), str(JOBS / "requeue.slurm")], env=env, cwd=ROOT,
                               stdout=stdout_file, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while MESH_LINE not in read_log(log) and job.poll() is None:      # the ranks run, their handlers set
            assert time.monotonic() < deadline, "no rank started within 120 s"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)                     # the batch shell: run_local.sh execs the script
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    stdout = read_log(log)
    assert job.returncode == 75, stdout + stderr
    assert TERM_LINE in stderr and STOP_LINE not in stderr and not calls.exists(), stderr
    assert 0 < len(_assert_whole_lines(output)) < COUNT
