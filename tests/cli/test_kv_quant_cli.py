"""A quantized KV cache and top-k attention through `hpcinfer run`: identical tokens at tp = 1 and tp = 2 (KV heads
sharded: each rank quantizes the rows of its own heads, which are the same rows as on one rank) and with pp = 2
plus KV offload to host; the metrics report the quantized cache's bytes."""

import json

import pytest

from cli_helpers import run_tiny_llama, tiny_llama_job

PROMPTS = (3, 9, 1, 14, 6)
NEW = 6
LAYERS, KV_HEADS, HEAD_DIM = 2, 4, 16                    # llama_mha


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return tiny_llama_job(tmp_path_factory.mktemp("kv-quant-cli"), PROMPTS)


def run(run_cli, repo_root, root, out, n, *sets):
    """-> (results text, metrics dict)"""
    metrics = out.parent / f"{out.name}.metrics"
    text = run_tiny_llama(run_cli, repo_root, root, out, n, sets, max_new=NEW, metrics=metrics)
    return text, json.loads(metrics.read_text())


def test_int4_cache_and_topk_give_identical_tokens_across_layouts(run_cli, repo_root, job, tmp_path):
    kv = ['model.kv_cache="int4"', "model.kv_cache_group=8", "generate.attention_topk=0.5"]
    single, metrics = run(run_cli, repo_root, job, tmp_path / "one.jsonl", 1, *kv)
    sharded, _ = run(run_cli, repo_root, job, tmp_path / "tp2.jsonl", 2, *kv, "parallel.tp=2")
    assert sharded == single and single.count('"output_tokens"') == len(PROMPTS)
    # the continuous schedule's store on NumPy (generate/slot_cache.py): 5 dense slots at the longest length;
    # 2 layers, K and V, rows of 8 bytes of nibbles + 2 groups x (fp16 scale + min)
    max_len = max(PROMPTS) + NEW
    row = HEAD_DIM // 2 + 2 * 2 * 2
    assert metrics["batching"]["mode"] == "continuous"
    assert metrics["kv_cache"]["peak_device_bytes_per_rank"] == len(PROMPTS) * LAYERS * 2 * KV_HEADS * max_len * row


def test_int8_cache_with_pipeline_and_kv_offload(run_cli, repo_root, job, tmp_path):
    """pp = 2 with micro-batches and a threshold that pushes idle micro-batches' quantized KV to the host."""
    kv = ['model.kv_cache="int8"', "model.kv_cache_group=16"]
    single, _ = run(run_cli, repo_root, job, tmp_path / "one.jsonl", 1, *kv)
    row = HEAD_DIM + 2 * 2
    per_seq_layer = 2 * KV_HEADS * row * (max(PROMPTS) + NEW)
    threshold = (len(PROMPTS) + 2) * per_seq_layer          # each stage: 1 layer, room for 2 of its 5 sequences
    piped, metrics = run(run_cli, repo_root, job, tmp_path / "pp2.jsonl", 2, *kv, "parallel.pp=2",
                         "schedule.prompt_micro_batches=3", "schedule.gen_micro_batches=3",
                         f"schedule.kv_offload_threshold={threshold // 2}")
    assert piped == single
    assert metrics["kv_cache"]["offloaded_bytes_to_host"] > 0
    assert metrics["kv_cache"]["peak_device_bytes_per_rank"] <= threshold // 2
