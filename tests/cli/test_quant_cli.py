"""Quantized weights give identical tokens at every tensor-parallel degree: int8 row scales are taken over whole
rows (max over the tp group) and int4 groups never straddle a shard, so each rank's weights are exactly its slice
of the single-rank quantized model."""

import pytest

from cli_helpers import run_tiny_llama, tiny_llama_job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return tiny_llama_job(tmp_path_factory.mktemp("quant-cli"), (3, 9, 1, 14, 6))


def run(run_cli, repo_root, root, out, n, *sets):
    return run_tiny_llama(run_cli, repo_root, root, out, n, sets, max_new=6)


@pytest.mark.parametrize("mode", ['model.quantize="int8"', 'model.quantize="int4"'])
def test_quantized_layouts_give_identical_tokens(run_cli, repo_root, job, tmp_path, mode):
    group = "model.quantize_group=16"
    single = run(run_cli, repo_root, job, tmp_path / "one.jsonl", 1, mode, group)
    sharded = run(run_cli, repo_root, job, tmp_path / "tp2.jsonl", 2, mode, group, "parallel.tp=2")
    plain = run(run_cli, repo_root, job, tmp_path / "float.jsonl", 1)
    assert sharded == single
    assert len(single.splitlines()) == 5 and single != ""
    assert plain.count('"output_tokens"') == 5


@pytest.fixture(scope="module")
def stored_int4(job, run_cli, repo_root):
    """The tiny llama converted by `hpcinfer convert --quantize int4 --group-size 16` (stored quantized)."""
    path = job / "int4-g16.h5"
    done = run_cli(["convert", str(job / "hf"), str(path), "--quantize", "int4", "--group-size", "16"], cwd=repo_root)
    assert done.returncode == 0, done.stderr
    return path


def test_stored_int4_checkpoint_gives_identical_tokens_at_tp1_and_tp2(run_cli, repo_root, job, stored_int4, tmp_path):
    """A checkpoint quantized by `convert --quantize` (not at load) shards the same way: tp=2 == tp=1, and both
    equal quantizing the float checkpoint at load with the same group (the same bytes either way)."""
    ckpt = f'model.checkpoint="{stored_int4}"'
    single = run(run_cli, repo_root, job, tmp_path / "one.jsonl", 1, ckpt)
    sharded = run(run_cli, repo_root, job, tmp_path / "tp2.jsonl", 2, ckpt, "parallel.tp=2")
    at_load = run(run_cli, repo_root, job, tmp_path / "load.jsonl", 1, 'model.quantize="int4"',
                  "model.quantize_group=16")
    assert sharded == single == at_load and single.count('"output_tokens"') == 5


def test_conflicting_quantize_group_is_refused_by_hpcinfer_run(run_cli, repo_root, job, stored_int4, tmp_path):
    """quantize = "int4" with a group size other than the stored one: exit 2 naming both values, before loading;
    the stored group or quantize = "none" run."""
    from cli_helpers import assert_fails_once_and_clearly, job_config

    config = job_config(job / "conflict.toml", stored_int4, job / "p.jsonl", tmp_path / "output.jsonl", 2,
                        model='quantize = "int4"\nquantize_group = 64\n', metrics=tmp_path / "metrics.json")
    done = run_cli(["run", str(config)], cwd=repo_root)
    assert_fails_once_and_clearly(done, tmp_path, ["quantize_group = 64", "groups of 16", str(stored_int4)])
    done = run_cli(["run", str(config), "--set", "model.quantize_group=16"], cwd=repo_root)
    assert done.returncode == 0, done.stderr
