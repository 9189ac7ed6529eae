"""Run `python -m hpcinfer ...` from a test: alone, or on n ranks under the venv's mpiexec.

The child never inherits the PMI/MPI variables of a surrounding mpiexec (a test rank that spawns a job
would otherwise make the child join the outer job's PMI), runs in its own process group, and is killed
whole when it overruns: a hang becomes an AssertionError, never a stuck test suite.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from hpcinfer.comm.mpi_library import launcher_free_env

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
    """A copy of `env` (default os.environ) without launcher variables (comm.mpi_library.launcher_free_env: Open
    MPI's user settings kept), updated with `extra`."""
    out = launcher_free_env(os.environ if env is None else env)
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


def write_token_prompts(path, lengths, vocab: int, seed: int = 7):
    """A prompt file of random token ids, one prompt `p{i}` per length; returns the token lists."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, vocab, size=n).tolist() for n in lengths]
    Path(path).write_text("".join(json.dumps({"id": f"p{i}", "tokens": t}) + "\n" for i, t in enumerate(tokens)))
    return tokens


class CliJob:
    """A test module's job: its checkpoint, prompts and config under `root`; `run` runs `hpcinfer run` with the
    output and metrics in `out_dir` plus extra --set overrides (subclasses build the checkpoint and prompts)."""

    def __init__(self, root, run_cli, cwd, ckpt, prompts, max_new: int, batch: int, extra: str = ""):
        self.root, self._run_cli, self.cwd = Path(root), run_cli, cwd
        self.ckpt, self.prompts = Path(ckpt), Path(prompts)
        self.config = self.root / "job.toml"
        self.config.write_text(
            f'[model]\ncheckpoint = "{self.ckpt}"\n\n'
            f'[generate]\nprompts = "{self.prompts}"\noutput = "unused.jsonl"\nmax_new_tokens = {max_new}\n'
            f"batch_size = {batch}\n{extra}")

    def overrides(self, out_dir, *extra) -> list:
        return [f'generate.output="{Path(out_dir) / "output.jsonl"}"',
                f'generate.metrics="{Path(out_dir) / "metrics.json"}"', *extra]

    def run(self, out_dir, *extra, n=1, timeout=120, env=None, config=None):
        args = ["run", str(config or self.config)]
        for item in self.overrides(out_dir, *extra):
            args += ["--set", item]
        return self._run_cli(args, n=n, timeout=timeout, cwd=self.cwd, env=env)

    def run_reference(self, out_dir):
        """One rank, the config as written: asserts exit 0 and one output record per prompt, in the prompt file's
        order; returns (CompletedProcess, output records)."""
        done = self.run(out_dir)
        assert done.returncode == 0, done.stderr
        got = output_records(out_dir)
        ids = [json.loads(line)["id"] for line in self.prompts.read_text().splitlines() if line.strip()]
        assert [r["id"] for r in got] == ids
        return done, got


def output_records(out_dir) -> list:
    """The records of `out_dir`/output.jsonl, in file order."""
    return [json.loads(line) for line in (Path(out_dir) / "output.jsonl").read_text().splitlines()]


def metrics_of(out_dir) -> dict:
    """The metrics file `out_dir`/metrics.json."""
    return json.loads((Path(out_dir) / "metrics.json").read_text())


def assert_fails_once_and_clearly(done, out_dir, fragments) -> None:
    """A run refused before any weight is read: exit 2, one "hpcinfer: error" line holding every fragment, no
    traceback, no output or metrics file in `out_dir`."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count("hpcinfer: error") == 1, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, f"{fragment!r} not in {done.stderr!r}"
    assert "Traceback" not in done.stderr
    out_dir = Path(out_dir)
    assert not (out_dir / "output.jsonl").exists() and not (out_dir / "metrics.json").exists()


def checkpoint_with_eos(ckpt, path, eos) -> Path:
    """A copy of checkpoint `ckpt` at `path` whose eos_token_ids are `eos` (sequences then stop at those tokens)."""
    import h5py
    import numpy as np

    path = Path(path)
    path.write_bytes(Path(ckpt).read_bytes())
    with h5py.File(path, "r+") as f:
        f.attrs["eos_token_ids"] = np.asarray(sorted(eos), dtype=np.int64)
    return path


def cut_at_eos(records: list, eos) -> list:
    """Output records as a run with these EOS ids writes them: each cut after its first EOS token, "stop"."""
    expected = []
    for r in records:
        tokens = r["output_tokens"]
        stop = next((k for k, t in enumerate(tokens) if t in eos), None)
        expected.append(dict(r, output_tokens=tokens[:stop + 1], finish_reason="stop") if stop is not None else r)
    return expected


def tiny_llama_job(root, prompt_lengths, seed: int = 3) -> Path:
    """`root` holding m.h5 (hf_models' llama_mha, converted) and p.jsonl (random prompts of these lengths, ids 0,
    1, ...): the job folder that `run_tiny_llama` runs."""
    import numpy as np

    from hf_models import save_tiny_model
    from hpcinfer.checkpoint.hf import convert_hf

    root = Path(root)
    convert_hf(str(save_tiny_model("llama_mha", root / "hf")), str(root / "m.h5"))
    rng = np.random.default_rng(seed)
    (root / "p.jsonl").write_text("".join(json.dumps({"id": i, "tokens": rng.integers(0, 256, n).tolist()}) + "\n"
                                          for i, n in enumerate(prompt_lengths)))
    return root


def run_tiny_llama(run_cli, cwd, root, out, n, sets, max_new: int, metrics=None) -> str:
    """`hpcinfer run` of the `tiny_llama_job` in `root` (run_job with its checkpoint and prompts)."""
    root = Path(root)
    return run_job(run_cli, cwd, root / "m.h5", root / "p.jsonl", out, n, sets, max_new, metrics)


def job_config(path, checkpoint, prompts, out, max_new: int, model: str = "", metrics=None) -> Path:
    """Write a `[generate]` run config of `checkpoint` (extra `[model]` lines in `model`) at `path`, EOS ignored."""
    Path(path).write_text(f'[model]\ncheckpoint = "{checkpoint}"\n{model}[generate]\nprompts = "{prompts}"\n'
                          f'output = "{out}"\nmax_new_tokens = {max_new}\nignore_eos = true\n'
                          + (f'metrics = "{metrics}"\n' if metrics is not None else ""))
    return Path(path)


def run_job(run_cli, cwd, checkpoint, prompts, out, n, sets, max_new: int, metrics=None) -> str:
    """`hpcinfer run` of `checkpoint` on the token prompts file on n ranks with these --set overrides, EOS ignored,
    writing `out` (and the metrics to `metrics` if given); asserts exit 0 and returns the output's text."""
    config = job_config(Path(out).with_suffix(".toml"), checkpoint, prompts, out, max_new, metrics=metrics)
    args = ["run", str(config)] + [a for s in sets for a in ("--set", s)]
    done = run_cli(args, n=n, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return Path(out).read_text()
