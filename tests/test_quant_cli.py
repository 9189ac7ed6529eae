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
