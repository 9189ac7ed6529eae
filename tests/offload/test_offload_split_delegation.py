"""CPU delegation over a split KV cache (FlexGen's CPU delegation with the cache at tensor granularity):
with `cpu_attention = true` and 0 < cache_gpu < 100, each GPU batch's (sequence, KV head) rows [0, R) attend on
the device where they lie and the rest on the host where they lie (backend/kv_attention.split_attention); each
row's attention is its own, so nothing is merged.

What must hold:
- cache_gpu in {0, 25, 50, 75} with CPU attention, float and int4 caches, 1 and 2 GPU batches, prefetch 0 and 1:
  the tokens of the all-on-device run (and with grouped-query heads);
- the link: no cache byte crosses (kv_bytes_to_device = kv_bytes_to_host = 0, no staging buffer); exactly the
  host rows' q, k, v go down and their outputs come up, every layer and step, prompt step included;
- the device holds the device rows and nothing else of the cache; the budget plan counts what the runtime holds
  (device rows, host rows, host attention scratch);
- on the cupy stand-in: NumPy's tokens and delegated bytes, no pageable copy and no cache copy.
"""

from __future__ import annotations

import dataclasses

import pytest

import offload_models as base
import test_offload_kv_quant as kvq
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.offload.budget import host_attention_bytes, kv_plan_bytes, plan_bytes
from hpcinfer.offload.sizes import device_rows
from hpcinfer.parallel.micro_batches import micro_batches
from offload_models import MAX_NEW, PROMPT_LENGTHS, config_for, host_kvs, make_prompts, offload, preset

TINY = PRESETS["tiny-dense"]
LAYERS, HEAD_DIM, F32 = TINY.num_layers, TINY.head_dim, 4     # 4 layers, heads of 16, float32 q / outputs
SPLITS = (0, 25, 50, 75)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def references(prompts):
    """kv -> the all-on-device tokens."""
    float_ref, _ = base.generate(base.build(preset("tiny-dense")), prompts)
    off = delegated(100, 1, 1, cpu_attention=False)
    int4_ref = kvq.generate(kvq.build(kvq.source(), off, "int4"), prompts, off)[0]
    return {"float": float_ref, "int4": int4_ref}


def delegated(cache_gpu: float, num_gpu_batches: int, prefetch: int, cpu_attention: bool = True, **keys):
    return offload(None, weights_gpu=0, weights_cpu=100, cache_gpu=cache_gpu, cache_cpu=100 - cache_gpu,
                   schedule="zigzag", num_gpu_batches=num_gpu_batches, prefetch_layers=prefetch,
                   cpu_attention=cpu_attention, **keys)


def delegated_bytes(cache_gpu: float, num_gpu_batches: int, kv_heads: int, group: int) -> tuple[int, int]:
    """(to the host, to the device) bytes of CPU attention over PROMPT_LENGTHS: for every layer and step, each
    host row (sequence, KV head) sends its tokens' q (g heads), k and v down and its outputs (g heads) up."""
    down = up = 0
    for batch in micro_batches(len(PROMPT_LENGTHS), num_gpu_batches):
        R = device_rows(len(batch) * kv_heads, cache_gpu)
        host = [PROMPT_LENGTHS[s] for i, s in enumerate(batch) for h in range(kv_heads) if i * kv_heads + h >= R]
        tokens = sum(host) + (MAX_NEW - 1) * len(host)                          # the prompt step, then 1 a step
        down += tokens * (group + 2) * HEAD_DIM * F32
        up += tokens * group * HEAD_DIM * F32
    return down * LAYERS, up * LAYERS


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("num_gpu_batches", [1, 2])
@pytest.mark.parametrize("kv", ["float", "int4"])
@pytest.mark.parametrize("cache_gpu", SPLITS)
def test_split_cpu_attention_gives_the_all_on_device_tokens(prompts, references, monkeypatch, cache_gpu, kv,
                                                            num_gpu_batches, prefetch):
    off = delegated(cache_gpu, num_gpu_batches, prefetch)
    made = host_kvs(monkeypatch)
    if kv == "float":
        out, times = base.generate(base.build(preset("tiny-dense"), off), prompts, off)
    else:
        out, times = kvq.generate(kvq.build(kvq.source(), off, "int4"), prompts, off)
    assert out == references[kv]
    (host_kv,) = made
    assert times.kv_bytes_to_device == times.kv_bytes_to_host == 0             # no cache byte crosses the link
    assert host_kv.staging == []
    assert tuple(host_kv.delegated) == delegated_bytes(cache_gpu, num_gpu_batches, 4, 1)
    assert (times.attention_bytes_to_host, times.attention_bytes_to_device) == tuple(host_kv.delegated)
    assert times.kv_peak_device_bytes == sum(c.nbytes for c in host_kv.device.values())
    for b, batch in enumerate(micro_batches(len(PROMPT_LENGTHS), num_gpu_batches)):
        rows, R = len(batch) * 4, device_rows(len(batch) * 4, cache_gpu)
        if R == rows:                                                           # wholly on the device: not here
            assert b not in host_kv.host
            continue
        device = host_kv.device[b].k[0].shape[0] if b in host_kv.device else 0
        assert (device, host_kv.host[b].k[0].shape[0]) == (R, rows - R)
    assert (cache_gpu > 0) == bool(host_kv.device)


def gqa_source() -> PresetSource:
    """tiny-dense with 2 KV heads for its 4 query heads (g = 2)."""
    return PresetSource("tiny-dense-gqa", dataclasses.replace(PRESETS["tiny-dense"], num_kv_heads=2))


@pytest.mark.parametrize("cache_gpu", [0, 50, 75])
def test_grouped_query_heads_attend_with_their_kv_head(prompts, monkeypatch, cache_gpu):
    """A row is one KV head and its group of query heads: a split with g = 2 gives the all-on-device tokens and
    sends g q heads down per host row."""
    want, _ = base.generate(base.build(gqa_source()), prompts)
    off = delegated(cache_gpu, 2, 1)
    made = host_kvs(monkeypatch)
    out, _ = base.generate(base.build(gqa_source(), off), prompts, off)
    assert out == want
    assert tuple(made[0].delegated) == delegated_bytes(cache_gpu, 2, 2, 2)


def test_the_host_share_sets_the_delegated_bytes():
    """The expectation itself: 0 sends every row's q, more device rows send fewer (the first sequences' rows
    are the device's, so the share of bytes follows their prompt lengths)."""
    sent = [sum(delegated_bytes(c, 2, 4, 1)) for c in SPLITS]
    assert sent[0] > sent[1] > sent[2] > sent[3] > 0


@pytest.mark.parametrize("cache_gpu", [0, 25, 50])
def test_the_budget_plan_counts_what_the_split_holds(prompts, tmp_path, monkeypatch, cache_gpu):
    """Device rows on the device (no staging buffer), host rows and the host attention scratch in host memory,
    as the runtime holds them (its TierMemory peaks)."""
    keys = dict(weights_gpu=100, cache_gpu=cache_gpu, cache_cpu=100 - cache_gpu, schedule="zigzag",
                num_gpu_batches=2, cpu_attention=True)
    config = config_for(tmp_path, **keys)
    arch = preset("tiny-dense").arch
    device, host, staging = kv_plan_bytes(arch, config, LAYERS, list(PROMPT_LENGTHS))
    scratch = host_attention_bytes(arch, config, list(PROMPT_LENGTHS))
    made = host_kvs(monkeypatch)
    off = config.offload
    model = base.build(preset("tiny-dense"), off)
    _, times = base.generate(model, prompts, off)
    (host_kv,) = made
    assert staging == 0 and scratch > 0
    assert device == sum(c.nbytes for c in host_kv.device.values()) == times.kv_peak_device_bytes
    assert host == sum(c.nbytes for c in host_kv.host.values()) > 0
    assert model.weights.memory.peak["host"] >= host + scratch
    stage = type("Stage", (), {"layers": range(LAYERS), "is_first": True, "is_last": True})()
    plan = plan_bytes(arch, config, stage, list(PROMPT_LENGTHS))
    assert plan["host_parts"]["host attention scratch"] == scratch
    assert plan["parts"]["KV cache on the device"] == device


def test_split_cpu_attention_on_emulated_cupy_gives_numpys_tokens_and_bytes(monkeypatch):
    """cache_gpu = 50 over 2 GPU batches on the stand-in for cupy: the device rows attend on the device, the host
    rows on the host (cupy_attention.host_attention): NumPy's tokens and delegated bytes, no cache copy and no
    pageable asynchronous copy (the delegated q, k, v and outputs go through pinned buffers)."""
    emu = pytest.importorskip("emu_cupy")
    from hpcinfer.backend.numpy_ops import NumpyOps
    import kernel_emulator as emulate

    if emulate.unavailable() is not None:
        pytest.skip(f"kernel emulator unavailable: {emulate.unavailable()}")
    prompts = make_prompts()[:4]
    off = offload(None, weights_gpu=100, cache_gpu=50, cache_cpu=50, schedule="zigzag", num_gpu_batches=2,
                  cpu_attention=True)
    made = host_kvs(monkeypatch)
    want, cpu_times = base.generate(base.build(preset("tiny-dense"), off, NumpyOps()), prompts, off)
    with emu.installed():
        from hpcinfer.backend.cupy_ops import CupyOps

        got, gpu_times = base.generate(base.build(preset("tiny-dense"), off, CupyOps(device=0)), prompts, off)
        assert emu._state.pageable_async_copies == 0
        # no cache row crossed: the only copies are the host rows' q, k, v down and their outputs up
        assert emu._state.async_copy_bytes == gpu_times.attention_bytes_to_host + gpu_times.attention_bytes_to_device
    assert got == want
    cpu_kv, gpu_kv = made
    assert gpu_kv.delegated == cpu_kv.delegated and cpu_kv.delegated[0] > 0
    assert gpu_times.kv_bytes_to_device == gpu_times.kv_bytes_to_host == 0
    assert gpu_times.kv_peak_device_bytes == cpu_times.kv_peak_device_bytes > 0
