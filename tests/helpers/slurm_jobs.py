"""Running jobs/ scripts through sbatch on a test cluster (slurm_cluster.SlurmCluster): the job's environment,
prompt files, submission and what to read back (tests/slurm/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hpcinfer
from cli_helpers import clean_env

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
SMOLLM2 = ROOT / "models" / "smollm2.h5"
VOCAB = 256                                   # the tiny llama_mha


def job_env(**extra) -> dict:
    """The environment a test submits with (sbatch exports it whole): this tree's hpcinfer, the running venv, no
    launcher variables of a surrounding mpiexec."""
    return clean_env(extra={"PYTHONPATH": str(Path(hpcinfer.__file__).resolve().parents[1]),
                            "VENV": sys.prefix, **extra})


def sets(*items) -> str:
    """HPCINFER_SET: `section.key=value` items, space separated (so no value may hold a space)."""
    assert not any(" " in str(item) for item in items), items
    return " ".join(map(str, items))


def token_prompts(path: Path, count: int, length: int = 4) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [(7 * i + j) % VOCAB for j in range(length)]})
                            + "\n" for i in range(count)))
    return path


def submit(cluster, script: str, out: Path, env: dict, *options: str) -> tuple[str, Path]:
    """sbatch jobs/SCRIPT from the repository root with its log in `out`; returns (job id, log path). Options come
    before the script, so they override its #SBATCH lines."""
    log = out / "slurm-%j.out"
    job = cluster.sbatch([f"--output={log}", *options, str(JOBS / script)], env=env, cwd=ROOT)
    return job, out / f"slurm-{job}.out"


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def output_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]
