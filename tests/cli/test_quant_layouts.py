"""SmolLM2 (real weights) quantized gives identical tokens at tp = 1 and 3 for the same quantization mode: int8
row scales are taken over whole rows, int4 and GGUF groups never straddle a shard (SmolLM2's 576 / 3 = 192 and
1536 / 3 = 512 hold whole groups of 32 and 64), so each rank's weights are exactly its slice of the one-rank
model. Each case runs its own `mpiexec -n 3` job from this single-process test (CI's MPI suites run 2 and 4 ranks).
SmolLM2 has no tp = 2 layout (9 query and 3 KV heads); tp = 1 == tp = 2 is tested on the tiny llama instead:
int8 / int4 at load and a `convert --quantize` int4 checkpoint (tests/cli/test_quant_cli.py), asym8
(tests/quant/test_quant_asym8.py), a kept synthetic Q4_1 / Q8_0 GGUF (tests/checkpoint/test_gguf.py) and the int4 KV
cache (tests/cli/test_kv_quant_cli.py).

Needs models/SmolLM2-135M-Instruct.Q4_1.gguf (`make model`) and, for the modes quantized at load, the float
models/smollm2.h5 (`make models/smollm2.h5`); skipped without them. Kept short: 2 prompts, 4 new tokens.
"""

import json
import os
from pathlib import Path

import pytest

from cli_helpers import output_records

REPO = Path(__file__).resolve().parents[2]
GGUF = REPO / os.environ.get("HPCINFER_SMOLLM2_GGUF", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
FLOAT_H5 = REPO / "models" / "smollm2.h5"
needs_gguf = pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} not present (make model)")
needs_h5 = pytest.mark.skipif(not FLOAT_H5.is_file(), reason=f"{FLOAT_H5} not present (make models/smollm2.h5)")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A job folder: two short token prompts and a config that `run` points at a checkpoint."""
    root = tmp_path_factory.mktemp("quant-layouts")
    (root / "p.jsonl").write_text("".join(json.dumps({"id": i, "tokens": t}) + "\n"
                                          for i, t in enumerate([[1, 504, 3458, 282, 4649], [28, 1953]])))
    return root


@pytest.fixture(scope="module")
def kept(job, run_cli, repo_root):
    """SmolLM2 converted by `hpcinfer convert --keep-quantized`: its Q4_1 and Q8_0 blocks stored as they are."""
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} not present (make model)")
    pytest.importorskip("gguf")
    path = job / "kept.h5"
    done = run_cli(["convert", str(GGUF), str(path), "--keep-quantized"], cwd=repo_root, timeout=300)
    assert done.returncode == 0, done.stderr
    return path


def run(run_cli, repo_root, job, ckpt, out_dir, tp, *sets):
    """`hpcinfer run` of the job on `tp` ranks at tensor-parallel degree tp; its output records."""
    config = job / "job.toml"
    config.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[generate]\nprompts = "{job / "p.jsonl"}"\n'
                      f'output = "{out_dir / "output.jsonl"}"\nmetrics = "{out_dir / "metrics.json"}"\n'
                      f"max_new_tokens = 4\nignore_eos = true\n")
    args = ["run", str(config), "--set", f"parallel.tp={tp}"] + [a for s in sets for a in ("--set", s)]
    done = run_cli(args, n=tp, timeout=300, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    return output_records(out_dir)


def assert_same_tokens_at(run_cli, repo_root, job, ckpt, tmp_path, degrees, *sets):
    records = {tp: run(run_cli, repo_root, job, ckpt, tmp_path / f"tp{tp}", tp, *sets) for tp in degrees}
    tokens = {tp: [r["output_tokens"] for r in got] for tp, got in records.items()}
    assert all(len(t) == 4 for t in tokens[1]) and len(tokens[1]) == 2
    for tp in degrees[1:]:
        assert tokens[tp] == tokens[1], (tp, tokens)


@needs_gguf
def test_gguf_kept_q4_1_gives_identical_tokens_at_tp1_and_tp3(run_cli, repo_root, job, kept, tmp_path):
    assert_same_tokens_at(run_cli, repo_root, job, kept, tmp_path, (1, 3))


@needs_h5
@pytest.mark.parametrize("sets", [
    ('model.quantize="int8"',),
    ('model.quantize="int4"', 'model.quantize_embedding="same"', 'model.kv_cache="int4"',
     "generate.attention_topk=0.5"),
], ids=["int8", "int4-weights+int4-kv+topk"])
def test_quantized_at_load_gives_identical_tokens_at_tp1_and_tp3(run_cli, repo_root, job, tmp_path, sets):
    """int8, and int4 g64 weights with an int4 cache and top-k attention (which also covers int4 weights alone:
    the same weights, read by the same layers). The row-parallel layers' partial sums (o and down projections,
    summed by the tp all-reduce) round differently from tp = 1's single GEMM in the last bits; top-k over an int4
    cache can flip on such a difference at a near tie. With issue 22's 8-bit embedding default one such tie falls
    in these 8 tokens (the 4th token of prompt 1), so this case keeps the int4 embedding it was written with."""
    assert_same_tokens_at(run_cli, repo_root, job, FLOAT_H5, tmp_path, (1, 3), *sets)


@needs_gguf
def test_quantize_int4_on_a_kept_checkpoint_keeps_its_blocks(run_cli, repo_root, job, kept, tmp_path):
    """`[model] quantize = "int4"` on a GGUF-kept checkpoint (issue 22): its Q4_1 blocks already are 4 bits and its
    Q8_0 embedding 8 bits (int4's default for the embedding), so every block is kept: the same tokens as running it
    with quantize = "none", and one log line names the groups (the source's grid of 32)."""
    kept_as_is = run(run_cli, repo_root, job, kept, tmp_path / "none", 1)
    config = job / "job.toml"
    config.write_text(f'[model]\ncheckpoint = "{kept}"\nquantize = "int4"\n[generate]\n'
                      f'prompts = "{job / "p.jsonl"}"\noutput = "{tmp_path / "int4" / "output.jsonl"}"\n'
                      f"max_new_tokens = 4\nignore_eos = true\n")
    done = run_cli(["run", str(config)], timeout=300, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert "[rank 0] int4 in groups of 32, on the source's block grid (q4_1; no group size given)" in done.stderr
    tokens = [r["output_tokens"] for r in output_records(tmp_path / "int4")]
    assert tokens == [r["output_tokens"] for r in kept_as_is] and all(len(t) == 4 for t in tokens)
