"""The KV cache at tensor granularity (FlexGen Section 4.2): `cache_gpu` percent of every GPU batch's
(sequence, KV head) rows stay on the device, the rest in host memory (offload/zigzag.py, offload/budget.py).

What must hold:
- for cache_gpu in {0, 33, 50, 100}, zig-zag over 3 GPU batches, float and int4 caches: the tokens of the
  all-on-device run;
- the bytes over the link are exactly the host rows of the windows FlexGen moves (load [0, max start), store
  [min start, max end)), so they shrink with cache_gpu; cache_gpu = 100 moves nothing;
- budget.kv_plan_bytes is what the runtime allocates (device rows + staging, host rows);
- what the runtime cannot hold is a ConfigError (a cache or activation disk share, CPU attention over a cache
  wholly on the device), and the planner never proposes it; CPU attention over a split cache is accepted
  (tests/offload/test_offload_split_delegation.py runs it);
- on the cupy stand-in, a split cache gives NumPy's tokens and bytes, every host copy on the copy engine.
"""

from __future__ import annotations

import pytest

import offload_models as base
import test_offload_kv_quant as kvq
from hpcinfer.config import OffloadSection
from hpcinfer.errors import ConfigError
from hpcinfer.offload.budget import kv_plan_bytes
from hpcinfer.offload.lp import search_policy, solve_placement
from hpcinfer.offload.sizes import device_rows
from hpcinfer.parallel.micro_batches import micro_batches
from offload_models import MAX_NEW, PROMPT_LENGTHS, config_for, host_kvs, make_prompts, offload, preset
from test_offload_policy import ARCH, DEVICE_FOR_CACHE, KV, N as GEN, S, machine

HEADS, HEAD_DIM, LAYERS, K = 4, 16, 4, 3          # tiny-dense: 4 KV heads of 16, 4 layers; 3 GPU batches (3, 3, 2)
SPLITS = (0, 33, 50, 100)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


def zigzag(cache_gpu: float, **keys) -> OffloadSection:
    return offload(None, weights_gpu=0, weights_cpu=100, cache_gpu=cache_gpu, cache_cpu=100 - cache_gpu,
                   schedule="zigzag", num_gpu_batches=K, **keys)


def link_bytes(cache_gpu: float, row_bytes: int) -> tuple[int, int]:
    """(to device, to host) bytes the zig-zag windows move for PROMPT_LENGTHS over K GPU batches: per step,
    layer and batch, K and V of the batch's host rows at the load / store positions."""
    to_device = to_host = 0
    for group in micro_batches(len(PROMPT_LENGTHS), K):
        lengths = [PROMPT_LENGTHS[i] for i in group]
        host_rows = len(group) * HEADS - device_rows(len(group) * HEADS, cache_gpu)
        to_host += max(lengths) * host_rows                                    # prefill: stores [0, max prompt)
        for j in range(1, MAX_NEW):                                            # decode: starts = prompt + j - 1
            to_device += (max(lengths) + j - 1) * host_rows
            to_host += (max(lengths) - min(lengths) + 1) * host_rows
    scale = 2 * row_bytes * LAYERS                                             # K and V, every layer
    return to_device * scale, to_host * scale


@pytest.fixture(scope="module")
def dense_reference(prompts):
    """All on the device, no [offload]: the tokens every split must give."""
    return base.generate(base.build(preset("tiny-dense")), prompts)[0]


@pytest.fixture(scope="module")
def int4_reference(prompts):
    off = zigzag(100)
    return kvq.generate(kvq.build(kvq.source(), off, "int4"), prompts, off)[0]


@pytest.mark.parametrize("cache_gpu", SPLITS)
@pytest.mark.parametrize("kv", ["float", "int4"])
def test_split_caches_give_the_all_on_device_tokens_and_move_only_host_rows(prompts, dense_reference, int4_reference,
                                                                              monkeypatch, kv, cache_gpu):
    off = zigzag(cache_gpu)
    made = host_kvs(monkeypatch)
    if kv == "float":
        out, times = base.generate(base.build(preset("tiny-dense"), off), prompts, off)
        want, row_bytes = dense_reference, HEAD_DIM * 4
    else:
        out, times = kvq.generate(kvq.build(kvq.source(), off, "int4"), prompts, off)
        want, row_bytes = int4_reference, 16 // 2 + 4                          # 8 bytes of nibbles + fp16 scale, min
    assert out == want
    assert (times.kv_bytes_to_device, times.kv_bytes_to_host) == link_bytes(cache_gpu, row_bytes)
    (host_kv,) = made
    if cache_gpu == 100:                                                       # today's all-on-device path
        assert host_kv.host == {} and host_kv.staging == [] and times.kv_bytes_to_host == 0
    else:
        for b, group in enumerate(micro_batches(len(PROMPT_LENGTHS), K)):
            rows = len(group) * HEADS
            device = host_kv.device[b].k[0].shape[0] if b in host_kv.device else 0
            assert (device, host_kv.host[b].k[0].shape[0]) == (device_rows(rows, cache_gpu),
                                                               rows - device_rows(rows, cache_gpu))


def test_the_link_bytes_shrink_with_the_host_rows():
    """The expectation itself: 0 moves every row, 100 none, in between in proportion (to the rounding)."""
    moved = [sum(link_bytes(c, 64)) for c in SPLITS]
    assert moved[0] > moved[1] > moved[2] > moved[3] == 0
    assert moved[2] == moved[0] // 2                                            # 3, 3, 2 sequences: even rows


@pytest.mark.parametrize("cache_gpu, cpu_attention", [(0, False), (33, False), (50, False), (0, True)])
def test_the_budget_plan_counts_the_arrays_the_runtime_allocates(prompts, tmp_path, monkeypatch, cache_gpu,
                                                                  cpu_attention):
    keys = dict(weights_gpu=0, weights_cpu=100, cache_gpu=cache_gpu, cache_cpu=100 - cache_gpu, schedule="zigzag",
                num_gpu_batches=K, cpu_attention=cpu_attention)
    config = config_for(tmp_path, **keys)
    device, host, staging = kv_plan_bytes(preset("tiny-dense").arch, config, LAYERS, list(PROMPT_LENGTHS))
    made = host_kvs(monkeypatch)
    off = config.offload
    _, times = base.generate(base.build(preset("tiny-dense"), off), prompts[:], off)
    (host_kv,) = made
    assert host == sum(c.nbytes for c in host_kv.host.values()) > 0
    assert device == sum(c.nbytes for c in host_kv.device.values())
    assert staging == host_kv.staging_bytes
    assert device + staging == times.kv_peak_device_bytes
    assert (staging == 0) == cpu_attention


@pytest.mark.parametrize("keys, names", [
    (dict(cache_gpu=50, cache_cpu=0), ["offload.cache_gpu + offload.cache_cpu", "must be 100"]),
    (dict(cache_gpu=0, cache_cpu=0), ["offload.cache_gpu + offload.cache_cpu", "must be 100"]),
    (dict(act_gpu=50, act_cpu=0), ["offload.act_gpu + offload.act_cpu = 50", "must be 100"]),
    (dict(act_gpu=0, act_cpu=0), ["offload.act_gpu + offload.act_cpu = 0", "must be 100"]),
    (dict(cache_gpu=100, cache_cpu=0, cpu_attention=True), ["cpu_attention", "cache_gpu = 100", "cache_gpu < 100"]),
], ids=["cache-disk-share", "cache-all-disk", "act-disk-share", "act-disk", "cpu-attention-all-on-device"])
def test_what_the_runtime_cannot_hold_is_an_error(tmp_path, keys, names):
    with pytest.raises(ConfigError) as info:
        config_for(tmp_path, weights_gpu=0, weights_cpu=100, schedule="zigzag", **keys)
    for name in names:
        assert name in str(info.value), str(info.value)


def test_what_the_runtime_holds_is_accepted_and_runs(prompts, dense_reference, tmp_path, monkeypatch):
    """Each accepted placement holds the values given, and runs as given: the all-on-device tokens, with the
    cache's rows on the device and in host memory as the percentages say (CPU attention reads the host rows in
    place: no staging buffers)."""
    for keys in (dict(cache_gpu=33.33, cache_cpu=66.67), dict(cache_gpu=0, cache_cpu=100, cpu_attention=True),
                 dict(cache_gpu=50, cache_cpu=50, cpu_attention=True), dict(cache_gpu=100, cache_cpu=0)):
        off = config_for(tmp_path, weights_gpu=0, weights_cpu=100, schedule="zigzag", **keys).offload
        assert {k: getattr(off, k) for k in keys} == keys
        assert (off.weights_gpu, off.weights_cpu, off.schedule) == (0, 100, "zigzag")
        made = host_kvs(monkeypatch)
        out, times = base.generate(base.build(preset("tiny-dense"), off), prompts, off)
        assert out == dense_reference, keys
        (host_kv,) = made
        rows = len(PROMPT_LENGTHS) * HEADS                                     # one GPU batch: every sequence
        host_rows = rows - device_rows(rows, off.cache_gpu)
        assert (host_kv.host[0].k[0].shape[0] if host_kv.host else 0) == host_rows, keys
        assert (host_kv.staging == []) == (off.cpu_attention or host_rows == 0), keys


def test_cpu_attention_over_a_device_cache_is_refused_not_ignored(tmp_path):
    """cache_gpu = 100 leaves no host cache for CPU attention to read: it would do nothing, so it is an error
    naming both keys and the placement it needs."""
    with pytest.raises(ConfigError) as caught:
        config_for(tmp_path, weights_gpu=0, weights_cpu=100, schedule="zigzag", cache_gpu=100, cache_cpu=0,
                   cpu_attention=True)
    for fragment in ("offload.cpu_attention = true", "offload.cache_gpu = 100", "cache_gpu = 0, cache_cpu = 100"):
        assert fragment in str(caught.value)


def test_the_planner_splits_the_cache_between_device_and_host_only():
    """A device too small for the whole cache (half of it less than DEVICE_FOR_CACHE): the plan moves cache rows to
    the host, never to disk, and keeps the activations on the device: the runtime runs it as printed."""
    hw = machine(device=DEVICE_FOR_CACHE - KV // 2)
    policy, _, candidates = search_policy(ARCH, S, GEN, hw, gpu_batch_sizes=[2], num_gpu_batches=[1, 2])
    for p, _ in candidates:
        assert p.cache_gpu + p.cache_cpu == 100 and (p.act_gpu, p.act_cpu) == (100, 0)
        assert not p.cpu_attention or p.cache_gpu < 100                       # something to delegate
    assert policy.cache_cpu > 0                                                 # the cache did have to move
    with pytest.raises(ValueError, match="cache_disk = 10"):
        solve_placement(ARCH, S, GEN, 2, 1, hw, fixed={"cache_disk": 10})
    with pytest.raises(ValueError, match="act_gpu = 50"):
        solve_placement(ARCH, S, GEN, 2, 1, hw, schedule="row", fixed={"act_gpu": 50})


def test_a_split_cache_on_emulated_cupy_gives_numpys_tokens_and_bytes():
    """cache_gpu = 50 over 2 GPU batches of the stand-in for cupy: the device rows move by device copies on the
    compute stream, the host rows on the copy stream (a read before its event fails there); the tokens and the
    bytes over the link are the NumPy run's, and only the host rows' bytes were copied asynchronously."""
    off = offload(None, weights_gpu=100, cache_gpu=50, cache_cpu=50, schedule="zigzag", num_gpu_batches=2)
    base.emulated_cupy_matches_numpy(off, "kv")
