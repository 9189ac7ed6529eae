"""Bench figures that need more than a metrics dict: an offloaded cell's device total (what the offload budget
check counts, not only the streamed weights), and the committed results files against the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcinfer.bench import figures as fig
from hpcinfer.bench.schema import validate
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.offload.sizes import table_bytes

ROOT = Path(__file__).resolve().parent.parent
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
    assert result["schema"] == "hpcinfer-bench/1" and result["suites"]


def test_there_is_a_committed_bench_result():
    assert sorted((ROOT / "bench" / "results").glob("bench-*.json"))


def test_gpu_machine_names_the_cuda_graphs_switch():
    from hpcinfer.bench.run import not_applicable

    reasons = {n["name"]: n["reason"] for n in not_applicable({"gpus": [{"name": "H100"}]})}
    assert "[runtime] cuda_graphs" in reasons["no CUDA graphs"]
    assert "CUDA graphs" not in reasons["no fusion"]                    # fusion's missing switch only
    cpu = {n["name"]: n["reason"] for n in not_applicable({"gpus": []})}
    assert "NumPy backend" in cpu["no CUDA graphs"]
