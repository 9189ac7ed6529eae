"""Bench figures that need more than a metrics dict: an offloaded cell's device total (what the offload budget
check counts, not only the streamed weights), and the committed results files against the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcinfer.bench.suites import figures as fig
from hpcinfer.bench.suites.schema import SCHEMAS, validate
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.offload.sizes import table_bytes

ROOT = Path(__file__).resolve().parents[2]
PROMPT_LEN, BATCH = 16, 4


def _job(tmp_path: Path, offload: str) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": list(range(1, PROMPT_LEN + 1))}) + "\n"
                               for i in range(BATCH)))
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\npreset = "tiny-dense"\ndtype = "float32"\n\n{offload}\n'
                    f'[generate]\nprompts = "{prompts}"\noutput = "{tmp_path / "out.jsonl"}"\n'
                    f'max_new_tokens = 8\nbatch_size = {BATCH}\n')
    return path


def test_offload_device_total_counts_tables_and_cache_beside_the_streamed_weights(tmp_path):
    arch = PRESETS["tiny-dense"]
    off = ('[offload]\nweights_gpu = 0\nweights_cpu = 100\ncache_gpu = 100\ncache_cpu = 0\nschedule = "zigzag"\n'
           f'num_gpu_batches = 2\nprefetch_layers = 1\ndisk_dir = "{tmp_path}"\n')
    total = fig.offload_device_bytes(str(_job(tmp_path, off)), [PROMPT_LEN] * BATCH)
    tables = table_bytes(arch, True, True, 4, 1, None)
    one_layer = 4 * arch.param_count() // arch.num_layers          # upper bound of a streamed layer's bytes
    kv = 2 * arch.num_layers * BATCH * (PROMPT_LEN + 8) * arch.hidden_size * 4      # K and V, float32
    assert total >= tables + kv                                     # the tables and the cache are counted
    assert total <= tables + kv + 2 * one_layer + kv                # + a 2-layer window (+ staging at most)
    streamed_peak = 2 * one_layer
    f = fig.from_metrics(_metrics(streamed_peak), 1, None, device_total=total)
    assert f["memory"]["device_total_bytes_per_rank"] == total > f["memory"]["device_weights_bytes_per_rank"]


def test_no_offload_has_no_device_total(tmp_path):
    assert fig.offload_device_bytes(str(_job(tmp_path, "")), [PROMPT_LEN] * BATCH) is None
    assert fig.from_metrics(_metrics(0), 1, None)["memory"]["device_total_bytes_per_rank"] is None


def _metrics(streamed_peak: int) -> dict:
    return {"prefill_s": 0.5, "decode_step_ms": {"median": 20.0, "p90": 30.0}, "tokens_per_s": 10.0,
            "flop_rate_GFLOPs_per_rank": 1.0, "decode_weight_bandwidth_GBps_per_rank": 1.0,
            "pipeline": {"bubble_fraction": 0.0}, "generate_s": 1.0, "load_s": 1.0,
            "offload": {"weights_peak_device_bytes_per_rank": streamed_peak},
            "kv_cache": {"peak_device_bytes_per_rank": 4096}, "memory": {"weight_bytes_per_rank": 10**6},
            "mesh": {"world": 1, "pp": 1, "dp": 1, "tp": 1}}


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").glob("bench-*.json")), ids=lambda p: p.name)
def test_committed_bench_results_pass_the_schema(path):
    result = json.loads(path.read_text())
    validate(result, str(path))
    assert result["schema"] in SCHEMAS and result["suites"]


def test_there_is_a_committed_bench_result():
    assert sorted((ROOT / "bench" / "results").glob("bench-*.json"))


def test_gpu_machine_names_the_cuda_graphs_switch():
    from hpcinfer.bench.suites.run import not_applicable

    reasons = {n["name"]: n["reason"] for n in not_applicable({"gpus": [{"name": "H100"}]})}
    assert "[runtime] cuda_graphs" in reasons["no CUDA graphs"]
    assert "CUDA graphs" not in reasons["no fusion"]                    # fusion's missing switch only
    cpu = {n["name"]: n["reason"] for n in not_applicable({"gpus": []})}
    assert "NumPy backend" in cpu["no CUDA graphs"]


# ------------------------------------------------------------------------ the run metrics' figures (metrics.py)

def _summary(tmp_path: Path, preset: str, held: dict, decode_s=(0.5, 0.25, 0.5)) -> dict:
    """metrics.summarize of one rank that ran 100 prompt tokens and 28 generated in 2 s on `preset`."""
    from types import SimpleNamespace

    from hpcinfer.config import load_config
    from hpcinfer.generate.engine import StepTimes
    from hpcinfer.metrics import summarize

    config = load_config(str(_job(tmp_path, "")))
    times = StepTimes(prefill_s=0.5, decode_s=list(decode_s), prompt_tokens=100, generated_tokens=28)
    report = SimpleNamespace(coords=(0, 0, 0), times=times, generate_s=2.0, held=held, peak_rss_bytes=0)
    mesh = SimpleNamespace(world=SimpleNamespace(size=1), shape=SimpleNamespace(pp=1, dp=1, tp=1),
                           ranks_per_node=1)
    return summarize(config, PRESETS[preset], mesh, [report], 0.1, 2.5, 1)


def test_moe_flop_rate_counts_the_routed_experts_only(tmp_path):
    """tiny-moe: tiny-dense's 4 layers (216,448 matmul parameters: tied embedding + layers, no position table)
    with 8 experts of tiny-dense's MLP (2 x 64 x 256 weights + 320 biases = 33,088 each) in layers 1 and 3 and
    top-1 routing: a token runs one expert per MoE layer, as a dense layer's MLP, plus the 8 x 64 router, so
    217,472 parameters per token, not the 680,704 stored (3.1x). FLOP rate: 2 x 217,472 x 128 tokens / 2 s."""
    from hpcinfer.metrics import matmul_params, stored_matmul_params

    assert matmul_params(PRESETS["tiny-dense"]) == stored_matmul_params(PRESETS["tiny-dense"]) == 216_448
    moe = PRESETS["tiny-moe"]
    assert stored_matmul_params(moe) == 216_448 + 2 * (7 * 33_088 + 8 * 64) == 680_704
    assert matmul_params(moe) == 216_448 + 2 * 8 * 64 == 217_472
    # PR-MoE (residual): the dense MLP, one expert, the router and the 2-way coefficients (2 x 64 + 2) per layer
    assert matmul_params(PRESETS["tiny-prmoe"]) == 216_448 + (33_088 + 4 * 64 + 130) + (33_088 + 8 * 64 + 130)
    m = _summary(tmp_path, "tiny-moe", {"weights": 1000, "dequant_scratch": 0})
    assert m["flop_rate_GFLOPs_per_rank"] == pytest.approx(2 * 217_472 * 128 / 2.0 / 1e9)


def test_offload_bandwidth_adds_the_weights_streamed_per_step(tmp_path):
    """A rank holding 1,000 weight bytes that streams 3,000 per step, median decode step 0.5 s: 4,000 bytes per
    step, 8e-6 GB/s (1,000 / 0.5 without offload)."""
    m = _summary(tmp_path, "tiny-dense", {"weights": 1000, "dequant_scratch": 0, "streamed_per_step": 3000})
    assert m["decode_weight_bandwidth_GBps_per_rank"] == pytest.approx(4000 / 0.5 / 1e9)
    m = _summary(tmp_path, "tiny-dense", {"weights": 1000, "dequant_scratch": 0, "streamed_per_step": 0})
    assert m["decode_weight_bandwidth_GBps_per_rank"] == pytest.approx(1000 / 0.5 / 1e9)


def test_the_streamed_bytes_per_step_are_the_layers_off_the_device(tmp_path):
    """tiny-dense with 1 layer on the device, 1 in host memory and 2 on disk streams 3 layers per step, and the
    metrics record the backend it ran on."""
    import offload_models as base
    from hpcinfer.metrics import held_bytes

    model = base.build(base.preset("tiny-dense"), base.offload(tmp_path, weights_gpu=25, weights_cpu=25))
    held = held_bytes(model)
    model.weights.close()
    assert held["streamed_per_step"] == 3 * model.weights.layer_bytes[0] > 0
    assert held["backend"] == "numpy"
    assert _summary(tmp_path, "tiny-dense", held)["mesh"]["backend"] == "numpy"
    assert _summary(tmp_path, "tiny-dense", {"weights": 1, "dequant_scratch": 0})["mesh"]["backend"] is None


def test_an_moe_runs_mesh_names_its_expert_axes(tmp_path):
    """An MoE model's metrics mesh carries ep, expert_tp and the all-to-all variant the job ran with (the job's
    config defaults: ep = expert_tp = 1, pcc+hierarchical); a dense model's mesh has none of them."""
    held = {"weights": 1, "dequant_scratch": 0}
    mesh = _summary(tmp_path, "tiny-moe", held)["mesh"]
    assert (mesh["ep"], mesh["expert_tp"], mesh["all_to_all"]) == (1, 1, "pcc+hierarchical")
    assert not {"ep", "expert_tp", "all_to_all"} & set(_summary(tmp_path, "tiny-dense", held)["mesh"])
