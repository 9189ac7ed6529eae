"""`[schedule] batching` end to end (docs/scheduling.md): continuous batching writes the static schedule's file byte
for byte, alone, with a pool small enough to preempt, with chunked prompts, at dp = 2 and at tp = 2; its metrics
say what ran; explicit continuous where it is not supported, and bad values, are one clear error."""

from __future__ import annotations

import json

import pytest

from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.generate.paged_cache import block_bytes
from hpcinfer.quant.kv import kv_format

N_PROMPTS, MAX_NEW, BATCH = 14, 20, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("continuous")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "tokens": [(11 * i + 5 * k) % 256 for k in range(1 + 3 * i % 23)]})
                               + "\n" for i in range(N_PROMPTS)))
    config = root / "job.toml"
    config.write_text(f'[model]\npreset = "tiny-dense"\n\n[generate]\nprompts = "{prompts}"\noutput = "unused"\n'
                      f"max_new_tokens = {MAX_NEW}\nbatch_size = {BATCH}\ntemperature = 0.9\ntop_k = 30\nseed = 4\n\n"
                      f'[runtime]\nbackend = "numpy"\nthreads = 1\n')
    return config


def run(run_cli, config, out, *overrides, n=1):
    args = ["run", str(config), "--set", f'generate.output="{out}"', "--set", f'generate.metrics="{out}.metrics"']
    for item in overrides:
        args += ["--set", item]
    return run_cli(args, n=n, timeout=180)


@pytest.fixture(scope="module")
def static_file(job, run_cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("static") / "out.jsonl"
    done = run(run_cli, job, out, 'schedule.batching="static"')
    assert done.returncode == 0, done.stderr
    assert json.loads(out.with_name("out.jsonl.metrics").read_text())["batching"]["mode"] == "static"
    return out.read_bytes()


@pytest.mark.parametrize("n, overrides", [
    (1, []),
    (1, ['schedule.kv_cache_memory="120KB"', "schedule.kv_block_size=4", "schedule.max_batch_tokens=5"]),
    (2, []),
    (2, ["parallel.tp=2"]),
    (2, ["parallel.pp=2"]),
    (2, ["parallel.pp=2", 'schedule.kv_cache_memory="60KB"', "schedule.kv_block_size=4", "schedule.max_batch_tokens=5"]),
    (4, ["parallel.pp=2", "schedule.gen_micro_batches=3"]),
], ids=["alone", "preempting-chunked", "dp2", "tp2", "pp2", "pp2-preempting-chunked", "pp2-dp2"])
def test_continuous_writes_the_static_file(job, run_cli, static_file, tmp_path, n, overrides):
    out = tmp_path / "out.jsonl"
    done = run(run_cli, job, out, *overrides, n=n)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == static_file
    batching = json.loads(out.with_name("out.jsonl.metrics").read_text())["batching"]
    assert batching["mode"] == "continuous" and batching["kv_pool_blocks"] > 0
    assert batching["time_to_first_token_s"]["p99"] >= batching["time_to_first_token_s"]["p50"] > 0
    dp = n // (2 if any(o in ("parallel.tp=2", "parallel.pp=2") for o in overrides) else 1)
    assert len(batching["replica_busy_s"]) == dp and batching["replica_imbalance"] >= 1.0
    if any("kv_cache_memory" in o for o in overrides):
        assert batching["preemptions"] > 0 and batching["kv_pool_peak_fraction"] == 1.0
    else:
        assert batching["preemptions"] == 0


@pytest.mark.parametrize("overrides, message", [
    (['schedule.batching="continuous"', 'offload.schedule="zigzag"'], "[offload] runs fixed blocks by design"),
    (['schedule.kv_cache_memory="150%"'], "schedule.kv_cache_memory = '150%' must be a percentage in (0, 100]"),
    (["schedule.max_batch_tokens=2"], "schedule.max_batch_tokens = 2 is below [generate] batch_size = 3"),
    (['schedule.batching="eager"'], "schedule.batching = 'eager' is not allowed; choose one of auto, continuous, "),
    (['schedule.kv_cache_memory="10KB"', "schedule.kv_block_size=4"], "prompt 'q0' (line 1 of "),
], ids=["offload", "percent", "tokens", "choice", "too-small"])
def test_unsupported_or_bad_values_are_one_clear_error(job, run_cli, tmp_path, overrides, message):
    out = tmp_path / "out.jsonl"
    done = run(run_cli, job, out, *overrides)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("n, overrides", [(2, []), (4, ["parallel.pp=2"])], ids=["dp2", "pp2-dp2"])
def test_moe_replicas_stepping_together_write_the_static_file(job, run_cli, tmp_path, n, overrides):
    """tiny-moe at dp = 2: the replicas exchange tokens in every MoE layer, so they step together (a replica out of
    work runs empty steps) and commit at agreed points; the file equals the static schedule's, also through a
    pipeline of two stages. The expert capacity is lifted (capacity_factor 64): with a binding capacity, which
    tokens an expert drops depends on which tokens share a step, in either schedule (docs/scheduling.md)."""
    files = {}
    for mode in ("static", "continuous"):
        out = tmp_path / f"{mode}.jsonl"
        done = run(run_cli, job, out, 'model.preset="tiny-moe"', "parallel.ep=2", "moe.capacity_factor=64",
                   f'schedule.batching="{mode}"', *overrides, n=n)
        assert done.returncode == 0, done.stderr
        files[mode] = out.read_bytes()
        batching = json.loads(out.with_name(f"{mode}.jsonl.metrics").read_text())["batching"]
        assert batching["mode"] == mode
    assert files["continuous"] == files["static"] and files["static"].count(b"\n") == N_PROMPTS


@pytest.mark.parametrize("n, mode, overrides", [
    (1, "int4", ["generate.attention_topk=0.5"]),
    (2, "int8", ["parallel.pp=2"]),
], ids=["int4-topk", "int8-pp2"])
def test_quantized_kv_and_top_k_write_the_static_file(job, run_cli, tmp_path, n, mode, overrides):
    """int8 / int4 rows in the paged blocks and top-k over them, with a pool small enough to preempt and a step
    budget below the prompts: the file equals the static schedule's with the same settings (prompts enter whole,
    recomputed tokens one a step, as static feeds them)."""
    arch, pp = PRESETS["tiny-dense"], 2 if "parallel.pp=2" in overrides else 1
    pool = 14 * block_bytes(arch.num_layers // pp, arch.num_kv_heads, 4, arch.head_dim, kv_format(mode, 64, 16))
    tight = [f"schedule.kv_cache_memory={pool}", "schedule.kv_block_size=4", "schedule.max_batch_tokens=5"]
    overrides = [f'model.kv_cache="{mode}"', *overrides]
    files = {}
    for mode in ("static", "continuous"):
        out = tmp_path / f"{mode}.jsonl"
        done = run(run_cli, job, out, f'schedule.batching="{mode}"', *overrides, *(tight if mode == "continuous"
                                                                                    else []), n=n)
        assert done.returncode == 0, done.stderr
        files[mode] = out.read_bytes()
        batching = json.loads(out.with_name(f"{mode}.jsonl.metrics").read_text())["batching"]
        assert batching["mode"] == mode
        if mode == "continuous":
            assert batching["preemptions"] > 0
    assert files["continuous"] == files["static"] and files["static"].count(b"\n") == N_PROMPTS
