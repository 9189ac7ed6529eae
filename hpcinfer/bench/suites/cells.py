"""One cell of a suite = one `hpcinfer run` job: its generated config, its launch under the configured launcher
(mpiexec by default, srun on a Slurm allocation), and the figures read back from the job's metrics JSON.

Each cell is a fresh job so that it measures exactly what a user's `mpiexec -n N python -m hpcinfer run` measures
(the real CLI, its own ranks and mesh, its own weight load outside the timed part) and so that cells of different
rank counts can follow one another from one driver process (docs/bench.md, "How cells are launched").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...comm.mpi_library import launcher_free_env
from .config import Layout, Suite

@dataclass(frozen=True)
class Cell:
    suite: Suite
    layout: Layout
    batch: int
    variant: str                 # "hpcinfer", a naive baseline ("one-hot MoE dispatch", "flat all-to-all",
                                 # "row-by-row offload"), or "CUDA graphs" (the tuned path whose baseline is
                                 # the hpcinfer cell: graphs are off by default)
    extra: dict                  # {section: {key: value}} on top of the suite's config (the variant's switch)
    moe: bool = False            # an MoE model: data-parallel replicas split every batch (they step together)
    skip: str = ""               # why the cell does not run ("" = it runs)
    backend: str = "numpy"       # [runtime] backend written into the job's config (resolved: numpy or cupy)

    @property
    def key(self) -> str:
        return f"{self.suite.name} | {self.layout.name} | batch {self.batch} | {self.variant}"


def toml_text(sections: dict) -> str:
    """{section: {key: value}} as TOML (flat tables; str/int/float/bool values)."""
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            text = ("true" if value else "false") if isinstance(value, bool) else \
                json.dumps(value) if isinstance(value, (str, int, float)) else None
            if text is None:
                raise TypeError(f"[{name}] {key} = {value!r}: not a TOML scalar")
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def job_sections(cell: Cell, prompts: Path, workdir: Path, tag: str, threads: int) -> dict:
    """The `hpcinfer run` config of a cell (docs/config.md)."""
    lay, suite, model = cell.layout, cell.suite, cell.suite.model
    per_replica = cell.batch if cell.moe else cell.batch // lay.dp     # MoE replicas split every batch
    sections = {
        "model": {"checkpoint": str(Path(model.checkpoint).resolve())} if model.checkpoint else
                 {"preset": model.preset},
        "parallel": {k: getattr(lay, k) for k in ("tp", "pp", "ep", "expert_tp", "ranks_per_node")},
        "schedule": {k: getattr(lay, k) for k in ("prompt_micro_batches", "gen_micro_batches")},
        "runtime": {"threads": threads, "backend": cell.backend},
        "generate": {"prompts": str(prompts), "output": str(workdir / f"{tag}.jsonl"),
                     "max_new_tokens": suite.new_tokens, "batch_size": per_replica, "temperature": 0.0,
                     "ignore_eos": True, "metrics": str(workdir / f"{tag}.metrics.json")},
    }
    sections["model"]["dtype"] = model.dtype
    if lay.all_to_all:
        sections["moe"] = {"all_to_all": lay.all_to_all}
    if suite.offload:
        sections["offload"] = dict(suite.offload)
    for name, table in cell.extra.items():
        sections.setdefault(name, {}).update(table)
    return sections


def launch_argv(launcher: tuple, python: str, ranks: int, config: Path) -> list[str]:
    """`launcher` with {ranks} filled in (default: the mpiexec beside the interpreter), then hpcinfer run."""
    python = python or sys.executable
    if not launcher:
        beside = Path(python).parent / "mpiexec"
        launcher = (str(beside) if beside.exists() else "mpiexec", "-n", "{ranks}")
    return [part.replace("{ranks}", str(ranks)) for part in launcher] + [python, "-m", "hpcinfer", "run",
                                                                           str(config)]


def run_job(argv: list[str], timeout_s: int, log_path: Path, extra_env: dict | None = None) -> tuple[int, str]:
    """Run one job in its own process group (killed whole when it overruns); (exit code, output). extra_env: more
    environment variables for it."""
    env = launcher_free_env(os.environ)
    env["MPIEXEC_TIMEOUT"] = str(timeout_s)
    env.update(extra_env or {})
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s + 15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\nbench: killed after {timeout_s + 15} s"
        proc.returncode = 124
    log_path.write_text(out)
    return proc.returncode, out


def error_line(output: str) -> str:
    """The job's own error message (hpcinfer: error: ...), else its last line."""
    lines = [x for x in output.splitlines() if x.strip()]
    for line in lines:
        if "error" in line.lower():
            return line.strip()[:500]
    return (lines[-1].strip() if lines else "no output")[:500]


def run_cell(cell: Cell, prompts: Path, workdir: Path, tag: str, cfg) -> dict:
    """One job of `cell`: {"status": "ok", "metrics", "tokens", "wall_s"} or {"status": "rejected"|"failed",
    "error"}. Exit 2 is hpcinfer's set-up error (the layout or batch does not fit): "rejected"."""
    config = workdir / f"{tag}.toml"
    config.write_text(toml_text(job_sections(cell, prompts, workdir, tag, cfg.threads)))
    argv = launch_argv(cfg.launcher, cfg.python, cell.layout.ranks, config)
    t0 = time.perf_counter()
    code, output = run_job(argv, cfg.timeout_s, workdir / f"{tag}.log")
    wall = time.perf_counter() - t0
    metrics = workdir / f"{tag}.metrics.json"
    if code != 0 or not metrics.is_file():
        return {"status": "rejected" if code == 2 else "failed", "error": error_line(output), "exit_code": code,
                "command": " ".join(argv)}
    tokens = {}
    for line in (workdir / f"{tag}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        tokens[rec["id"]] = rec["output_tokens"]
    return {"status": "ok", "metrics": json.loads(metrics.read_text()), "tokens": tokens, "wall_s": wall,
            "command": " ".join(argv)}
