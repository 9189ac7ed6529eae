"""Pipeline parallelism end to end, in subprocesses: `hpcinfer run` on 1, 2, 4 and 8 ranks must write exactly
what one rank writes, for every (pp, dp, tp) layout, micro-batch counts, KV offload and early stopping at EOS.

One tiny 4-layer Llama (multi-head, tied head, biases: tests/helpers/hf_models.py's llama_mha with 4 layers instead of
2, so pp = 4 has a layer per stage) is built and converted once per module. 8 prompts of mixed lengths run in
batches of 4, so dp = 2 gives each replica a batch. The 8-rank layouts are oversubscribed and marked slow.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


from cli_helpers import (CliJob, assert_fails_once_and_clearly, checkpoint_with_eos, cut_at_eos, metrics_of,
                         output_records, write_token_prompts)
from hf_models import save_tiny_model
from hpcinfer.checkpoint.hf import convert_hf  # noqa: E402
from hpcinfer.quant.kv import kv_bytes_per_token  # noqa: E402

VOCAB, LAYERS, KV_HEADS, HEAD_DIM = 256, 4, 4, 16
PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11, 4, 7)
BATCH = 4
MAX_NEW = 6
BAD_TIMEOUT = 60
MESH_LINE = re.compile(r"rank (\d+) \(node (\d+)\): stage (\d+), dp replica (\d+), tp rank (\d+)")


class Job(CliJob):
    """The module's 4-layer checkpoint, prompts and config."""

    def __init__(self, root: Path, run_cli, cwd: Path):
        ckpt = root / "tiny4.h5"
        arch = convert_hf(save_tiny_model("llama_mha", root / "hf", num_layers=LAYERS), str(ckpt))
        assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
        self.eos = tuple(arch.eos_token_ids)
        write_token_prompts(root / "prompts.jsonl", PROMPT_LENGTHS, VOCAB)
        super().__init__(root, run_cli, cwd, ckpt, root / "prompts.jsonl", MAX_NEW, BATCH, "ignore_eos = false\n")


@pytest.fixture(scope="module")
def job(tmp_path_factory, run_cli, repo_root):
    return Job(tmp_path_factory.mktemp("pipeline"), run_cli, repo_root)


def mesh_rows(stdout: str) -> list[tuple[int, ...]]:
    """(rank, node, stage, dp replica, tp rank) of every mesh line `hpcinfer run` prints."""
    return [tuple(map(int, m.groups())) for m in map(MESH_LINE.search, stdout.splitlines()) if m]


def expected_mesh(n: int, pp: int, tp: int, ranks_per_node: int) -> list[tuple[int, ...]]:
    """world rank = (stage * dp + replica) * tp + tp rank (tp fastest, then dp, then pp); nodes in blocks."""
    dp = n // (pp * tp)
    return [(r, r // ranks_per_node, r // (dp * tp), r // tp % dp, r % tp) for r in range(n)]


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """One rank, one stage: (CompletedProcess, output folder)."""
    out = tmp_path_factory.mktemp("reference")
    done, got = job.run_reference(out)
    assert all(1 <= len(r["output_tokens"]) <= MAX_NEW for r in got)
    assert len({tuple(r["output_tokens"]) for r in got}) == len(got)          # the tokens vary
    return done, out


def check_pipeline_metrics(out: Path, n: int, pp: int, tp: int, expected_records: list[dict]) -> dict:
    metrics = metrics_of(out)
    mesh = metrics["mesh"]
    assert (mesh["world"], mesh["pp"], mesh["dp"], mesh["tp"]) == (n, pp, n // (pp * tp), tp)
    stages = metrics["pipeline"]["stages"]
    assert [row["stage"] for row in stages] == list(range(pp))
    for row in stages:
        assert 0.0 <= row["bubble_fraction"] < 1.0, row
        assert row["busy_s"] > 0.0
    assert 0.0 <= metrics["pipeline"]["bubble_fraction"] < 1.0
    assert metrics["pipeline"]["prompt_phase_s"] > 0.0
    assert metrics["generated_tokens"] == sum(len(r["output_tokens"]) for r in expected_records)
    assert metrics["prompt_tokens"] == sum(PROMPT_LENGTHS)
    return metrics


# --------------------------------------------------------------------------------------------------- layouts

# id: (ranks, overrides, pp, tp, ranks per node)
LAYOUTS = {
    "n2-pp2": (2, ["parallel.pp=2"], 2, 1, 2),
    "n2-pp2-hybrid-4-1": (2, ["parallel.pp=2", "schedule.prompt_micro_batches=4", "schedule.gen_micro_batches=1"],
                          2, 1, 2),
    "n2-pp2-hybrid-1-4": (2, ["parallel.pp=2", "schedule.prompt_micro_batches=1", "schedule.gen_micro_batches=4"],
                          2, 1, 2),
    "n4-pp2-tp2": (4, ["parallel.pp=2", "parallel.tp=2"], 2, 2, 4),
    "n4-pp4": (4, ["parallel.pp=4"], 4, 1, 4),
    "n4-pp2-dp2": (4, ["parallel.pp=2"], 2, 1, 4),
    "n4-pp2-two-nodes": (4, ["parallel.pp=2", "parallel.ranks_per_node=2"], 2, 1, 2),
    # batches of 3, 3 and 2: the last batch caps its 3 micro-batches at its 2 sequences
    "n2-pp2-batch3-remainder": (2, ["parallel.pp=2", "generate.batch_size=3", "schedule.prompt_micro_batches=3",
                                    "schedule.gen_micro_batches=3"], 2, 1, 2),
    "n8-pp2-tp2-dp2": pytest.param(8, ["parallel.pp=2", "parallel.tp=2"], 2, 2, 8, marks=pytest.mark.slow),
    "n8-pp4-tp2": pytest.param(8, ["parallel.pp=4", "parallel.tp=2"], 4, 2, 8, marks=pytest.mark.slow),
}


@pytest.mark.parametrize("n, overrides, pp, tp, ranks_per_node", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_pipeline_layout_writes_what_one_rank_writes(job, reference, tmp_path, n, overrides, pp, tp,
                                                           ranks_per_node):
    done = job.run(tmp_path, *overrides, n=n, timeout=180 if n == 8 else 120)
    assert done.returncode == 0, done.stderr
    dp = n // (pp * tp)
    assert f"{n} ranks on {n // ranks_per_node} node(s), mesh pp={pp} dp={dp} tp={tp}" in done.stdout
    assert mesh_rows(done.stdout) == expected_mesh(n, pp, tp, ranks_per_node)
    assert (tmp_path / "output.jsonl").read_text() == (reference[1] / "output.jsonl").read_text()
    check_pipeline_metrics(tmp_path, n, pp, tp, output_records(reference[1]))
    assert "hpcinfer: pipeline: stage 0 busy" in done.stdout


def test_a_replica_with_no_prompt_keeps_its_stages_in_step(job, reference, tmp_path):
    """pp = 2, dp = 2 and one prompt: replica 1's share is empty, and its first stage passes its commit point before
    telling its second stage to stop (they once passed each other: a TypeError in BatchRounds.end)."""
    one = tmp_path / "one.jsonl"
    one.write_text((job.root / "prompts.jsonl").read_text().splitlines(keepends=True)[0])
    done = job.run(tmp_path, "parallel.pp=2", f'generate.prompts="{one}"', n=4)
    assert done.returncode == 0, done.stderr
    assert output_records(tmp_path) == output_records(reference[1])[:1]


def test_the_mesh_of_two_stages_by_hand(job, tmp_path):
    """pp=2 puts rank 0 on stage 0 and rank 1 on stage 1; with tp=2, ranks 0-1 are stage 0 and 2-3 stage 1."""
    done = job.run(tmp_path / "a", "parallel.pp=2", n=2)
    assert done.returncode == 0, done.stderr
    assert [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("rank ")] == [
        "rank 0 (node 0): stage 0, dp replica 0, tp rank 0",
        "rank 1 (node 0): stage 1, dp replica 0, tp rank 0"]
    done = job.run(tmp_path / "b", "parallel.pp=2", "parallel.tp=2", n=4)
    assert done.returncode == 0, done.stderr
    assert [row[2] for row in mesh_rows(done.stdout)] == [0, 0, 1, 1]          # the stage column
    assert [row[4] for row in mesh_rows(done.stdout)] == [0, 1, 0, 1]          # the tp column


# ----------------------------------------------------------------------------------------------- KV offload

def offload_threshold() -> int:
    """pp=2: 2 layers a stage, one of them pooled (parity). Room for the resident layer's 4 sequences plus 2 in
    the pooled one (a micro-batch: 4 prompts / 2), at the longest sequence of any batch."""
    longest = max(PROMPT_LENGTHS) + MAX_NEW
    per_seq_layer = kv_bytes_per_token(KV_HEADS, HEAD_DIM, 1) * longest
    return (BATCH * 1 + 2) * per_seq_layer


def test_kv_offload_on_two_stages(job, reference, tmp_path):
    threshold = offload_threshold()
    done = job.run(tmp_path, "parallel.pp=2", f"schedule.kv_offload_threshold={threshold}", n=2)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "output.jsonl").read_text() == (reference[1] / "output.jsonl").read_text()
    metrics = check_pipeline_metrics(tmp_path, 2, 2, 1, output_records(reference[1]))
    kv = metrics["kv_cache"]
    assert kv["offloaded_bytes_to_host"] > 0 and kv["fetched_bytes_to_device"] > 0
    assert 0 < kv["peak_device_bytes_per_rank"] <= threshold
    # without offload the first batch's cache alone (4 sequences x 4 layers / 2 stages) is above the threshold
    plain = tmp_path / "plain"
    done = job.run(plain, "parallel.pp=2", n=2)
    assert done.returncode == 0, done.stderr
    assert metrics_of(plain)["kv_cache"]["peak_device_bytes_per_rank"] > threshold
    assert metrics_of(plain)["kv_cache"]["offloaded_bytes_to_host"] == 0


def test_kv_offload_with_one_layer_per_stage(job, reference, tmp_path):
    """pp=4 on 4 layers, tp=1, one node: rank s holds layer s and offloads layers of parity s % 2, i.e. its own.
    The threshold leaves room for 2 of a batch's 4 sequences (micro-batches of 1)."""
    per_seq_layer = kv_bytes_per_token(KV_HEADS, HEAD_DIM, 1) * (max(PROMPT_LENGTHS) + MAX_NEW)
    threshold = 2 * per_seq_layer
    done = job.run(tmp_path, "parallel.pp=4", f"schedule.kv_offload_threshold={threshold}", n=4)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "output.jsonl").read_text() == (reference[1] / "output.jsonl").read_text()
    kv = metrics_of(tmp_path)["kv_cache"]
    assert kv["offloaded_bytes_to_host"] > 0 and kv["peak_device_bytes_per_rank"] <= threshold


# -------------------------------------------------------------------------------------- early stopping (EOS)

@pytest.fixture(scope="module")
def eos_job(job, reference):
    """A copy of the checkpoint with more EOS ids, taken from the reference run: the 1st token of prompt 1 (it
    stops in the prompt phase), the 3rd of prompt 2 and the 4th of prompt 5. Returns (checkpoint, expected
    records): the reference cut after the first EOS token of each sequence, with finish_reason "stop"."""
    ref = output_records(reference[1])
    eos = set(job.eos) | {ref[1]["output_tokens"][0], ref[2]["output_tokens"][2], ref[5]["output_tokens"][3]}
    path = checkpoint_with_eos(job.ckpt, job.root / "tiny4-eos.h5", eos)
    expected = cut_at_eos(ref, eos)
    lengths = [len(r["output_tokens"]) for r in expected]
    assert lengths[1] == 1 and lengths[2] <= 3 and lengths[5] <= 4, lengths
    assert len(set(lengths)) >= 3 and "length" in {r["finish_reason"] for r in expected}, expected
    return path, expected


EOS_LAYOUTS = {
    "n1": (1, []),
    "n2-pp2": (2, ["parallel.pp=2"]),
    "n2-pp2-gen4": (2, ["parallel.pp=2", "schedule.prompt_micro_batches=2", "schedule.gen_micro_batches=4"]),
    "n4-pp4": (4, ["parallel.pp=4"]),
    "n4-pp2-tp2": (4, ["parallel.pp=2", "parallel.tp=2"]),
}


@pytest.mark.parametrize("n, overrides", EOS_LAYOUTS.values(), ids=EOS_LAYOUTS.keys())
def test_sequences_stop_at_eos_in_a_pipelined_batch(job, eos_job, tmp_path, n, overrides):
    path, expected = eos_job
    done = job.run(tmp_path, f'model.checkpoint="{path}"', *overrides, n=n)
    assert done.returncode == 0, done.stderr
    assert output_records(tmp_path) == expected
    assert metrics_of(tmp_path)["generated_tokens"] == sum(len(r["output_tokens"]) for r in expected)


# ------------------------------------------------------------------------------------------------- failures

@pytest.mark.parametrize("n, pp, rank", [(2, 2, 1), (2, 2, 0), (4, 4, 2)], ids=["last-stage", "first-stage",
                                                                               "middle-stage"])
def test_a_failing_stage_brings_every_rank_down(job, tmp_path, n, pp, rank):
    """HPCINFER_FAIL_RANK makes one rank fail after loading its weights while the others wait on it in the
    schedule: the job must end (not hang) with that rank's message and no output."""
    start = time.monotonic()
    done = job.run(tmp_path, f"parallel.pp={pp}", n=n, timeout=30, env={"HPCINFER_FAIL_RANK": str(rank)})
    assert time.monotonic() - start < 30
    assert done.returncode != 0
    assert f"injected failure on rank {rank}" in done.stderr, done.stderr
    assert f"hpcinfer: internal error on rank {rank}" in done.stderr
    assert not (tmp_path / "output.jsonl").exists() and not (tmp_path / "metrics.json").exists()


# ------------------------------------------------------------------------------------------------ bad input
# id: (ranks, overrides, fragments the single error message must hold)
BAD = {
    "pp-above-layers": (2, ["parallel.pp=5"], ["pp = 5", f"model's {LAYERS} layers"]),
    "pp-above-layers-n1": (1, ["parallel.pp=8"], ["pp = 8", f"model's {LAYERS} layers"]),
    "world-not-multiple-of-pp": (3, ["parallel.pp=2"], ["world size 3", "tp * pp = 1 * 2", "multiple of 2"]),
    "world-not-multiple-of-tp-pp": (2, ["parallel.pp=2", "parallel.tp=2"],
                                    ["world size 2", "tp * pp = 2 * 2", "multiple of 4"]),
    "prompt-micro-batches-above-batch": (2, ["parallel.pp=2", "schedule.prompt_micro_batches=5"],
                                         ["schedule.prompt_micro_batches = 5", f"batch_size = {BATCH}"]),
    "gen-micro-batches-above-batch": (2, ["parallel.pp=2", "schedule.gen_micro_batches=9"],
                                      ["schedule.gen_micro_batches = 9", f"batch_size = {BATCH}"]),
    "gen-micro-batches-negative": (2, ["parallel.pp=2", "schedule.gen_micro_batches=-1"],
                                   ["schedule.gen_micro_batches = -1", ">= 0"]),
    "ranks-per-node-not-dividing": (4, ["parallel.pp=2", "parallel.ranks_per_node=3"],
                                    ["ranks_per_node = 3", "does not divide the world size 4"]),
    "ranks-per-node-splits-tp": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.ranks_per_node=1"],
                                 ["ranks_per_node = 1", "split a tensor-parallel group of tp = 2"]),
    "kv-offload-threshold-too-small": (2, ["parallel.pp=2", "schedule.kv_offload_threshold=1000"],
                                       ["kv_offload_threshold = 1000 bytes"]),
}


@pytest.mark.parametrize("n, overrides, fragments", BAD.values(), ids=BAD.keys())
def test_bad_pipeline_input_fails_once_and_clearly(job, tmp_path, n, overrides, fragments):
    done = job.run(tmp_path, *overrides, n=n, timeout=BAD_TIMEOUT)
    assert_fails_once_and_clearly(done, tmp_path, fragments)
