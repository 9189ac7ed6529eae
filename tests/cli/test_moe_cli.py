"""MoE end to end, in subprocesses: `hpcinfer run` of a tiny Mixtral (tests/helpers/hf_models.py, converted once per
module) on 4 ranks (and 8, marked slow) writes exactly what one rank writes, for expert parallelism, expert-slicing,
tensor parallelism with the parallelism-coordinated all-to-all, the hierarchical all-to-all over two simulated nodes,
and pipeline stages. Mixtral has no capacity limit, so how the batch is split over replicas cannot change an answer.

Bad MoE input fails before any weight is read: exit 2, exactly one "hpcinfer: error" line naming the numbers, no
output file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import h5py  # noqa: E402

from hpcinfer.checkpoint.hf import convert_hf  # noqa: E402
from cli_helpers import (CliJob, assert_fails_once_and_clearly, checkpoint_with_eos, cut_at_eos,  # noqa: E402
                         output_records, write_token_prompts)
from moe_models import write_dense_gpt, write_ds_moe, write_pr_moe  # noqa: E402

PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11, 4, 7)
BATCH = 4
MAX_NEW = 6
ERROR = "hpcinfer: error"
BAD_TIMEOUT = 60


class Job(CliJob):
    """The module's Mixtral checkpoint, prompts and config."""

    def __init__(self, root: Path, run_cli, cwd: Path):
        from hf_models import save_tiny_model

        ckpt = root / "mixtral.h5"
        arch = convert_hf(save_tiny_model("mixtral", root / "hf"), str(ckpt))
        assert arch.moe_experts == (8, 8) and arch.moe_top_k == 2
        write_token_prompts(root / "prompts.jsonl", PROMPT_LENGTHS, arch.vocab_size)
        super().__init__(root, run_cli, cwd, ckpt, root / "prompts.jsonl", MAX_NEW, BATCH)


@pytest.fixture(scope="module")
def job(tmp_path_factory, run_cli, repo_root):
    return Job(tmp_path_factory.mktemp("moe-cli"), run_cli, repo_root)


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """One rank: the output file every layout must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    _, records = job.run_reference(out)
    assert len({tuple(r["output_tokens"]) for r in records}) == len(records)          # the tokens vary
    return (out / "output.jsonl").read_text()


# id: (ranks, overrides, mesh pp / dp / tp)
LAYOUTS = {
    "n4-ep4": (4, ["parallel.ep=4"], (1, 4, 1)),
    "n4-tp2-ep4-pcc": (4, ["parallel.tp=2", "parallel.ep=4", 'moe.all_to_all="pcc"'], (1, 2, 2)),
    "n4-ep2-etp2-hierarchical": (4, ["parallel.ep=2", "parallel.expert_tp=2", 'moe.all_to_all="hierarchical"',
                                     "parallel.ranks_per_node=2"], (1, 4, 1)),
    "n4-pp2-ep2": (4, ["parallel.pp=2", "parallel.ep=2"], (2, 2, 1)),
    "n8-tp2-ep8-pcc-hierarchical": pytest.param(
        8, ["parallel.tp=2", "parallel.ep=8", 'moe.all_to_all="pcc+hierarchical"', "parallel.ranks_per_node=4"],
        (1, 4, 2), marks=pytest.mark.slow),
    "n8-pp2-ep4": pytest.param(8, ["parallel.pp=2", "parallel.ep=4"], (2, 4, 1), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("n, overrides, mesh", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_moe_layout_writes_what_one_rank_writes(job, reference, tmp_path, n, overrides, mesh):
    done = job.run(tmp_path, *overrides, n=n, timeout=240 if n == 8 else 120)
    assert done.returncode == 0, done.stderr
    pp, dp, tp = mesh
    assert f"mesh pp={pp} dp={dp} tp={tp}" in done.stdout, done.stdout
    assert (tmp_path / "output.jsonl").read_text() == reference
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["mesh"]["pp"], metrics["mesh"]["dp"], metrics["mesh"]["tp"]) == mesh


@pytest.fixture(scope="module")
def eos_job(job, reference):
    """A copy of the Mixtral checkpoint with more EOS ids, taken from the reference run: the 1st token of prompt 1
    (it stops in the prompt phase), the 3rd of prompt 2 and the 4th of prompt 5. Returns (checkpoint, expected
    output records): the reference cut after the first EOS token of each sequence, finish_reason "stop"."""
    ref = [json.loads(line) for line in reference.splitlines()]
    eos = {2, ref[1]["output_tokens"][0], ref[2]["output_tokens"][2], ref[5]["output_tokens"][3]}
    path = checkpoint_with_eos(job.ckpt, job.root / "mixtral-eos.h5", eos)
    expected = cut_at_eos(ref, eos)
    lengths = [len(r["output_tokens"]) for r in expected]
    assert lengths[1] == 1 and lengths[2] <= 3 and lengths[5] <= 4, lengths
    return path, expected


@pytest.mark.parametrize("n, overrides", [(1, []), (4, ["parallel.ep=4"]),
                                          (4, ["parallel.pp=2", "parallel.ep=2"])], ids=["n1", "n4-ep4", "n4-pp2-ep2"])
def test_replicas_whose_sequences_stopped_keep_stepping_with_the_others(job, eos_job, tmp_path, n, overrides):
    """dp = 4 replicas of one sequence each: replica 1's sequence stops at its first token, yet the replica must
    take part (with no tokens) in the all-to-all of every later step of the others."""
    path, expected = eos_job
    done = job.run(tmp_path, f'model.checkpoint="{path}"', *overrides, n=n)
    assert done.returncode == 0, done.stderr
    assert output_records(tmp_path) == expected


def test_the_config_capacity_factor_overrides_the_checkpoints(job, tmp_path):
    """A DS-MoE checkpoint with capacity factor 1 drops tokens; `[moe] capacity_factor = 16` lifts the limit
    (ceil(T / 8 * 16) >= T), so it writes what the same weights written with factor 16 write, here on 2 ranks
    with ep = 2."""
    limited, unlimited = tmp_path / "ds_cf1.h5", tmp_path / "ds_cf16.h5"
    write_ds_moe(limited, capacity_factor=1.0, min_capacity=1)
    write_ds_moe(unlimited, capacity_factor=16.0)
    outputs = {}
    for name, n, overrides in (("unlimited", 1, [f'model.checkpoint="{unlimited}"']),
                               ("override", 2, [f'model.checkpoint="{limited}"', "moe.capacity_factor=16",
                                                "parallel.ep=2"]),
                               ("limited", 1, [f'model.checkpoint="{limited}"'])):
        done = job.run(tmp_path / name, *overrides, n=n)
        assert done.returncode == 0, done.stderr
        outputs[name] = (tmp_path / name / "output.jsonl").read_text()
    assert outputs["override"] == outputs["unlimited"]
    assert outputs["limited"] != outputs["unlimited"]          # the drops do change answers


# ------------------------------------------------------------------------------------------------ bad input

@pytest.fixture(scope="module")
def bad_checkpoints(job):
    """PR-MoE with 6 experts in its last layer (ep = 4 does not divide it), a dense GPT, and a copy of the Mixtral
    checkpoint whose moe_top_k attribute was edited to 9 (> its 8 experts: no writer would make it)."""
    paths = {"pr_moe_6": job.root / "pr_moe_0_4_0_6.h5", "dense": job.root / "dense.h5",
             "top_k_9": job.root / "mixtral_top_k_9.h5"}
    write_pr_moe(paths["pr_moe_6"], experts=(0, 4, 0, 6))
    write_dense_gpt(paths["dense"])
    paths["top_k_9"].write_bytes(job.ckpt.read_bytes())
    with h5py.File(paths["top_k_9"], "r+") as f:
        f.attrs["moe_top_k"] = 9
    return paths


# id: (ranks, checkpoint (None: Mixtral), overrides, fragments the single error message must hold)
BAD = {
    "ep-not-dividing-a-layers-experts": (4, "pr_moe_6", ["parallel.ep=4"],
                                         ["ep = 4 does not divide the 6 experts of layer 3"]),
    "mesh-rule": (4, None, ["parallel.ep=2", "parallel.expert_tp=1"],
                  ["dp * tp = 4 ranks", "ep * expert_tp = 2 * 1 = 2"]),
    "mesh-rule-with-tp": (4, None, ["parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=2", "parallel.pp=2"],
                          ["dp * tp = 2 ranks", "ep * expert_tp = 2 * 2 = 4"]),
    "ep-on-a-dense-model": (2, "dense", ["parallel.ep=2"], ["ep = 2", "has no experts"]),
    "expert-tp-on-a-dense-model": (2, "dense", ["parallel.expert_tp=2"], ["expert_tp = 2", "has no experts"]),
    "capacity-factor-zero": (1, None, ["moe.capacity_factor=0"], ["moe.capacity_factor = 0.0", "> 0"]),
    "capacity-factor-negative": (4, None, ["parallel.ep=4", "moe.capacity_factor=-1"],
                                 ["moe.capacity_factor = -1.0", "> 0"]),
    "unknown-all-to-all": (4, None, ["parallel.ep=4", 'moe.all_to_all="ring"'],
                           ["moe.all_to_all = 'ring'", "flat, hierarchical, pcc, pcc+hierarchical"]),
    "top-k-above-experts": (2, "top_k_9", ["parallel.ep=2"], ["moe_top_k = 9", "[1, 8]"]),
}


@pytest.mark.parametrize("n, checkpoint, overrides, fragments", BAD.values(), ids=BAD.keys())
def test_bad_moe_input_fails_once_and_clearly(job, bad_checkpoints, tmp_path, n, checkpoint, overrides, fragments):
    if checkpoint is not None:
        overrides = [f'model.checkpoint="{bad_checkpoints[checkpoint]}"', *overrides]
    done = job.run(tmp_path, *overrides, n=n, timeout=BAD_TIMEOUT)
    assert_fails_once_and_clearly(done, tmp_path, fragments)


def test_inspect_refuses_top_k_above_the_experts(bad_checkpoints, run_cli, repo_root):
    """The writer cannot make such a file (ModelArch refuses the arch): its attributes were edited. `inspect`
    reads the same validation as `run`."""
    done = run_cli(["inspect", str(bad_checkpoints["top_k_9"])], cwd=repo_root, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count(ERROR) == 1, done.stderr
    assert "moe_top_k = 9 must be in [1, 8]" in done.stderr and "invalid architecture" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_writer_refuses_top_k_above_the_experts():
    from moe_models import moe_arch

    with pytest.raises(ValueError, match=r"moe_top_k = 5 must be in \[1, 4\]"):
        moe_arch(experts=(0, 4, 0, 8), top_k=5)


def test_inspect_describes_a_pr_moe_checkpoint(bad_checkpoints, run_cli, repo_root):
    done = run_cli(["inspect", str(bad_checkpoints["pr_moe_6"])], cwd=repo_root, timeout=60)
    assert done.returncode == 0, done.stderr
    for line in ("moe_experts = [0, 4, 0, 6]", "moe_residual = true", "layers.3.moe.experts.up.weight",
                 "layers.1.moe.coef.weight", "check: OK"):
        assert line in done.stdout, done.stdout
