"""Weight offload and the offloaded schedules (hpcinfer/offload/), in one process on the NumPy backend.

The model is built as `hpcinfer run` builds it (runtime._weight_tiers: the Decoder's blocks placed in their tiers as
they load) and generation runs as the job runs it (generate/schedules.run_block: the row or zig-zag schedule of
`[offload]`). Presets give the weights: "tiny-dense" (4 GPT-2 style layers of 195 KiB), a 12-layer stand-in of
it, and "tiny-moe" (experts in layers 1 and 3): no file, no torch.

What must hold:
- under every placement and schedule, greedy tokens are exactly those of the all-on-device run;
- accounting: the device weight bytes never exceed the resident layers + (prefetch_layers + 1) streamed layers;
  a model several times larger than the device budget runs within it;
- the disk tier is files, one per tensor, read back during the run; disk layers have no host copy;
- zig-zag fetches each streamed layer once per token step for the whole block, row once per GPU batch per step;
  the prefetch wraps from the last layer of a step into the next step;
- a host-resident KV cache leaves the device (two staging buffers of one layer, or none with CPU attention);
- int8 / int4 weights stream as QuantizedTensors, their quantized bytes counted and moved, with the tokens of the
  quantized run without offload;
- the runtime, the budget plan and the planner's cost model count the same bytes (tables and layers).
"""

from __future__ import annotations

import dataclasses
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.errors import ConfigError
from hpcinfer.generate.engine import GenerationParams
from hpcinfer.parallel.micro_batches import micro_batches
from hpcinfer.generate.schedules import zigzag
from hpcinfer.offload.budget import check_budgets, plan_bytes
from hpcinfer.offload.tiers import WeightTiers, layer_tensors, parts_of, place_layers
from hpcinfer.parallel.stages import partition_layers
from offload_models import (MAX_NEW, N, PROMPT_LENGTHS, build, config_for, generate, host_kvs, make_prompts, offload,
                            preset)


# ---------------------------------------- helpers (building and running the model: tests/helpers/offload_models.py)

@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def dense_reference(prompts):
    """All on the device, no [offload]: the tokens every placement must give."""
    out, _ = generate(build(preset("tiny-dense")), prompts)
    assert all(len(tokens) == MAX_NEW for tokens, _ in out)
    assert len({tuple(tokens) for tokens, _ in out}) == N                   # the tokens vary
    return out


@pytest.fixture
def fetch_log(monkeypatch):
    """Instrumented WeightTiers: after every fetch, (layer, device_bytes, peak_bytes); every read, (layer,
    thread name). Returns {'fetch': [...], 'read': [...], 'tiers': [the WeightTiers made]}."""
    log = {"fetch": [], "read": [], "tiers": []}
    lock = threading.Lock()
    fetch, read, init = WeightTiers.fetch, WeightTiers._read, WeightTiers.__init__

    def logged_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        log["tiers"].append(self)

    def logged_fetch(self, i):
        fetch(self, i)
        with self.lock:
            log["fetch"].append((i, self.device_bytes, self.peak_bytes))

    def logged_read(self, i):
        with lock:
            log["read"].append((i, threading.current_thread().name))
        return read(self, i)

    monkeypatch.setattr(WeightTiers, "__init__", logged_init)
    monkeypatch.setattr(WeightTiers, "fetch", logged_fetch)
    monkeypatch.setattr(WeightTiers, "_read", logged_read)
    return log


def tail_reads(tiers: WeightTiers) -> int:
    """Bytes of the layers prefetched past a run's last token step: the first streamed layers of a step that never
    comes (the prefetch wraps from the last layer of a step to the first of the next); `close` drops them."""
    streamed = [i for i, t in enumerate(tiers.tiers) if t != "device"]
    extra = min(tiers.prefetch_layers, len(streamed) - 1) if tiers.pool is not None else 0
    return sum(tiers.layer_bytes[i] for i in streamed[:max(extra, 0)])


def window_bound(tiers: WeightTiers) -> int:
    """Resident layers + the (prefetch_layers + 1) largest streamed layers: the most the device may hold."""
    resident = sum(b for b, t in zip(tiers.layer_bytes, tiers.tiers) if t == "device")
    streamed = sorted((b for b, t in zip(tiers.layer_bytes, tiers.tiers) if t != "device"), reverse=True)
    return resident + sum(streamed[:tiers.prefetch_layers + 1])


# ------------------------------------------------------------------------------------------------- placement

def test_place_layers_puts_device_then_host_then_disk_layers():
    assert place_layers(4, 100, 0) == ["device"] * 4
    assert place_layers(4, 0, 100) == ["host"] * 4
    assert place_layers(4, 0, 0) == ["disk"] * 4
    assert place_layers(4, 25, 25) == ["device", "host", "disk", "disk"]
    assert place_layers(10, 20, 30) == ["device"] * 2 + ["host"] * 3 + ["disk"] * 5
    assert place_layers(30, 20, 30) == ["device"] * 6 + ["host"] * 9 + ["disk"] * 15      # SmolLM2
    for n in (1, 3, 7, 30):
        for gpu, cpu in ((33, 33), (50, 50), (10, 0), (0, 70)):
            assert len(place_layers(n, gpu, cpu)) == n


# Named placements of the issue, each on the dense preset: [offload] keys.
PLACEMENTS = {
    "all-on-device-zigzag": dict(schedule="zigzag", num_gpu_batches=2),
    "all-on-device-row-device-budget": dict(device_memory="1GB"),
    "weights-host-row": dict(weights_gpu=0, weights_cpu=100),
    "weights-host-zigzag": dict(weights_gpu=0, weights_cpu=100, schedule="zigzag", num_gpu_batches=4),
    "weights-disk-row": dict(weights_gpu=0, weights_cpu=0),
    "weights-disk-zigzag": dict(weights_gpu=0, weights_cpu=0, schedule="zigzag", num_gpu_batches=2),
    "mixed-25-25-50": dict(weights_gpu=25, weights_cpu=25),
    "mixed-20-30-50-zigzag": dict(weights_gpu=20, weights_cpu=30, schedule="zigzag", num_gpu_batches=2),
    "mixed-50-50": dict(weights_gpu=50, weights_cpu=50, schedule="zigzag", num_gpu_batches=4),
    "cache-host": dict(weights_gpu=0, weights_cpu=100, cache_gpu=0, cache_cpu=100, schedule="zigzag",
                       num_gpu_batches=2),
    "cache-host-cpu-attention": dict(weights_gpu=0, weights_cpu=100, cache_gpu=0, cache_cpu=100,
                                     schedule="zigzag", num_gpu_batches=2, cpu_attention=True),
    "cache-half-host": dict(weights_gpu=25, weights_cpu=25, cache_gpu=50, cache_cpu=50, schedule="zigzag",
                            num_gpu_batches=4),
    "cache-third-on-device": dict(weights_gpu=25, weights_cpu=25, cache_gpu=33, cache_cpu=67, schedule="zigzag",
                                  num_gpu_batches=3),
    "gpu-batch-size-given": dict(weights_gpu=0, weights_cpu=100, schedule="zigzag", gpu_batch_size=2,
                                 num_gpu_batches=4),
}


@pytest.mark.parametrize("keys", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_every_placement_gives_the_tokens_of_the_all_on_device_run(prompts, dense_reference, tmp_path, keys,
                                                                   fetch_log):
    off = offload(tmp_path, **keys)
    assert off.active
    model = build(preset("tiny-dense"), off)
    out, times = generate(model, prompts, off)
    assert out == dense_reference
    tiers = model.weights
    assert tiers.tiers == place_layers(4, off.weights_gpu, off.weights_cpu)
    assert tiers.peak_bytes <= window_bound(tiers)
    assert (tiers.bytes_from_host > 0) == ("host" in tiers.tiers)
    assert (tiers.bytes_from_disk > 0) == ("disk" in tiers.tiers)
    assert times.generated_tokens == N * MAX_NEW
    if off.cache_gpu < 100 and off.schedule == "zigzag" and not off.cpu_attention:
        assert times.kv_bytes_to_host > 0 and times.kv_bytes_to_device > 0            # the cache really moves


SCHEDULES = [(schedule, k, prefetch) for schedule in ("row", "zigzag") for k in (1, 2, 4) for prefetch in (0, 1, 2)]


@pytest.mark.parametrize("schedule, num_gpu_batches, prefetch", SCHEDULES,
                         ids=[f"{s}-k{k}-prefetch{p}" for s, k, p in SCHEDULES])
def test_schedules_and_prefetch_depths_give_the_same_tokens_within_the_window(prompts, dense_reference, tmp_path,
                                                                              fetch_log, schedule,
                                                                              num_gpu_batches, prefetch):
    """Mixed placement (1 layer on the device, 1 in host memory, 2 on disk), every schedule x block x prefetch:
    the same tokens, and after every fetch the device holds at most resident + (prefetch + 1) streamed layers."""
    off = offload(tmp_path, weights_gpu=25, weights_cpu=25, schedule=schedule, num_gpu_batches=num_gpu_batches,
                  prefetch_layers=prefetch)
    model = build(preset("tiny-dense"), off)
    out, _ = generate(model, prompts, off)
    assert out == dense_reference
    tiers = model.weights
    bound = window_bound(tiers)
    assert fetch_log["fetch"], "no fetch was made"
    assert all(device <= bound and peak <= bound for _, device, peak in fetch_log["fetch"])
    assert tiers.peak_bytes <= bound
    resident = tiers.layer_bytes[0]
    assert tiers.peak_bytes >= resident + tiers.layer_bytes[1]                  # a streamed layer was there
    if prefetch == 0:                                                           # exactly one streamed layer
        assert tiers.peak_bytes == resident + max(tiers.layer_bytes[1:])
        assert all(name == threading.main_thread().name for _, name in fetch_log["read"])
    else:                                                                       # reads ran ahead, on threads
        assert any(name != threading.main_thread().name for _, name in fetch_log["read"])
    assert tiers.device_bytes == resident                                        # every streamed layer released


def test_early_stopping_at_eos_is_the_same_under_offload(prompts, tmp_path):
    """Sequences that stop early leave their GPU batch (zig-zag) or batch (row) while the others go on."""
    source = preset("tiny-dense")
    free, _ = generate(build(source), prompts)
    eos = free[0][0][2]                                         # a token some sequences produce mid-way
    source.arch = dataclasses.replace(source.arch, eos_token_ids=(eos,))
    params = GenerationParams(MAX_NEW, ignore_eos=False)
    reference, _ = generate(build(source), prompts, params=params)
    lengths = [len(t) for t, _ in reference]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths          # some stop, some run on
    for schedule in ("row", "zigzag"):
        off = offload(tmp_path / schedule, weights_gpu=0, weights_cpu=50, schedule=schedule, num_gpu_batches=4)
        out, _ = generate(build(source, off), prompts, off, params=params)
        assert out == reference, schedule


# ------------------------------------------------------------------------------------------------ accounting

def test_a_model_several_times_the_device_budget_runs_within_it(prompts, tmp_path, fetch_log):
    """16 layers of tiny-dense (3.2 MB of layers) with a device budget that holds the embedding tables, one
    streamed layer but not two, and one GPU batch's KV cache (the others' in host memory; zig-zag, 8 GPU batches
    of 1, no prefetch): the plan passes the budget check, prefetching one layer more does not, the run stays
    under the budget, and the tokens are those of the all-on-device run."""
    source = preset("tiny-dense", layers=16)
    arch = source.arch
    reference, _ = generate(build(source), prompts)
    keys = dict(weights_gpu=0, weights_cpu=50, disk_dir=str(tmp_path / "disk"), prefetch_layers=0,
                schedule="zigzag", num_gpu_batches=8, cache_gpu=0, cache_cpu=100)
    stages = partition_layers(arch, 1)
    plan = plan_bytes(arch, config_for(tmp_path, **keys), stages[0], list(PROMPT_LENGTHS))
    budget = int(plan["device"] + plan["parts"]["streaming window"] // 2)       # 1.5 layers + the rest
    model_bytes = arch.param_count() * 4
    assert model_bytes >= 4 * budget, (model_bytes, budget)                     # the model is 4x+ the budget
    config = config_for(tmp_path, **keys, device_memory=budget)
    check_budgets(arch, config, stages, list(PROMPT_LENGTHS))
    with pytest.raises(ConfigError, match="streaming window"):                  # two layers do not fit
        check_budgets(arch, config_for(tmp_path, **{**keys, "prefetch_layers": 1}, device_memory=budget), stages,
                      list(PROMPT_LENGTHS))

    model = build(source, config.offload)
    out, times = generate(model, prompts, config.offload)
    assert out == reference
    tiers = model.weights
    layer = tiers.layer_bytes[0]
    assert tiers.layer_bytes == [layer] * 16
    assert tiers.peak_bytes == layer                                             # one layer at a time
    assert max(device for _, device, _ in fetch_log["fetch"]) == layer
    outside = sum(int(getattr(h, k).nbytes) for part in (model.embed, model.positions, model.final_norm)
                  for h, k in layer_tensors(part))                               # tables, positions, final norm
    assert outside > arch.vocab_size * arch.hidden_size * 4
    assert 0 < times.kv_peak_device_bytes <= plan["parts"]["KV cache on the device"]   # two staging buffers
    assert 0 < times.act_peak_device_bytes == plan["parts"]["activations on the device"]
    peaks = tiers.peak_bytes + outside + times.kv_peak_device_bytes + times.act_peak_device_bytes
    assert peaks <= budget
    assert tiers.memory.peak["device"] == peaks                                  # the one counter: all of them
    assert len(fetch_log["read"]) == 16 * MAX_NEW                                 # every layer, every step


@pytest.mark.parametrize("schedule", ["row", "zigzag"])
def test_the_tiers_peak_use_stays_within_both_budgets(prompts, tmp_path, schedule):
    """16 layers of tiny-dense, half in host memory and half on disk, prefetch 1; zig-zag: the 8 prompts in 4 GPU
    batches, the KV cache all in host memory and 3/4 of the activation rows too; row (its cache and activations
    stay on the device, and the plan counts the whole block's cache): 2 prompts in 2 GPU batches. Budgets: exactly
    the plan's device and host bytes (the model is 4x+ the device budget and above the host budget). The tiers' two
    counters (device: layers, tables, KV cache with its staging, activations; host: layers, KV rows, activation
    rows) peak within them: at the plan exactly with zig-zag, whose caches and buffers live through the whole
    block; below it by row, which holds one GPU batch's cache at a time where the plan counts the block's."""
    source = preset("tiny-dense", layers=16)
    arch = source.arch
    count = N if schedule == "zigzag" else 2
    prompts, lengths = prompts[:count], list(PROMPT_LENGTHS[:count])
    reference, _ = generate(build(source), prompts)
    keys = dict(weights_gpu=0, weights_cpu=50, disk_dir=str(tmp_path / "disk"), prefetch_layers=1,
                schedule=schedule, num_gpu_batches=4 if schedule == "zigzag" else 2)
    if schedule == "zigzag":
        keys.update(cache_gpu=0, cache_cpu=100, act_gpu=25, act_cpu=75)
    stages = partition_layers(arch, 1)
    plan = plan_bytes(arch, config_for(tmp_path, count, **keys), stages[0], lengths)
    device_budget, host_budget = int(plan["device"]), int(plan["host"])
    model_bytes = arch.param_count() * 4
    assert model_bytes >= 4 * device_budget and model_bytes > host_budget, (model_bytes, plan)
    config = config_for(tmp_path, count, **keys, device_memory=device_budget, host_memory=host_budget)
    check_budgets(arch, config, stages, lengths)

    model = build(source, config.offload)
    out, times = generate(model, prompts, config.offload)
    assert out == reference
    memory = model.weights.memory
    assert 0 < memory.peak["device"] <= device_budget and 0 < memory.peak["host"] <= host_budget
    device, host = memory.peak_parts["device"], memory.peak_parts["host"]
    assert device["layers"] == 2 * model.weights.layer_bytes[0]                  # the one computing + 1 ahead
    assert device["embedding tables"] == plan["parts"]["embedding tables"]
    assert device["KV cache"] > 0 and device["activations"] > 0
    assert host["layers"] == plan["host_parts"]["host layers"]
    if schedule == "zigzag":
        assert memory.peak["device"] == device_budget and memory.peak["host"] == host_budget
        assert host["KV cache rows"] == plan["host_parts"]["KV cache rows in host memory"] > 0
        assert host["activation rows"] == plan["host_parts"]["activation rows in host memory"] > 0
        assert device["KV cache"] == times.kv_peak_device_bytes                   # two staging buffers
        assert device["activations"] == times.act_peak_device_bytes              # device rows + staging
    else:
        assert device["KV cache"] == times.kv_peak_device_bytes                   # one GPU batch's cache
        assert memory.peak["host"] == host_budget
    assert memory.total("device") == device["embedding tables"]                 # after the run: tables only
    from hpcinfer.metrics import held_bytes, offload_peaks                       # what the run's metrics report

    reported = offload_peaks([types.SimpleNamespace(held=held_bytes(model))])
    assert reported["offload_device_peak_bytes_per_rank"] == memory.peak["device"]
    assert reported["offload_host_peak_bytes_per_rank"] == memory.peak["host"]
    assert reported["offload_device_peak_parts"] == device and reported["offload_host_peak_parts"] == host
    assert offload_peaks([types.SimpleNamespace(held={"weights": 1})])["offload_device_peak_bytes_per_rank"] is None


def test_the_plan_puts_layers_in_the_tiers_the_run_uses(tmp_path):
    """budget.plan_bytes and the WeightTiers agree on which layers are where (mixed: 1 device, 1 host, 2 disk)."""
    source = preset("tiny-dense")
    keys = dict(weights_gpu=25, weights_cpu=25, disk_dir=str(tmp_path / "disk"), prefetch_layers=2)
    config = config_for(tmp_path, **keys)
    plan = plan_bytes(source.arch, config, partition_layers(source.arch, 1)[0], list(PROMPT_LENGTHS))
    tiers = build(source, config.offload).weights
    assert tiers.tiers == ["device", "host", "disk", "disk"]
    per_layer = plan["parts"]["resident layers"]                                # one resident layer
    assert plan["host"] == per_layer and plan["disk"] == 2 * per_layer
    assert plan["parts"]["streaming window"] == 3 * per_layer                   # prefetch 2 + the one in use
    tiers.close()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_the_plan_counts_every_byte_the_tiers_hold(tmp_path, name):
    """plan_bytes against the bytes the tiers really hold: layers (matrices, norms, biases, expert stacks), the
    streaming window, and the tables outside the layers (token and position tables, final norm)."""
    source = preset(name)
    keys = dict(weights_gpu=25, weights_cpu=25, disk_dir=str(tmp_path / "disk"), prefetch_layers=2)
    config = config_for(tmp_path, **keys)
    plan = plan_bytes(source.arch, config, partition_layers(source.arch, 1)[0], list(PROMPT_LENGTHS))
    model = build(source, config.offload)
    tiers = model.weights
    tiers.close()
    outside = sum(int(getattr(h, k).nbytes) for part in (model.embed, model.positions, model.final_norm)
                  for h, k in layer_tensors(part))
    assert plan["parts"]["embedding tables"] == outside
    by_tier = {t: sum(b for b, x in zip(tiers.layer_bytes, tiers.tiers) if x == t) for t in ("device", "host",
                                                                                            "disk")}
    assert plan["parts"]["resident layers"] == by_tier["device"]
    assert plan["parts"]["streaming window"] == 3 * max(tiers.layer_bytes[1:])
    assert plan["host"] == by_tier["host"] and plan["disk"] == by_tier["disk"]


def test_the_budget_error_names_every_part(tmp_path):
    source = preset("tiny-dense")
    config = config_for(tmp_path, weights_gpu=50, weights_cpu=50, device_memory="100KB")
    with pytest.raises(ConfigError) as info:
        check_budgets(source.arch, config, partition_layers(source.arch, 1), list(PROMPT_LENGTHS))
    message = str(info.value)
    for part in ("device_memory = 100,000 bytes", "resident layers", "streaming window", "embedding tables",
                 "KV cache"):
        assert part in message, message
    config = config_for(tmp_path, weights_gpu=0, weights_cpu=100, host_memory="1KB")
    with pytest.raises(ConfigError, match="host_memory = 1,000 bytes .* on the host"):
        check_budgets(source.arch, config, partition_layers(source.arch, 1), list(PROMPT_LENGTHS))


def test_the_host_budget_error_itemizes_layers_kv_rows_and_activation_rows(tmp_path):
    """Weights, the KV cache and the activations all in host memory (zig-zag, 2 GPU batches of 4): the host error
    names each part with its bytes, by hand for tiny-dense (4 layers, 4 KV heads of 16, D = 64): KV: 8 sequences x
    4 heads = 32 rows x 4 layers x (14 + 6 positions) x 16 values x 4 bytes x 2 (K, V) = 327,680; activations: the
    55 prompt tokens x 64 x 4 = 14,080; and its advice names every key that takes bytes out of the host."""
    from hpcinfer.offload.sizes import layer_bytes

    arch = preset("tiny-dense").arch
    config = config_for(tmp_path, weights_gpu=0, weights_cpu=100, cache_gpu=0, cache_cpu=100, act_gpu=0,
                        act_cpu=100, schedule="zigzag", num_gpu_batches=2, host_memory="1KB")
    layers = 4 * layer_bytes(arch, 0, 4)
    kv, acts = 32 * 4 * 20 * 16 * 4 * 2, sum(PROMPT_LENGTHS) * 64 * 4
    assert (kv, acts) == (327_680, 14_080)
    with pytest.raises(ConfigError) as info:
        check_budgets(arch, config, partition_layers(arch, 1), list(PROMPT_LENGTHS))
    message = str(info.value)
    for fragment in (f"host_memory = 1,000 bytes cannot hold this plan: {layers + kv + acts:,} bytes needed on the "
                     f"host (host layers {layers:,}, KV cache rows in host memory {kv:,}, activation rows in host "
                     f"memory {acts:,})", "lower weights_cpu", "cache_cpu", "act_cpu", "or raise host_memory"):
        assert fragment in message, message


# ------------------------------------------------------------------------------------------------------ disk

def test_the_disk_tier_is_one_file_per_tensor_read_back_during_the_run(prompts, dense_reference, tmp_path,
                                                                       fetch_log):
    off = offload(tmp_path, weights_gpu=25, weights_cpu=0, schedule="zigzag", num_gpu_batches=2)
    model = build(preset("tiny-dense"), off)
    tiers = model.weights
    assert tiers.tiers == ["device", "disk", "disk", "disk"]
    rank_dir = Path(off.disk_dir) / "rank00000"                                 # runtime._weight_tiers' folder
    files = sorted(rank_dir.iterdir())
    expected = sorted(Path(p) for (layer, _), paths in tiers.disk.items() for p in paths
                      if tiers.tiers[layer] == "disk")
    assert files == expected
    assert len(files) == sum(len(tiers.tensors[i]) for i in (1, 2, 3))         # one file per (float) tensor
    payload = sum(int(np.load(f, mmap_mode="r").nbytes) for f in files)
    assert payload == sum(tiers.layer_bytes[1:])
    # No copy of a disk layer anywhere but its files: not in the host store, not in the blocks.
    assert tiers.host == {}
    for i in (1, 2, 3):
        assert all(getattr(holder, key) is None for holder, key in tiers.tensors[i])
    held = sum(int(np.asarray(getattr(h, k)).nbytes) for h, k in tiers.tensors[0])
    assert held == tiers.layer_bytes[0] < sum(tiers.layer_bytes) / 3

    out, _ = generate(model, prompts, off)
    assert out == dense_reference
    assert tiers.bytes_from_host == 0
    assert tiers.bytes_from_disk == MAX_NEW * sum(tiers.layer_bytes[1:]) + tail_reads(tiers)   # once per step
    assert sorted({i for i, _ in fetch_log["read"]}) == [1, 2, 3]


def test_disk_reads_go_through_a_memory_map(prompts, tmp_path, monkeypatch):
    """`np.load(..., mmap_mode="r")`, never a whole-file read into a second buffer first."""
    modes = []
    load = np.load

    def logged_load(path, *args, **kwargs):
        modes.append(kwargs.get("mmap_mode"))
        return load(path, *args, **kwargs)

    off = offload(tmp_path, weights_gpu=0, weights_cpu=0)
    model = build(preset("tiny-dense"), off)
    monkeypatch.setattr(np, "load", logged_load)
    generate(model, prompts[:2], off)
    assert modes and set(modes) == {"r"}


def test_host_memory_holds_only_the_host_layers(tmp_path):
    """weights 0 / 30 / 70 over 10 layers: 3 layers in the host store, 7 as files; the host store is below a
    third of the model."""
    source = preset("tiny-dense", layers=10)
    off = offload(tmp_path, weights_gpu=0, weights_cpu=30)
    tiers = build(source, off).weights
    assert tiers.tiers == ["host"] * 3 + ["disk"] * 7
    host_bytes = sum(sum(int(a.nbytes) for a in (v if isinstance(v, list) else [v])) for v in tiers.host.values())
    assert host_bytes == sum(tiers.layer_bytes[:3]) < source.arch.param_count() * 4 / 3
    assert {layer for layer, _ in tiers.host} == {0, 1, 2}
    assert {layer for layer, _ in tiers.disk} == set(range(3, 10))
    tiers.close()


# -------------------------------------------------------------------------------------------- fetch counts

@pytest.mark.parametrize("num_gpu_batches", (1, 2, 4))
def test_zigzag_loads_each_layer_once_per_step_row_once_per_gpu_batch(prompts, dense_reference, tmp_path,
                                                                      fetch_log, num_gpu_batches):
    """The bytes read from the host are k times larger row by row than zig-zag for k GPU batches."""
    counts, moved = {}, {}
    for schedule in ("row", "zigzag"):
        off = offload(tmp_path, weights_gpu=0, weights_cpu=100, schedule=schedule, num_gpu_batches=num_gpu_batches)
        fetch_log["read"].clear()
        model = build(preset("tiny-dense"), off)
        out, _ = generate(model, prompts, off)
        assert out == dense_reference
        counts[schedule] = {i: sum(1 for j, _ in fetch_log["read"] if j == i) for i in range(4)}
        moved[schedule] = model.weights.bytes_from_host
        layer_total = sum(model.weights.layer_bytes)
    # + 1 read of layer 0: prefetched (prefetch_layers = 1) after the last step, for a step that never comes
    assert counts["zigzag"] == {i: MAX_NEW + (i == 0) for i in range(4)}                  # once per token step
    assert counts["row"] == {i: MAX_NEW * num_gpu_batches + (i == 0) for i in range(4)}   # once per GPU batch, step
    layer = layer_total // 4
    assert moved["zigzag"] - layer == MAX_NEW * layer_total
    assert moved["row"] - layer == num_gpu_batches * (moved["zigzag"] - layer)


@pytest.mark.parametrize("schedule", ("row", "zigzag"))
def test_the_prefetch_wraps_into_the_next_token_step(prompts, dense_reference, tmp_path, fetch_log, schedule):
    """With prefetch, the last layer of step t starts reading the first streamed layer of step t + 1 (and row by
    row, the last step of a GPU batch the first layer of the next GPU batch's first step): after the run's first
    read, every read runs on the prefetch thread, none waits at a step's start."""
    off = offload(tmp_path, weights_gpu=0, weights_cpu=100, schedule=schedule, num_gpu_batches=2)
    model = build(preset("tiny-dense"), off)
    out, _ = generate(model, prompts, off)
    assert out == dense_reference
    main = threading.main_thread().name
    reads = fetch_log["read"]
    assert reads[0] == (0, main)                                        # the run's first layer, first step
    assert all(name != main for _, name in reads[1:]), reads
    assert [i for i, _ in reads] == [0, 1, 2, 3] * (len(reads) // 4) + [0]     # cyclic, one wrapped read at the end
    assert model.weights.device_bytes == 0 and model.weights.pending == {}     # close() dropped it


# ------------------------------------------------------------------------------------------------------- MoE

MOE_CASES = {
    "host-row": dict(weights_gpu=0, weights_cpu=100),
    "disk-row-prefetch2": dict(weights_gpu=0, weights_cpu=0, prefetch_layers=2),
    "mixed-zigzag-k1": dict(weights_gpu=25, weights_cpu=25, schedule="zigzag"),
    "host-zigzag-k2": dict(weights_gpu=0, weights_cpu=100, schedule="zigzag", num_gpu_batches=2),
    "disk-zigzag-k4-cache-host": dict(weights_gpu=0, weights_cpu=0, schedule="zigzag", num_gpu_batches=4,
                                      cache_gpu=0, cache_cpu=100),
    "mixed-row-k2-prefetch0": dict(weights_gpu=50, weights_cpu=25, num_gpu_batches=2, prefetch_layers=0),
}


@pytest.mark.parametrize("keys", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_moe_layers_stream_like_dense_ones(prompts, tmp_path, keys, fetch_log):
    """tiny-moe: the expert stacks (lists of arrays) are streamed as one layer. With a capacity factor the tokens
    a GPU batch routes depend on which sequences share the step, so the all-on-device reference runs the same GPU
    batches (one generate_batch per group): the all-on-device answer of that block shape."""
    source = preset("tiny-moe")
    off = offload(tmp_path, **keys)
    reference_model = build(source)
    reference = []
    for group in micro_batches(N, off.num_gpu_batches):
        out, _ = generate(reference_model, [prompts[i] for i in group])
        reference += out
    model = build(source, off)
    out, _ = generate(model, prompts, off)
    assert out == reference
    tiers = model.weights
    experts = [i for i in range(4) if source.arch.experts_in(i)]
    assert experts == [1, 3] and tiers.layer_bytes[1] > 4 * tiers.layer_bytes[0]          # experts dominate
    stacks = [(i, n) for i in experts for n, kind in enumerate(tiers.kinds[i]) if kind[0] == "list"]
    assert stacks, "no expert stack was found among the layer's tensors"
    assert tiers.peak_bytes <= window_bound(tiers)
    assert all(device <= window_bound(tiers) for _, device, _ in fetch_log["fetch"])


# --------------------------------------------------------------------------------------------- the KV cache

def device_caches(monkeypatch, model_ops_holder: list) -> list:
    """Instrument KVCache: the bytes of every cache made with the model's (device) ops."""
    from hpcinfer.generate import kv_cache

    made = []
    init = kv_cache.KVCache.__init__

    def logged(self, ops, *args, **kwargs):
        init(self, ops, *args, **kwargs)
        if model_ops_holder and ops is model_ops_holder[0]:
            made.append(sum(int(a.nbytes) for a in self.k) + sum(int(a.nbytes) for a in self.v))

    monkeypatch.setattr(zigzag.KVCache, "__init__", logged)
    return made


@pytest.mark.parametrize("cpu_attention", (False, True), ids=["staging", "cpu-attention"])
def test_a_host_resident_kv_cache_does_not_occupy_the_device(prompts, dense_reference, tmp_path, monkeypatch,
                                                             cpu_attention):
    """cache_gpu = 0 over 4 GPU batches: the device holds two staging buffers of one layer of a GPU batch (one
    loaded while the other computes, stored after), or none with CPU attention, which works on the host caches in
    place."""
    off = offload(tmp_path, weights_gpu=0, weights_cpu=100, cache_gpu=0, cache_cpu=100, schedule="zigzag",
                  num_gpu_batches=4, cpu_attention=cpu_attention)
    model = build(preset("tiny-dense"), off)
    holder = [model.ops]
    device = device_caches(monkeypatch, holder)
    made = host_kvs(monkeypatch)
    out, times = generate(model, prompts, off)
    assert out == dense_reference
    (host_kv,) = made
    assert sorted(host_kv.host) == [0, 1, 2, 3]
    for cache in host_kv.host.values():                                      # the keys were written on the host
        assert all(np.abs(k).sum() > 0 for k in cache.k)
    whole = sum(c.nbytes for c in host_kv.host.values())
    if cpu_attention:
        assert device == [] and times.kv_peak_device_bytes == 0
        assert times.kv_bytes_to_device == times.kv_bytes_to_host == 0
    else:
        layers = len(host_kv.host[0].k)                                      # one layer of one of 4 batches, twice
        assert device == [whole / 4 / layers] * 2 and sum(device) == times.kv_peak_device_bytes
        assert times.kv_bytes_to_device > 0 and times.kv_bytes_to_host > 0


def test_half_of_every_gpu_batchs_cache_rows_stay_on_the_device(prompts, dense_reference, tmp_path, monkeypatch):
    """cache_gpu = 50 is half of every GPU batch's (sequence, KV head) rows on the device, the other half in host
    memory (tensor granularity): every batch passes through the staging buffers, and half its rows move."""
    off = offload(tmp_path, weights_gpu=0, weights_cpu=100, cache_gpu=50, cache_cpu=50, schedule="zigzag",
                  num_gpu_batches=4)
    model = build(preset("tiny-dense"), off)
    device = device_caches(monkeypatch, [model.ops])
    made = host_kvs(monkeypatch)
    out, times = generate(model, prompts, off)
    assert out == dense_reference
    (host_kv,) = made
    assert sorted(host_kv.host) == sorted(host_kv.device) == [0, 1, 2, 3]
    assert all(host_kv.host[b].nbytes == host_kv.device[b].nbytes for b in range(4))   # half and half
    assert len(device) == 6                                  # the device rows of batches 0..3, 2 staging buffers
    assert times.kv_peak_device_bytes == sum(device)


@pytest.mark.parametrize("keys", [dict(cache_gpu=0, cache_cpu=100),
                                  dict(cache_gpu=0, cache_cpu=100, cpu_attention=True)],
                         ids=["cache-on-host", "cpu-attention"])
def test_the_row_schedule_refuses_a_host_resident_cache(tmp_path, keys):
    """Row by row runs one GPU batch at a time with its cache on the device: asking for more is an error."""
    with pytest.raises(ConfigError, match="zigzag"):
        config_for(tmp_path, weights_gpu=0, weights_cpu=100, schedule="row", **keys)
    config_for(tmp_path, weights_gpu=0, weights_cpu=100, schedule="zigzag", **keys)       # zig-zag takes it


# ------------------------------------------------------------------------------------------ quantized weights

def held_bytes(block) -> int:
    """Bytes of the weights a block holds now (quantized parts, arrays, expert stacks)."""
    return sum(int(a.nbytes) for h, k in layer_tensors(block) for a in parts_of(getattr(h, k)))


def quantized_preset(mode: str, layers: int | None = None) -> PresetSource:
    """A preset quantized while it loads, as `[model] quantize = mode` does (quant/storage.configure)."""
    from hpcinfer.quant.storage import configure

    source = preset("tiny-dense", layers)
    configure(source, mode, 64)
    return source


@pytest.fixture(scope="module")
def quantized_reference(prompts):
    """The all-on-device quantized runs: the tokens every offloaded quantized run must give."""
    return {mode: generate(build(quantized_preset(mode)), prompts)[0] for mode in ("int8", "int4")}


QUANT_CASES = [(mode, keys) for mode in ("int8", "int4") for keys in (
    dict(weights_gpu=0, weights_cpu=100),
    dict(weights_gpu=0, weights_cpu=0, prefetch_layers=2),
    dict(weights_gpu=25, weights_cpu=25, schedule="zigzag", num_gpu_batches=2),
    dict(weights_gpu=0, weights_cpu=50, schedule="zigzag", num_gpu_batches=4, prefetch_layers=0))]


@pytest.mark.parametrize("mode, keys", QUANT_CASES,
                         ids=[f"{m}-" + "-".join(f"{v}" for v in k.values()) for m, k in QUANT_CASES])
def test_quantized_layers_stream_their_quantized_bytes(prompts, quantized_reference, tmp_path, mode, keys):
    """int8 / int4 weights under offload: the QuantizedTensors (q, scale, min) move between the tiers, the bytes
    counted and moved are the quantized bytes, and the tokens are those of the quantized run without offload."""
    from hpcinfer.quant.formats import QuantizedTensor

    source = quantized_preset(mode)
    whole = [held_bytes(b) for b in build(source).blocks]
    off = offload(tmp_path, **keys)
    model = build(source, off)
    tiers = model.weights
    assert tiers.layer_bytes == whole                                     # what the layers hold, quantized
    float_layer = held_bytes(build(preset("tiny-dense")).blocks[0])
    assert whole[0] < float_layer / (3.5 if mode == "int8" else 5)     # int8 ~4x, int4 (group 64) ~6.4x smaller
    quant_slots = [n for n, kind in enumerate(tiers.kinds[3]) if kind[0] == "quant"]
    assert len(quant_slots) == 4                                          # qkv, o, up, down
    stored = tiers.host if tiers.tiers[3] == "host" else tiers.disk
    assert all(len(stored[3, n]) == (2 if mode == "int8" else 3) for n in quant_slots)      # q, scale (, min)
    assert all(getattr(h, k) is None for h, k in tiers.tensors[3])        # nothing of it left on the device
    seen = []
    fetch = tiers.fetch

    def spy(i):
        fetch(i)
        seen.extend(type(getattr(h, k)) for h, k in tiers.tensors[i])

    tiers.fetch = spy
    out, _ = generate(model, prompts, off)
    assert out == quantized_reference[mode]
    assert QuantizedTensor in seen
    streamed = [b for b, t in zip(tiers.layer_bytes, tiers.tiers) if t != "device"]
    steps = MAX_NEW * (1 if off.schedule == "zigzag" else off.num_gpu_batches)
    assert tiers.bytes_from_host + tiers.bytes_from_disk == steps * sum(streamed) + tail_reads(tiers)
    assert tiers.peak_bytes <= window_bound(tiers)


def test_quantized_disk_layers_are_files_of_their_quantized_parts(tmp_path):
    """int4 on disk: one file per part (q uint8 packed, scale, min), nothing else."""
    source = quantized_preset("int4")
    off = offload(tmp_path, weights_gpu=0, weights_cpu=0)
    tiers = build(source, off).weights
    files = sorted((Path(off.disk_dir) / "rank00000").iterdir())
    assert len(files) == sum(len(paths) for paths in tiers.disk.values())
    assert sum(int(np.load(f, mmap_mode="r").nbytes) for f in files) == sum(tiers.layer_bytes)
    q_files = [paths[0] for (i, n), paths in tiers.disk.items() if tiers.kinds[i][n][0] == "quant"]
    assert q_files and all(np.load(p, mmap_mode="r").dtype == np.uint8 for p in q_files)
    tiers.close()



# ------------------------------------------------------------------ the planner and the runtime count alike

def llama_like() -> PresetSource:
    """tiny-dense reshaped as a Llama: RMSNorm (no bias), rotary positions, an untied LM head."""
    arch = dataclasses.replace(PRESETS["tiny-dense"], norm="rmsnorm", position="rotary", rotary_dim=16,
                               tied_embeddings=False)
    return PresetSource("tiny-llama", arch)


SIZE_CASES = {"gpt2-like": lambda: preset("tiny-dense"), "llama-like": llama_like,
              "moe": lambda: preset("tiny-moe"), "int8": lambda: quantized_preset("int8"),
              "int4": lambda: quantized_preset("int4")}


@pytest.mark.parametrize("name", SIZE_CASES)
def test_budget_cost_model_and_runtime_count_the_same_bytes(tmp_path, name):
    """The embedding tables (token and position tables, final norm, LM head) and the layers, three ways: what the
    runtime holds, budget.plan_bytes, and the cost model's ModelSizes. (The cost model used to spread the tables
    over the layers as streamed weights while the runtime keeps them on the device; RMSNorm final norms and
    quantized tensors were counted as float LayerNorm ones.)"""
    from hpcinfer.offload.cost_model import ModelSizes
    from hpcinfer.quant.storage import quant_of

    source = SIZE_CASES[name]()
    arch = source.arch
    model = build(source)
    tables = sum(held_bytes(part) for part in {id(p): p for p in (model.embed, model.positions, model.final_norm,
                                                                  model.lm_head) if p is not None}.values())
    layers = [held_bytes(b) for b in model.blocks]
    config = config_for(tmp_path, weights_gpu=25, weights_cpu=75)
    plan = plan_bytes(arch, config, partition_layers(arch, 1)[0], list(PROMPT_LENGTHS), quant_of(source))
    sizes = ModelSizes.of(arch, "float32", quant_of(source))
    assert plan["parts"]["embedding tables"] == sizes.table_bytes == tables
    assert plan["parts"]["resident layers"] == layers[0] and plan["host"] == sum(layers[1:])
    assert sizes.layer_weight_bytes * arch.num_layers == sum(layers)
    assert sizes.total_weight_bytes == sum(layers) + tables
