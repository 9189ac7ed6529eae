"""Offload as a search dimension of the layout planner (perf/offload.py, docs/planner.md "Offload").

A hand-checkable model 2.6x one GPU's memory on 1, 2 and 4 GPUs: offloaded layouts appear only for layouts that do
not fit, only where the runtime takes [offload] (pp = 1), and their transfer term is bytes / bandwidth by hand; a
model that fits is never planned with offload when that is slower; the property test over random models with
memory below their size; the best offloaded layout's printed TOML passes the config loader and the runtime's
budget check for its rank.
"""

from __future__ import annotations

import dataclasses
import tomllib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hpcinfer.arch import ModelArch
from hpcinfer.checkpoint.presets import PRESETS as MODELS
from hpcinfer.cli import main
from hpcinfer.config import load_config
from hpcinfer.job import _fetch_share
from hpcinfer.offload.budget import check_budgets
from hpcinfer.offload.profile import PRESETS as HARDWARE
from hpcinfer.offload.tiers import place_layers
from hpcinfer.parallel.stages import partition_layers
from hpcinfer.perf.comm_cost import Link, all_gather
from hpcinfer.perf.layout import Layout
from hpcinfer.perf.memory import weight_bytes
from hpcinfer.perf.planner import plan
from hpcinfer.perf.step import Workload
from test_planner import _check_plan, models

# D 1024, 8 layers, 8 heads of 128, MLP 4096, rotary, no biases: a layer is 4 D^2 + 2 D F = 12.58M weights at
# float16 = 25,165,824 bytes + 2 LayerNorms (weight and bias, float32) 16,384 = 25,182,208 bytes; 8 layers 201.5 MB
# and the tables 2 x 1000 x 1024 x 2 + 8,192 = 4,104,192: 205.6 MB, 2.6x a GPU of 80 MB.
HAND = ModelArch(family="hand", vocab_size=1000, hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=8,
                 head_dim=128, intermediate_size=4096, max_positions=64, position="rotary", rotary_dim=128)
LAYER = 4 * 1024 * 1024 * 2 + 2 * 1024 * 4096 * 2 + 4 * 1024 * 4
GPU = 80 * 10**6
HW = HARDWARE["dgx-a100-40gb"].with_budgets(device_memory=GPU)        # 25 GB/s host->device, overlap = true
WORK = Workload(1, 16, 4, "float16")


def test_the_hand_model_is_2_6x_a_gpu():
    from hpcinfer.offload.sizes import layer_bytes, table_bytes

    held = sum(layer_bytes(HAND, i, 2) for i in range(8)) + table_bytes(HAND, True, True, 2)
    assert LAYER == layer_bytes(HAND, 0, 2) == 25_182_208 and held == 8 * LAYER + 4_104_192
    assert 2.5 < held / GPU < 2.6


def test_one_gpu_streams_its_layers_at_bytes_over_the_link():
    result = plan(HAND, 1, WORK, HW)
    assert result.considered == 1 and result.offloaded == 1 and len(result.ranked) == 1
    p = result.ranked[0]
    off, pol = p.offload, p.offload.policy
    streamed = place_layers(8, pol.weights_gpu, pol.weights_cpu).count("host")
    # 80 MB holds the tables (4.1 MB), a window of 2 streamed layers (50.4 MB) and the work buffers, not one more
    # layer: every layer streams from host memory, the small KV cache stays on the device
    assert pol.weights_gpu + pol.weights_cpu == 100 and pol.cache_gpu == 100 and streamed == 8
    assert off.streamed_bytes == streamed * LAYER and off.fetch_share == 1 and off.gather_s == 0
    assert off.token_transfer_s["host_to_device"] == pytest.approx(streamed * LAYER / 25e9, rel=1e-12)
    assert off.token_transfer_s["device_to_host"] == 0 and off.token_transfer_s["disk_to_host"] == 0
    # one rank: no communication; the transfer (~1 ms a layer) hides the compute (~20 us a layer): the step
    assert p.token_s == pytest.approx(streamed * LAYER / 25e9, rel=1e-12)
    assert p.memory <= GPU


def test_two_gpus_offload_both_layouts_and_partitioned_fetch_halves_the_link():
    result = plan(HAND, 2, WORK, HW)
    by_shape = {(p.layout.tp, p.layout.pp, p.layout.dp): p for p in result.ranked}
    assert set(by_shape) == {(2, 1, 1), (1, 1, 2)}           # pp = 2 stages (~103 MB) do not fit: no offload there
    assert result.too_big == 1 and result.offloaded == 2
    dp = by_shape[(1, 1, 2)].offload
    n = place_layers(8, dp.policy.weights_gpu, dp.policy.weights_cpu).count("host")
    assert dp.fetch_share == 2 and dp.streamed_bytes == n * LAYER
    assert dp.token_transfer_s["host_to_device"] == pytest.approx(n * LAYER / 2 / 25e9, rel=1e-12)
    intra = Link(5e-6, 240e9)
    assert dp.gather_s == pytest.approx(n * (5e-6 + LAYER / 2 / 240e9), rel=1e-12)
    assert dp.gather_s == pytest.approx(n * all_gather(LAYER, 2, intra), rel=1e-12)
    tp = by_shape[(2, 1, 1)].offload                          # a tp rank streams half of each layer
    m = place_layers(8, tp.policy.weights_gpu, tp.policy.weights_cpu).count("host")
    assert tp.fetch_share == 1 and tp.streamed_bytes == m * (LAYER - 4 * 1024 * 4) / 2 + m * 4 * 1024 * 4


def test_a_layout_that_fits_is_never_offloaded_and_offload_is_not_chosen_when_slower():
    result = plan(HAND, 4, WORK, HW)                          # tp4: 51 MB a rank fits
    assert result.ranked[0].offload is None
    fitting = [p for p in result.ranked if p.offload is None]
    assert fitting and all(p.token_s > fitting[0].token_s for p in result.ranked if p.offload)
    for p in result.ranked:
        assert (p.offload is not None) == (p.layout.label(False) in {"tp1 pp1 dp4 mb1/1", "tp2 pp1 dp2 mb1/1"})
    roomy = plan(HAND, 1, WORK, HW.with_budgets(device_memory=10**9))
    assert roomy.offloaded == 0 and roomy.ranked[0].offload is None
    throughput = plan(HAND, 4, WORK, HW, "throughput")
    assert throughput.ranked[0].offload is None
    assert plan(HAND, 1, WORK, HW, offload=False).ranked == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=models(), gpus=st.sampled_from([1, 2, 4, 8]), per_node=st.sampled_from([1, 2, 4, 8]),
       share=st.sampled_from([0.7, 0.9, 1.2]), batch=st.integers(1, 24),
       objective=st.sampled_from(["latency", "throughput"]))
def test_offloaded_layouts_never_exceed_memory(arch, gpus, per_node, share, batch, objective):
    """The property test of test_planner.py with a GPU below the model's size, where offload is planned."""
    held = weight_bytes(arch, Layout(1, 1, 1), range(arch.num_layers), True, True, Workload(batch, 16, 4))
    _check_plan(arch, gpus, per_node, int(share * held / max(1, gpus // 2)), batch, objective)


def test_offloaded_layouts_are_planned_by_the_property_cases():
    arch = MODELS["tiny-dense"]
    hw = dataclasses.replace(HARDWARE["dgx-a100-40gb"], gpus_per_node=2, device_memory=500_000)
    result = plan(arch, 2, Workload(4, 16, 4, "float32"), hw)
    assert result.offloaded >= 1


def test_printed_offloaded_best_layout_runs_as_printed(capsys, tmp_path):
    """tiny-dense (899 KB float32, biases kept whole on every tp rank) on 2 GPUs of 500 KB: the best layout is
    offloaded; its printed TOML, with a model, prompts and output added, passes load_config and the runtime's
    budget check for its rank (the fetch group of job._fetch_share)."""
    argv = ["plan", "--model", "tiny-dense", "--gpus", "2", "--gpu-memory", "500KB", "--dtype", "float32",
            "--batch", "4", "--prompt-len", "16", "--gen-len", "4", "--disk-dir", str(tmp_path)]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    doc = tomllib.loads(out)
    assert {"parallel", "schedule", "offload", "generate"} <= set(doc)
    assert "# offloading:" in out and " w" in out.split("# best:")[0]
    par, off, gen = doc["parallel"], doc["offload"], doc["generate"]
    body = out[out.index("[parallel]"):out.index("[generate]")]
    path = tmp_path / "job.toml"
    path.write_text('[model]\npreset = "tiny-dense"\ndtype = "float32"\n\n' + body + "[generate]\n"
                    + "".join(f"{k} = {v}\n" for k, v in gen.items())
                    + f'prompts = "{tmp_path / "p.jsonl"}"\noutput = "{tmp_path / "o.jsonl"}"\n')
    config = load_config(str(path))
    assert config.parallel.tp == par["tp"] and config.offload.active
    world = 2
    share = _fetch_share(config, world, min(8, world))
    assert share == (2 if off.get("partitioned_fetch") else 1)
    arch = MODELS["tiny-dense"]
    check_budgets(arch, config, partition_layers(arch, 1), [16] * gen["batch_size"], None, share)
    assert off["device_memory"] == 500_000


def test_the_runtime_limits_are_the_eligible_layouts():
    from hpcinfer.perf.offload import eligible

    moe = MODELS["tiny-moe"]
    assert eligible(HAND, Layout(2, 1, 4)) and not eligible(HAND, Layout(1, 2, 1))
    assert eligible(moe, Layout(2, 1, 1, ep=2)) and not eligible(moe, Layout(1, 1, 2, ep=2))
