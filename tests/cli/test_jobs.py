"""jobs/: every Slurm script parses (`bash -n`), shares its steps through jobs/lib.sh, and runs here through
jobs/run_local.sh (mpiexec instead of srun) with a tiny model; the requeue script stops on SIGUSR1, requeues
itself (a stub `scontrol` records it) and its second start finishes the prompts exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import clean_env, run_command

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
SCRIPTS = sorted(p.name for p in JOBS.glob("*.slurm"))
VOCAB = 256                                   # the tiny llama_mha and the tiny presets


def test_the_five_scripts_are_there():
    assert {"demo.slurm", "pipeline-2node.slurm", "moe-1.3b-128.slurm", "offload-1gpu.slurm",
            "requeue.slurm", "embed-dp.slurm"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS + ["lib.sh", "run_local.sh"])
def test_bash_n(name):
    done = subprocess.run(["bash", "-n", str(JOBS / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_share_their_steps(name):
    """The launcher lives in lib.sh only: a script sources it and starts its ranks through hpcinfer_run*."""
    code = [line for line in (JOBS / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    assert any(line.startswith("source jobs/lib.sh") for line in code)
    assert not any("srun" in line or "mpiexec" in line for line in code), name
    assert any(line.startswith("hpcinfer_run") for line in code)


def run_local(script, env: dict, *args, timeout=120):
    cmd = ["bash", str(JOBS / "run_local.sh"), *args, str(script)]
    return run_command(cmd, timeout=timeout, env=clean_env(extra=env), cwd=str(ROOT))


@pytest.mark.parametrize("args, extra, ranks", [([], {}, 4), ([], {"HPCINFER_LOCAL_RANKS": "2"}, 2),
                                                (["-n", "3"], {}, 3)])
def test_run_local_scales_the_allocation(tmp_path, args, extra, ranks):
    script = tmp_path / "probe.slurm"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=3\nset -eu\n"
                      "cd \"$SLURM_SUBMIT_DIR\"\nsource jobs/lib.sh\n"
                      "echo \"ntasks=$SLURM_NTASKS launch=${LAUNCH[*]} out=$HPCINFER_OUT\"\n")
    env = {"HPCINFER_LOCAL_RANKS": "8", **extra}
    done = run_local(script, env, *args, timeout=30)
    assert done.returncode == 0, done.stderr
    assert f"ntasks={ranks} " in done.stdout and f"mpiexec -n {ranks} " in done.stdout


# ------------------------------------------------------------------------------------- the scripts, run here

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A converted tiny llama_mha checkpoint and a prompt file of token ids."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp("jobs")
    ckpt = root / "tiny.h5"
    convert_hf(save_tiny_model("llama_mha", root / "hf"), str(ckpt), "float32")
    return ckpt


def token_prompts(path: Path, count: int, length: int = 4) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [(7 * i + j) % VOCAB for j in range(length)]})
                            + "\n" for i in range(count)))
    return path


def output_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def sets(*items) -> str:
    return " ".join(items)


def test_demo_script(tiny, tmp_path):
    prompts = token_prompts(tmp_path / "p.jsonl", 4)
    env = {"HPCINFER_MODEL": str(tiny), "HPCINFER_OUT": str(tmp_path),
           "HPCINFER_SET": sets(f"generate.prompts={prompts}", f"generate.output={tmp_path}/demo.jsonl",
                                f"generate.metrics={tmp_path}/m.json", "generate.max_new_tokens=2")}
    done = run_local(JOBS / "demo.slurm", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 rank(s)" in done.stderr and output_ids(tmp_path / "demo.jsonl") == ["p0", "p1", "p2", "p3"]


def test_pipeline_script(tiny, tmp_path):
    prompts = token_prompts(tmp_path / "p.jsonl", 3)
    env = {"HPCINFER_MODEL": str(tiny), "HPCINFER_OUT": str(tmp_path), "HPCINFER_LOCAL_RANKS": "2",
           "HPCINFER_SET": sets("parallel.tp=1", "parallel.pp=2", f"generate.prompts={prompts}",
                                f"generate.output={tmp_path}/pp.jsonl", f"generate.metrics={tmp_path}/m.json",
                                "generate.max_new_tokens=2")}
    done = run_local(JOBS / "pipeline-2node.slurm", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pp=2" in done.stdout and output_ids(tmp_path / "pp.jsonl") == ["p0", "p1", "p2"]


def test_moe_script(tmp_path):
    token_prompts(tmp_path / "moe-1.3b-128-prompts.jsonl", 4)          # the script makes it only when missing
    env = {"HPCINFER_OUT": str(tmp_path), "HPCINFER_LOCAL_RANKS": "2",
           "HPCINFER_SET": sets('model.preset="tiny-moe"', "parallel.ep=2", "generate.batch_size=4",
                                f"generate.output={tmp_path}/moe.jsonl", f"generate.metrics={tmp_path}/m.json",
                                "generate.max_new_tokens=2")}
    done = run_local(JOBS / "moe-1.3b-128.slurm", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert output_ids(tmp_path / "moe.jsonl") == ["p0", "p1", "p2", "p3"]


def test_offload_script(tmp_path):
    token_prompts(tmp_path / "offload-1gpu-prompts.jsonl", 16)
    env = {"HPCINFER_OUT": str(tmp_path), "DISK_DIR": str(tmp_path / "disk"),
           "HPCINFER_SET": sets('model.preset="tiny-dense"', "generate.max_new_tokens=2",
                                'offload.device_memory="1GB"', 'offload.host_memory="1GB"')}
    done = run_local(JOBS / "offload-1gpu.slurm", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "offload:" in done.stdout and len(output_ids(tmp_path / "offload-1gpu.jsonl")) == 16
    assert "cost model predicted" in done.stdout and "a100-40gb-pcie4" in done.stdout     # the script's profile


def test_embed_script(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from encoder_models import save_tiny_encoder
    from hpcinfer.checkpoint.hf import convert_hf

    ckpt = tmp_path / "bert.h5"
    convert_hf(save_tiny_encoder("bert", tmp_path / "hf"), str(ckpt), "float32")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"e{i}", "text": t}) + "\n"
                              for i, t in enumerate(["a man is eating", "the girl", "two men", "hi"])))
    env = {"HPCINFER_MODEL": str(ckpt), "EMBED_INPUTS": str(inputs), "HPCINFER_OUT": str(tmp_path),
           "HPCINFER_LOCAL_RANKS": "2", "HPCINFER_SET": "embed.batch_size=2 embed.max_length=32"}
    done = run_local(JOBS / "embed-dp.slurm", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 rank(s)" in done.stderr and (tmp_path / "embeddings.h5").exists()


# ------------------------------------------------------------------------------------------------ requeue

def _has_restart() -> bool:
    done = subprocess.run([sys.executable, "-m", "hpcinfer", "run", "--help"], capture_output=True, text=True,
                          cwd=str(ROOT), env=clean_env())
    return "--restart" in done.stdout


@pytest.fixture
def scontrol(tmp_path):
    """A stub `scontrol` on PATH that records its arguments; returns (bin dir, log file)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n")
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir, log


def _requeue_env(tiny, tmp_path, bin_dir, prompts, output) -> dict:
    return {"HPCINFER_MODEL": str(tiny), "HPCINFER_OUT": str(tmp_path), "SLURM_JOB_ID": "4242",
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "HPCINFER_SET": sets(f"generate.prompts={prompts}", f"generate.output={output}",
                                 f"generate.metrics={tmp_path}/m.json", "generate.batch_size=1",
                                 "generate.max_new_tokens=12", "generate.ignore_eos=true")}


def test_requeue_script_finishes_without_a_signal(tiny, tmp_path, scontrol):
    bin_dir, log = scontrol
    prompts = token_prompts(tmp_path / "p.jsonl", 3)
    done = run_local(JOBS / "requeue.slurm", _requeue_env(tiny, tmp_path, bin_dir, prompts, tmp_path / "o.jsonl"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not log.exists() and output_ids(tmp_path / "o.jsonl") == ["p0", "p1", "p2"]


def test_requeue_on_usr1_then_resume(tiny, tmp_path, scontrol):
    if not _has_restart():
        pytest.skip("`hpcinfer run --help` has no --restart: resumable output and preemption (issue 8 part A) "
                    "are not in this tree yet")
    bin_dir, log = scontrol
    # enough rounds after the 2nd commit for SIGUSR1 to land mid-job: with 40 tiny-model prompts the job sometimes
    # finished before the signal arrived (no requeue: 1 run in 3 here)
    count = 400
    prompts, output = token_prompts(tmp_path / "p.jsonl", count), tmp_path / "o.jsonl"
    env = clean_env(extra=_requeue_env(tiny, tmp_path, bin_dir, prompts, output))
    cmd = ["bash", str(JOBS / "run_local.sh"), str(JOBS / "requeue.slurm")]
    job = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (output.exists() and output.read_text().count("\n") >= 2) and job.poll() is None:
            assert time.monotonic() < deadline, "no committed result within 60 s"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)                   # Slurm's --signal=B:USR1@120 reaches the batch shell
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stdout + stderr           # stopped cleanly and requeued: the batch step succeeds
    assert log.read_text().split() == ["requeue", "4242"], stderr
    first = output_ids(output)
    assert 0 < len(first) < count and first == [f"p{i}" for i in range(len(first))]

    again = run_local(JOBS / "requeue.slurm", _requeue_env(tiny, tmp_path, bin_dir, prompts, output), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert log.read_text().count("requeue") == 1          # the second start ran to the end: no new requeue
    assert output_ids(output) == [f"p{i}" for i in range(count)]
