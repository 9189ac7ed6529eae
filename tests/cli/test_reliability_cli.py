"""Reliable batch jobs end to end (docs/reliability.md), under mpiexec with 2 and 4 ranks, on the tiny-dense preset
(random weights, no conversion): injected failures and hangs end every rank in bounded time with the culprit
named, SIGTERM / SIGUSR1 stop a job with exit code 75 leaving whole committed lines, and a re-run resumes to the
very file an uninterrupted run writes; a changed job is refused unless --restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_helpers import build_command, clean_env

N_PROMPTS, MAX_NEW, BATCH = 40, 48, 2
BOUND_S = 40                      # every rank must be gone this long after the start, whatever went wrong


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [(7 * i + 3 * k) % 256 for k in range(2 + i % 7)]})
                               + "\n" for i in range(N_PROMPTS)))
    config = root / "job.toml"
    config.write_text(f'[model]\npreset = "tiny-dense"\n\n[generate]\nprompts = "{prompts}"\noutput = "unused"\n'
                      f"max_new_tokens = {MAX_NEW}\nbatch_size = {BATCH}\nignore_eos = true\n\n"
                      f'[runtime]\nbackend = "numpy"\nthreads = 1\n')
    return root, config


def _args(config, out: Path, *overrides, restart=False):
    args = ["run", str(config), "--set", f'generate.output="{out}"']
    for item in overrides:
        args += ["--set", item]
    return args + (["--restart"] if restart else [])


def _run(run_cli, config, out, *overrides, n=2, env=None, restart=False, timeout=120):
    return run_cli(_args(config, out, *overrides, restart=restart), n=n, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def reference(files, run_cli, tmp_path_factory):
    """The output of an uninterrupted run on 2 ranks."""
    root, config = files
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    done = _run(run_cli, config, out)
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


# ------------------------------------------------------------------------------------------ failures, hangs

FAILS = {  # id: (ranks, failing rank, point, overrides)
    "load-n2": (2, 1, "load", []),
    "after-load-n4": pytest.param(4, 2, "after_load", [], marks=pytest.mark.slow),
    "collective-tp2-n2": (2, 1, "collective", ["parallel.tp=2"]),
    "collective-n4": pytest.param(4, 3, "collective", ["parallel.tp=2"], marks=pytest.mark.slow),
    "sampling-pp2-n2": (2, 1, "sampling", ["parallel.pp=2"]),
    "sampling-n4": pytest.param(4, 2, "sampling", ["parallel.pp=2"], marks=pytest.mark.slow),
}


@pytest.mark.parametrize("n, rank, point, overrides", FAILS.values(), ids=FAILS.keys())
def test_an_injected_failure_ends_every_rank_with_its_message_first(files, run_cli, tmp_path, n, rank, point,
                                                                    overrides):
    root, config = files
    start = time.monotonic()
    done = _run(run_cli, config, tmp_path / "out.jsonl", *overrides, n=n, timeout=BOUND_S,
                env={"HPCINFER_FAIL_RANK": str(rank), "HPCINFER_FAIL_AT": point})
    assert time.monotonic() - start < BOUND_S
    assert done.returncode == 1, done.stderr
    ours = f"hpcinfer: internal error on rank {rank}"
    assert ours in done.stderr and f"injected failure on rank {rank} at {point}" in done.stderr, done.stderr
    first = [line for line in done.stderr.splitlines() if "hpcinfer:" in line][0]
    assert ours in first, done.stderr
    assert not (tmp_path / "out.jsonl").exists()


HANGS = {  # id: (ranks, hanging rank, where it hangs, overrides, the operation named)
    "world-gather-n2": (2, 1, "collective", [], "gather (objects) on group 'world'"),
    "tp-all-reduce-n4": pytest.param(4, 2, "collective", ["parallel.tp=2"], "all_reduce on group 'tp'",
                                     marks=pytest.mark.slow),
    "pipeline-recv-n2": (2, 1, "sampling", ["parallel.pp=2"], "receive (tag 12) on group 'pp'"),
    "pipeline-recv-n4": pytest.param(4, 3, "sampling", ["parallel.pp=4"], "on group 'pp'", marks=pytest.mark.slow),
}


@pytest.mark.parametrize("n, rank, point, overrides, op", HANGS.values(), ids=HANGS.keys())
def test_the_watchdog_names_the_rank_that_never_arrives(files, run_cli, tmp_path, n, rank, point, overrides, op):
    root, config = files
    start = time.monotonic()
    done = _run(run_cli, config, tmp_path / "out.jsonl", "runtime.comm_timeout=2", *overrides, n=n,
                timeout=BOUND_S, env={"HPCINFER_HANG_RANK": str(rank), "HPCINFER_HANG_AT": point})
    assert time.monotonic() - start < BOUND_S
    assert done.returncode == 3, done.stderr
    assert "watchdog:" in done.stderr and op in done.stderr and "comm_timeout = 2 s" in done.stderr, done.stderr
    assert f"world rank {rank}," in done.stderr or f"world rank(s) {rank} did not arrive" in done.stderr, \
        done.stderr


# ----------------------------------------------------------------------------------- preemption and resume

def _rank_pids(config: Path) -> list[int]:
    """The pids of the job's ranks (python -m hpcinfer run CONFIG, not mpiexec itself)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in argv and b"hpcinfer" in argv and not any(b"mpiexec" in a for a in argv[:1]):
            pids.append(int(entry.name))
    return pids


def _start_and_signal(config, out, signum, to_one_rank: bool, overrides=(), n=2):
    """Start the job, signal it once rank 0 has printed its mesh (handlers are in place), return the result."""
    cmd = build_command(_args(config, out, *overrides), n=n)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=clean_env(extra={"MPIEXEC_TIMEOUT": str(BOUND_S + 10)}))
    try:
        for line in proc.stdout:
            if line.strip().startswith("rank 0 (node 0)"):
                break
        if to_one_rank:
            pids = _rank_pids(config)
            assert len(pids) == n, pids
            os.kill(max(pids), signum)                              # one rank only: the others learn it at the round
        else:
            os.kill(proc.pid, signum)                               # mpiexec forwards it to every rank
        stdout, stderr = proc.communicate(timeout=BOUND_S)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, stderr


@pytest.mark.parametrize("signum, to_one_rank, overrides", [(signal.SIGTERM, False, []), (signal.SIGUSR1, True, []),
                                                             (signal.SIGTERM, True, ["parallel.pp=2"])],
                         ids=["sigterm-to-mpiexec", "sigusr1-to-one-rank", "sigterm-pipeline"])
def test_a_signal_stops_after_the_round_and_a_rerun_completes_the_same_file(files, run_cli, reference, tmp_path,
                                                                            signum, to_one_rank, overrides):
    root, config = files
    out = tmp_path / "out.jsonl"
    code, stderr = _start_and_signal(config, out, signum, to_one_rank, overrides)
    assert code == 75, stderr
    assert f"stopped by {signal.Signals(signum).name}" in stderr and "run the same command again" in stderr
    partial = out.read_bytes()
    assert partial.endswith(b"\n") and len(partial) < len(reference), stderr
    lines = partial.splitlines(keepends=True)                       # whole lines, each the reference's own (in
    assert set(lines) <= set(reference.splitlines(keepends=True))   # commit order: continuous batching commits
    assert len(set(lines)) == len(lines)                            # sequences as they finish), none twice
    done = _run(run_cli, config, out, *overrides)
    assert done.returncode == 0, done.stderr
    assert "already done" in done.stderr and "done by an earlier run" in done.stdout
    assert out.read_bytes() == reference


def test_a_torn_line_is_dropped_and_redone(files, run_cli, reference, tmp_path):
    root, config = files
    out = tmp_path / "out.jsonl"
    lines = reference.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:4]) + lines[4][:17])            # a kill in the middle of a write
    done = _run(run_cli, config, out, "parallel.tp=2", restart=True, env=None)     # start a state file ...
    assert done.returncode == 0, done.stderr
    state = json.loads((tmp_path / "out.jsonl.state.json").read_text())
    state["complete"] = False
    (tmp_path / "out.jsonl.state.json").write_text(json.dumps(state))
    out.write_bytes(b"".join(lines[:4]) + lines[4][:17])            # ... then tear its output
    done = _run(run_cli, config, out, "parallel.tp=2")
    assert done.returncode == 0, done.stderr
    assert "4 of 40 prompts are already done" in done.stderr
    assert out.read_bytes() == reference                            # tp = 2 gives the very same tokens


def test_a_finished_job_run_again_has_nothing_to_do(files, run_cli, reference, tmp_path):
    """pp = 2, where the stages once disagreed on the commit points of an empty share (a TypeError in
    BatchRounds.end): the re-run generates nothing, says so, and leaves the output as it was."""
    root, config = files
    out = tmp_path / "out.jsonl"
    assert _run(run_cli, config, out, "parallel.pp=2").returncode == 0
    assert out.read_bytes() == reference                            # pp = 2 gives the very same tokens
    done = _run(run_cli, config, out, "parallel.pp=2")
    assert done.returncode == 0, done.stderr
    assert "40 of 40 prompts are already done" in done.stderr, done.stderr
    assert "40 of them done by an earlier run" in done.stdout and out.read_bytes() == reference, done.stdout


def test_a_changed_job_is_refused_unless_restart(files, run_cli, reference, tmp_path):
    root, config = files
    out = tmp_path / "out.jsonl"
    out.write_bytes(reference)
    (tmp_path / "out.jsonl.state.json").write_text('{"version": 0}')       # not a state file of this version
    done = _run(run_cli, config, out, n=2)
    assert done.returncode == 2 and "is not a version-1 hpcinfer state file" in done.stderr, done.stderr
    assert _run(run_cli, config, out, restart=True).returncode == 0
    assert out.read_bytes() == reference
    done = _run(run_cli, config, out, "generate.max_new_tokens=3")
    assert done.returncode == 2, done.stderr
    assert "generate.max_new_tokens: 48 -> 3" in done.stderr and "--restart" in done.stderr
    assert out.read_bytes() == reference                            # refused before anything was touched
    done = _run(run_cli, config, out, "generate.max_new_tokens=3", restart=True)
    assert done.returncode == 0, done.stderr
    assert all(len(json.loads(line)["output_tokens"]) == 3 for line in out.read_text().splitlines())


# ----------------------------------------------------------------------------- set-up errors, before loading

def test_an_output_that_would_overwrite_the_prompts_is_refused(files, run_cli):
    root, config = files
    done = _run(run_cli, config, root / "prompts.jsonl", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "[generate] output and [generate] prompts are the same file" in done.stderr
    assert done.stderr.count("hpcinfer: error") == 1


def test_comm_timeout_must_be_positive(files, run_cli, tmp_path):
    root, config = files
    done = _run(run_cli, config, tmp_path / "out.jsonl", "runtime.comm_timeout=0", timeout=60)
    assert done.returncode == 2 and "runtime.comm_timeout = 0.0 must be > 0" in done.stderr, done.stderr
