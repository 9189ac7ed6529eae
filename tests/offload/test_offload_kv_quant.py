"""A quantized KV cache (`[model] kv_cache = "int8" | "int4"`) under FlexGen's zig-zag schedule, and the budget,
cost model and policy search counting the cache at the format's bytes (offload/sizes.kv_token_bytes).

The byte rule (quant/kv.py): a cached row of head_dim hd, groups of g, holds hd * bits / 8 bytes of values and a
float16 scale and minimum per group, 4 hd / g bytes; float32 holds 4 hd. At hd = 64, g = 64 (SmolLM2's shape):
int8 68 bytes (256 / 68 = 3.76x smaller), int4 36 bytes (256 / 36 = 7.11x). The tiny preset (hd = 16, g clamped
to 16): int8 20 bytes (3.2x), int4 12 bytes (5.33x).

What must hold, on the NumPy backend in one process (tp = 2 under mpiexec: tests/mpi/test_mpi_offload_kv_quant.py):
- zig-zag with a quantized cache on the device, in host memory through the staging buffers, or read in place by
  CPU attention, gives exactly the tokens of the row schedule with the same KV mode and GPU batches;
- the host caches and staging buffers hold QuantizedKV parts, and the KV bytes moved (host <-> device) are the float32
  bytes divided by exactly 4 hd / row_bytes: each load/store moves the quantized parts as they are;
- the budget check counts the cache at the format's bytes (a batch that float32 KV cannot fit, int4 fits), and
  its count is what the run holds; the cost model's KV term, and with it the LP, uses the same bytes.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.config import OffloadSection, load_config
from hpcinfer.errors import ConfigError
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules import run_block
from hpcinfer.model.transformer import Decoder
from hpcinfer.offload.budget import check_budgets, plan_bytes
from hpcinfer.offload.cost_model import CostModel, ModelSizes
from hpcinfer.offload.lp import search_policy
from hpcinfer.offload.policy import Policy
from hpcinfer.offload.profile import HardwareProfile
from hpcinfer.offload.sizes import kv_token_bytes
from hpcinfer.parallel.stages import partition_layers
from hpcinfer.quant.kv import QuantizedKV, kv_format
from hpcinfer.runtime import _weight_tiers
from offload_models import host_kvs, window_positions

PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11, 4, 7)
MAX_NEW = 6
N = len(PROMPT_LENGTHS)
MAX_LEN = max(PROMPT_LENGTHS) + MAX_NEW                       # 20: every cache's Lmax
GREEDY = GenerationParams(MAX_NEW, ignore_eos=True)
MODES = ("int8", "int4")
ROW_BYTES = {(16, "int8"): 16 + 4, (16, "int4"): 8 + 4, (64, "int8"): 64 + 4, (64, "int4"): 32 + 4}


def source(head_dim: int = 16) -> PresetSource:
    """tiny-dense (4 layers, 4 KV heads of 16), or with heads of 64 (SmolLM2's head_dim; q/o widen to 256)."""
    arch = PRESETS["tiny-dense"]
    if head_dim != arch.head_dim:
        arch = dataclasses.replace(arch, head_dim=head_dim)
    return PresetSource(f"tiny-dense-hd{head_dim}", arch)


def build(src: PresetSource, off: OffloadSection, mode: str, groups: Groups | None = None, ops=None) -> Decoder:
    """The model as runtime._run builds it: weights in their tiers, the KV format of `[model] kv_cache`."""
    ops = ops or NumpyOps()
    model = Decoder(ops, groups or Groups(), src.arch, "float32")
    model.weights = _weight_tiers(types.SimpleNamespace(offload=off), model, ops, 0)
    model.load(src, after_block=model.weights.place if model.weights is not None else None)
    return model.set_attention(kv_format(mode, 64, src.arch.head_dim))


def generate(model: Decoder, prompts: list, off: OffloadSection):
    times = StepTimes()
    out = run_block(Runner(model, GREEDY), prompts, list(range(len(prompts))), times, ScheduleParams(), off)
    model.weights.close()
    return out, times


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENGTHS]


HOST = dict(weights_gpu=0, weights_cpu=100)
ROW = dict(HOST, num_gpu_batches=4)                            # the reference: the same 4 GPU batches, row by row
ZIGZAG = {
    "cache-device": dict(HOST, schedule="zigzag", num_gpu_batches=4),
    "cache-host-staging": dict(HOST, cache_gpu=0, cache_cpu=100, schedule="zigzag", num_gpu_batches=4),
    "cache-host-cpu-attention": dict(HOST, cache_gpu=0, cache_cpu=100, schedule="zigzag", num_gpu_batches=4,
                                     cpu_attention=True),
    "cache-half-host": dict(weights_gpu=25, weights_cpu=25, cache_gpu=50, cache_cpu=50, schedule="zigzag",
                            num_gpu_batches=4, prefetch_layers=2),
}


@pytest.fixture(scope="module")
def row_reference(prompts):
    """Row by row with the same KV mode and GPU batches: the tokens every zig-zag placement must give."""
    off = OffloadSection(**ROW)
    return {mode: generate(build(source(), off, mode), prompts, off)[0] for mode in MODES}


@pytest.mark.parametrize("placement", ZIGZAG)
@pytest.mark.parametrize("mode", MODES)
def test_zigzag_gives_the_row_schedules_tokens_with_a_quantized_cache(prompts, row_reference, tmp_path, monkeypatch,
                                                                     mode, placement):
    off = OffloadSection(**ZIGZAG[placement])
    if off.weights_gpu + off.weights_cpu < 100:
        off = dataclasses.replace(off, disk_dir=str(tmp_path / "disk"))
    made = host_kvs(monkeypatch)
    out, times = generate(build(source(), off, mode), prompts, off)
    assert out == row_reference[mode]
    (host_kv,) = made
    caches = list(host_kv.host.values()) + host_kv.staging
    assert len(host_kv.host) == (4 if off.cache_gpu < 100 else 0)       # tensor granularity: every batch
    assert all(isinstance(a, QuantizedKV) and a.fmt.mode == mode for c in caches for a in c.k + c.v)
    moves = off.cache_gpu < 100 and not off.cpu_attention
    assert (times.kv_bytes_to_device > 0) == moves and (times.kv_bytes_to_host > 0) == moves


def test_the_row_reference_is_the_quantized_run_without_offload(prompts, row_reference):
    """The reference is itself the int4 cache's answer: generation without [offload] (tests/quant/test_kv_quant.py's
    path) gives the same tokens."""
    from hpcinfer.generate.schedules.pipeline import generate_batch

    model = Decoder(NumpyOps(), Groups(), source().arch, "float32")
    model.load(source())
    model.set_attention(kv_format("int4", 64, model.arch.head_dim))
    plain = generate_batch(model, prompts, list(range(N)), GREEDY, StepTimes())
    assert plain == row_reference["int4"]


# ----------------------------------------------------------------------------------- bytes moved for the cache

def kv_moved(mode: str, head_dim: int, prompts) -> StepTimes:
    off = OffloadSection(**ZIGZAG["cache-host-staging"])
    return generate(build(source(head_dim), off, mode), prompts, off)[1]


@pytest.mark.parametrize("head_dim", (16, 64))
def test_the_staging_cache_moves_the_quantized_bytes(prompts, head_dim):
    """cache_gpu = 0 over 4 GPU batches: every layer of every step loads each batch's cached K and V positions to
    a staging buffer and stores the new ones back. Bytes, exactly: 4 layers * 2 (K, V) * 4 heads * row bytes *
    the positions of window_positions (each sequence of a batch moves its batch's window); float32 over quantized
    is 4 hd / row. Whole Lmax rows both ways would move over twice as much (checked)."""
    float_row = 4 * head_dim
    loads, stores = window_positions()
    expect = lambda row, positions: 4 * 2 * 4 * row * positions
    assert loads + stores < MAX_NEW * N * MAX_LEN          # under half the positions of whole Lmax rows both ways
    plain = kv_moved("none", head_dim, prompts)
    assert (plain.kv_bytes_to_device, plain.kv_bytes_to_host) == (expect(float_row, loads), expect(float_row, stores))
    for mode in MODES:
        row = ROW_BYTES[head_dim, mode]
        assert row_bytes_of(mode, head_dim) == row
        times = kv_moved(mode, head_dim, prompts)
        assert (times.kv_bytes_to_device, times.kv_bytes_to_host) == (expect(row, loads), expect(row, stores))
        assert plain.kv_bytes_to_device * row == times.kv_bytes_to_device * float_row      # 3.2x .. 7.11x fewer
        # the device holds two staging buffers of one layer of a GPU batch (2 sequences), at the quantized bytes
        assert times.kv_peak_device_bytes == 2 * 2 * 2 * 4 * MAX_LEN * row
    ratios = {mode: float_row / ROW_BYTES[head_dim, mode] for mode in MODES}
    if head_dim == 64:
        assert ratios == pytest.approx({"int8": 3.765, "int4": 7.111}, abs=1e-3)


def row_bytes_of(mode: str, head_dim: int) -> int:
    return kv_format(mode, 64, head_dim).row_bytes(head_dim)


# --------------------------------------------------------------------------------------------- the budget

def config_for(tmp_path, kv_cache: str = "none", **offload):
    keys = "\n".join(f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace("False", "false")
                     for k, v in offload.items())
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\npreset = "tiny-dense"\nkv_cache = "{kv_cache}"\n[generate]\nprompts = "p.jsonl"\n'
                    f'output = "o.jsonl"\nbatch_size = {N}\nmax_new_tokens = {MAX_NEW}\n[offload]\n{keys}\n')
    return load_config(str(path))


def test_the_budget_counts_the_cache_at_the_formats_bytes_and_admits_a_larger_batch(tmp_path):
    """The whole cache on the device: a device budget between the int4 plan and the float32 plan fits int4 only;
    the plan's KV part is N sequences * Lmax * 4 layers * kv_token_bytes, kv_token_bytes = 2 * 4 heads * row."""
    arch, stage = PRESETS["tiny-dense"], partition_layers(PRESETS["tiny-dense"], 1)[0]
    keys = dict(HOST, schedule="zigzag", num_gpu_batches=4)
    plans = {mode: plan_bytes(arch, config_for(tmp_path, mode, **keys), stage, list(PROMPT_LENGTHS))
             for mode in ("none", *MODES)}
    for mode, row in (("none", 64), ("int8", 20), ("int4", 12)):
        fmt = kv_format(mode, 64, arch.head_dim)
        assert kv_token_bytes(arch, 1, fmt) == 2 * 4 * row
        assert plans[mode]["parts"]["KV cache on the device"] == N * MAX_LEN * 4 * 2 * 4 * row
    budget = (plans["int4"]["device"] + plans["none"]["device"]) // 2
    with pytest.raises(ConfigError, match="KV cache on the device"):
        check_budgets(arch, config_for(tmp_path, "none", device_memory=budget, **keys), [stage],
                      list(PROMPT_LENGTHS))
    check_budgets(arch, config_for(tmp_path, "int4", device_memory=budget, **keys), [stage], list(PROMPT_LENGTHS))


@pytest.mark.parametrize("mode", ("none", *MODES))
def test_the_budget_counts_what_the_run_holds(prompts, tmp_path, mode):
    """cache_gpu = 0: the plan's device KV part is two one-layer staging buffers; the run's peak device KV is them."""
    keys = ZIGZAG["cache-host-staging"]
    arch = PRESETS["tiny-dense"]
    plan = plan_bytes(arch, config_for(tmp_path, mode, **keys), partition_layers(arch, 1)[0], list(PROMPT_LENGTHS))
    off = OffloadSection(**keys)
    _, times = generate(build(source(), off, mode), prompts, off)
    assert plan["parts"]["KV cache on the device"] == times.kv_peak_device_bytes
    assert plan["host"] - plan_bytes(arch, config_for(tmp_path, mode, **HOST), partition_layers(arch, 1)[0],
                                     list(PROMPT_LENGTHS))["host"] == N * MAX_LEN * kv_token_bytes(
        arch, 1, kv_format(mode, 64, arch.head_dim)) * 4


def test_a_bad_kv_group_is_one_clear_error_with_zigzag(tmp_path):
    """The combination loads; a group that does not divide head_dim is named when the plan is made."""
    config = config_for(tmp_path, "int4", **ZIGZAG["cache-host-staging"])
    assert (config.model.kv_cache, config.offload.schedule, config.offload.cache_cpu) == ("int4", "zigzag", 100)
    bad = dataclasses.replace(config, model=dataclasses.replace(config.model, kv_cache_group=5))
    arch = PRESETS["tiny-dense"]
    with pytest.raises(ConfigError, match="model.kv_cache_group = 5: KV cache group 5 does not divide head_dim 16"):
        plan_bytes(arch, bad, partition_layers(arch, 1)[0], list(PROMPT_LENGTHS))


# ------------------------------------------------------------------------------- the cost model and the LP

ARCH = PRESETS["tiny-dense"]
INT4 = kv_format("int4", 64, 64)                    # for a model with heads of 64 (SmolLM2's), below
RATES = dict(host_to_device=1e6, device_to_host=2e6, disk_to_host=1e5, host_to_disk=5e4, device_flops=1e9,
             host_flops=1e8, device_bandwidth=1e10, host_bandwidth=1e9)


def test_the_cost_model_moves_the_formats_kv_bytes():
    """Cache on the host, no CPU attention, weights and activations on the device: the decode step's
    host_to_device term is exactly the cache coming in, B (s + n/2) kv / bandwidth, with kv the format's bytes;
    the peak host memory (the whole block's cache) shrinks by the same factor."""
    s, n, b, k = 8, 4, 2, 2
    hw = HardwareProfile(device_memory=10**9, host_memory=10**9, disk_memory=10**9, **RATES)
    policy = Policy(gpu_batch_size=b, num_gpu_batches=k, weights_gpu=100, weights_cpu=0, cache_gpu=0, cache_cpu=100,
                    act_gpu=100, act_cpu=0)
    predictions = {}
    for fmt, row in ((None, 64), (kv_format("int8", 64, 16), 20), (kv_format("int4", 64, 16), 12)):
        model = CostModel(ARCH, s, n, hw, "float32", kv_format=fmt)
        kv = 2 * ARCH.num_kv_heads * row
        assert model.sizes.kv_bytes == kv == kv_token_bytes(ARCH, 1, fmt)
        pred = predictions[row] = model.predict(policy)
        assert pred.decode_terms["host_to_device"] == pytest.approx(b * k * (s + n / 2) * kv / 1e6)
        assert pred.decode_terms["device_to_host"] == pytest.approx(b * k * kv / 2e6)       # the new token's rows
    whole = lambda row: predictions[row].peak["host"]
    assert (whole(64) - whole(12)) == pytest.approx(b * k * (s + n) * 4 * 2 * ARCH.num_kv_heads * (64 - 12))
    # a float cache is float32 at any model dtype (generate/kv_cache allocates it so, and the planner counts what
    # the runtime allocates); a quantized format is the same bytes at any dtype
    assert ModelSizes.of(ARCH, "float16").kv_bytes == ModelSizes.of(ARCH, "float32").kv_bytes == 2 * 4 * 16 * 4
    assert ModelSizes.of(ARCH, "float16", kv_format=kv_format("int4", 64, 16)).kv_bytes == 2 * 4 * 12


def test_the_policy_search_fits_a_larger_block_with_an_int4_cache():
    """SmolLM2-like heads (hd 64): weights and cache held on the device, a device budget of the weights + 40
    sequences' float32 cache: the largest feasible block grows about 7x (256 / 36 bytes a row) with int4 KV."""
    arch = dataclasses.replace(ARCH, head_dim=64, max_positions=512)
    s, n = 16, 496                                  # a long generation: the cache, not the working set, is large
    hw = lambda device: HardwareProfile(device_memory=device, host_memory=10**5, disk_memory=0, **RATES)
    weights_and_tables = ModelSizes.of(arch).total_weight_bytes
    per_seq = (s + n) * arch.num_layers * kv_token_bytes(arch)                # the float32 cache of one sequence
    device = weights_and_tables + 40 * per_seq
    largest = {}
    for fmt in (None, INT4):
        _, _, candidates = search_policy(arch, s, n, hw(device), gpu_batch_sizes=[2**i for i in range(10)],
                                         num_gpu_batches=[1], cpu_attention=False,
                                         fixed={"weights_gpu": 100, "cache_gpu": 100}, kv_format=fmt)
        largest[fmt] = max(p.block_size for p, _ in candidates)
    # float32: 40 sequences' cache fit, less the working set: 32 on the power-of-two grid; int4: 40 * 2048 / 288
    # = 284 less the working set: 256
    assert (largest[None], largest[INT4]) == (32, 256), largest


def test_cli_plan_takes_the_kv_cache_format(capsys):
    from hpcinfer.cli import main

    assert main(["plan", "--model", "tiny-dense", "--profile", "t4-16gb", "--kv-cache", "int4",
                 "--candidates", "0"]) == 0
    assert "KV cache int4 g16" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny-dense", "--profile", "t4-16gb", "--kv-cache", "int4", "--kv-cache-group",
                 "5"]) == 2
    assert capsys.readouterr().err.strip() == \
        "hpcinfer: error: --kv-cache-group 5: KV cache group 5 does not divide head_dim 16"


def test_hpcinfer_run_zigzag_with_an_int4_cache(run_cli, repo_root, tmp_path):
    """End to end: `[model] kv_cache = "int4"` with the zig-zag schedule and the cache in host memory is accepted,
    writes the row schedule's output, and the metrics report the quantized bytes the staging buffers moved."""
    import json

    rng = np.random.default_rng(5)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "tokens": rng.integers(0, 256, n).tolist()})
                                              + "\n" for i, n in enumerate(PROMPT_LENGTHS)))
    outputs = {}
    for name, keys in (("row", ROW), ("zigzag", ZIGZAG["cache-host-staging"])):
        out = tmp_path / f"{name}.jsonl"
        config = tmp_path / f"{name}.toml"
        config.write_text(f'[model]\npreset = "tiny-dense"\nkv_cache = "int4"\n[generate]\n'
                          f'prompts = "{tmp_path / "p.jsonl"}"\noutput = "{out}"\nbatch_size = {N}\n'
                          f'max_new_tokens = {MAX_NEW}\nignore_eos = true\nmetrics = "{out}.metrics"\n')
        sets = [a for k, v in keys.items() for a in ("--set", f"offload.{k}={json.dumps(v)}")]
        done = run_cli(["run", str(config), *sets], timeout=120, cwd=repo_root)
        assert done.returncode == 0, done.stderr
        outputs[name] = (out.read_text(), json.loads((tmp_path / f"{name}.jsonl.metrics").read_text()))
    assert outputs["zigzag"][0] == outputs["row"][0] and outputs["row"][0].count('"output_tokens"') == N
    kv = outputs["zigzag"][1]["kv_cache"]
    loads, stores = window_positions()
    assert (kv["fetched_bytes_to_device"], kv["offloaded_bytes_to_host"]) == (4 * 2 * 4 * 12 * loads,
                                                                              4 * 2 * 4 * 12 * stores)
    assert kv["peak_device_bytes_per_rank"] == 2 * 2 * 2 * 4 * MAX_LEN * 12          # two one-layer staging buffers
