"""Every jobs/*.slurm that fits the test cluster, submitted with sbatch as the script stands (its #SBATCH lines,
lib.sh's `srun --mpi=pmi2`): the job's end state, its output file and the lines of its log. Smaller inputs come in
through the variables of lib.sh (HPCINFER_SET, HPCINFER_MODEL, HPCINFER_OUT), as a user would pass them.

One node (16 CPUs and a GPU declared): demo.slurm, offload-1gpu.slurm; requeue.slurm has its own file
(test_slurm_requeue.py). Two nodes (two slurmd on this host): pipeline-2node.slurm, embed-dp.slurm.
moe-1.3b-128.slurm asks for 16 nodes x 8 ranks: it is not run here (tests/cli/test_jobs.py runs it scaled down).
A two-node job whose log shows the third-party MPI start-up fault of slurm_jobs.MPI_START_FAILURES is started
again (3 starts at most); any other failure fails the test.
"""

from __future__ import annotations

import json

import pytest

from slurm_jobs import JOBS, SMOLLM2, job_env, output_ids, read_log, sets, submit, submit_started, token_prompts

ONE_NODE = {"demo.slurm", "offload-1gpu.slurm", "requeue.slurm"}
TWO_NODES = {"pipeline-2node.slurm", "embed-dp.slurm"}
NOT_HERE = {"moe-1.3b-128.slurm": "16 nodes x 8 ranks"}


def test_every_script_is_run_or_said_why_not():
    assert {p.name for p in JOBS.glob("*.slurm")} == ONE_NODE | TWO_NODES | set(NOT_HERE)


def _chat_prompts(path, ids):
    """The prompts of inputs/demo.jsonl with these ids, in this order."""
    lines = {json.loads(line)["id"]: line for line in (JOBS.parent / "inputs" / "demo.jsonl").read_text().splitlines()}
    path.write_text("".join(lines[i] + "\n" for i in ids))
    return path


def _assert_completed(cluster, job, log, timeout=None, info=None) -> str:
    """The job's log, once it ended COMPLETED with exit code 0 and no restart (info: its record, if waited for)."""
    info = info if info is not None else cluster.wait_done(job, timeout=timeout)
    text = read_log(log)
    if (info["JobState"], info["ExitCode"], info["Restarts"]) != ("COMPLETED", "0:0", "0"):
        pytest.fail(f"job {job}: {info}\n--- its log ---\n{text}\n--- the daemons' logs ---\n{cluster.log_tails()}")
    assert "error" not in text.lower().replace("stderr", ""), text
    return text


def _need(path):
    if not path.exists():
        pytest.skip(f"no {path}: `make test` builds it")


def test_demo(slurm, tmp_path):
    """SmolLM2 on 2 ranks: srun --mpi=pmi2 makes one world of 2 (not two singletons), and the answer is right."""
    _need(SMOLLM2)
    prompts = _chat_prompts(tmp_path / "p.jsonl", ["capital", "gravity"])
    env = job_env(HPCINFER_OUT=str(tmp_path),
                  HPCINFER_SET=sets(f"generate.prompts={prompts}", f"generate.output={tmp_path}/demo.jsonl",
                                    f"generate.metrics={tmp_path}/m.json", "generate.max_new_tokens=8"))
    job, log = submit(slurm, "demo.slurm", tmp_path, env)
    text = _assert_completed(slurm, job, log, timeout=180)
    assert "hpcinfer: 2 ranks on 1 node(s), mesh pp=1 dp=2 tp=1, 1 BLAS thread(s) per rank" in text, text
    assert "tokens generated for 2 prompts in" in text, text
    records = [json.loads(line) for line in (tmp_path / "demo.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["capital", "gravity"]
    assert "Paris" in records[0]["text"], records[0]
    assert json.loads((tmp_path / "m.json").read_text())["mesh"]["world"] == 2


def test_offload_1gpu(slurm, tmp_path):
    """The offload script's allocation as written (1 task, 16 CPUs, 96 GB, a GPU) on the declared node; the
    tiny-dense preset streamed from host and disk on the CPU backend."""
    token_prompts(tmp_path / "offload-1gpu-prompts.jsonl", 16)      # the script makes it only when missing
    env = job_env(HPCINFER_OUT=str(tmp_path), DISK_DIR=str(tmp_path / "disk"),
                  HPCINFER_SET=sets('model.preset="tiny-dense"', "generate.max_new_tokens=2",
                                    'offload.device_memory="1GB"', 'offload.host_memory="1GB"'))
    job, log = submit(slurm, "offload-1gpu.slurm", tmp_path, env)
    text = _assert_completed(slurm, job, log, timeout=180)
    info = slurm.job(job)
    assert "gres/gpu=1" in info.get("TRES", "") or "gpu:1" in info.get("TresPerTask", ""), info
    assert "offload:" in text and "cost model predicted" in text, text
    assert len(output_ids(tmp_path / "offload-1gpu.jsonl")) == 16
    assert not (tmp_path / "disk").exists()                          # the script's trap cleans its disk tier


def test_pipeline_2node(slurm_2node, tiny_tp3_ckpt, tmp_path):
    """tp = 3 inside each node, pp = 2 across the two (inputs/pipeline.toml): Slurm puts ranks 0-2 on n1 and 3-5 on
    n2, and MPI sees the same 2 nodes (PMI-2's process mapping)."""
    prompts = token_prompts(tmp_path / "p.jsonl", 3)
    env = job_env(HPCINFER_MODEL=str(tiny_tp3_ckpt), HPCINFER_OUT=str(tmp_path),
                  HPCINFER_SET=sets(f"generate.prompts={prompts}", f"generate.output={tmp_path}/pp.jsonl",
                                    f"generate.metrics={tmp_path}/m.json", "generate.max_new_tokens=4"))
    job, log, info = submit_started(slurm_2node, "pipeline-2node.slurm", tmp_path, env, timeout=240)
    text = _assert_completed(slurm_2node, job, log, info=info)
    assert slurm_2node.job(job)["NodeList"] == "n[1-2]"
    assert "hpcinfer: 6 ranks on 2 node(s), mesh pp=2 dp=1 tp=3" in text, text
    for rank in range(6):
        assert f"rank {rank} (node {rank // 3}): stage {rank // 3}" in text, text
    assert "hpcinfer: pipeline: stage 0 busy" in text, text
    assert output_ids(tmp_path / "pp.jsonl") == ["p0", "p1", "p2"]


def test_embed_dp_2node(slurm_2node, tiny_bert_ckpt, tmp_path):
    """An encoder, one data-parallel replica per rank, 2 nodes x 2 ranks."""
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"e{i}", "text": t}) + "\n"
                              for i, t in enumerate(["a man is eating", "the girl", "two men", "hi", "a dog"])))
    env = job_env(HPCINFER_MODEL=str(tiny_bert_ckpt), EMBED_INPUTS=str(inputs), HPCINFER_OUT=str(tmp_path),
                  HPCINFER_SET=sets("embed.batch_size=2", "embed.max_length=32"))
    job, log, info = submit_started(slurm_2node, "embed-dp.slurm", tmp_path, env, timeout=180)
    text = _assert_completed(slurm_2node, job, log, info=info)
    assert slurm_2node.job(job)["NodeList"] == "n[1-2]"
    assert "hpcinfer: 4 ranks on 2 node(s), mesh pp=1 dp=4 tp=1" in text, text
    assert "hpcinfer: 5 inputs (" in text and (tmp_path / "embeddings.h5").exists(), text
