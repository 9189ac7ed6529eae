"""Quantized weights give identical tokens at every tensor-parallel degree: int8 row scales are taken over whole
rows (max over the tp group) and int4 groups never straddle a shard, so each rank's weights are exactly its slice
of the single-rank quantized model."""

import json

import numpy as np
import pytest

from hf_models import save_tiny_model
from hpcinfer.checkpoint.hf import convert_hf


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-cli")
    convert_hf(str(save_tiny_model("llama_mha", root / "hf")), str(root / "m.h5"))
    rng = np.random.default_rng(3)
    (root / "p.jsonl").write_text("".join(json.dumps({"id": i, "tokens": rng.integers(0, 256, n).tolist()}) + "\n"
                                          for i, n in enumerate((3, 9, 1, 14, 6))))
    return root


def run(run_cli, repo_root, root, out, n, *sets):
    config = root / "job.toml"
    config.write_text(f'[model]\ncheckpoint = "{root / "m.h5"}"\n[generate]\nprompts = "{root / "p.jsonl"}"\n'
                      f'output = "{out}"\nmax_new_tokens = 6\nignore_eos = true\n')
    args = ["run", str(config)] + [a for s in sets for a in ("--set", s)]
    done = run_cli(args, n=n, timeout=120, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    return out.read_text()


@pytest.mark.parametrize("mode", ['model.quantize="int8"', 'model.quantize="int4"'])
def test_quantized_layouts_give_identical_tokens(run_cli, repo_root, job, tmp_path, mode):
    group = "model.quantize_group=16"
    single = run(run_cli, repo_root, job, tmp_path / "one.jsonl", 1, mode, group)
    sharded = run(run_cli, repo_root, job, tmp_path / "tp2.jsonl", 2, mode, group, "parallel.tp=2")
    plain = run(run_cli, repo_root, job, tmp_path / "float.jsonl", 1)
    assert sharded == single
    assert len(single.splitlines()) == 5 and single != ""
    assert plain.count('"output_tokens"') == 5
