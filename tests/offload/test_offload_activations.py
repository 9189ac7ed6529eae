"""The activations at tensor granularity (FlexGen Section 4.2, `act_gpu` / `act_cpu`): of every GPU batch's T_b
hidden-state rows [T_b, D] between layers, device_rows(T_b, act_gpu) stay on the device and the rest go to host
memory after each layer and come back before the next (offload/activations.py, run by generate/schedules/zigzag.py).

What must hold:
- for act_gpu in {0, 30, 50, 100} x num_gpu_batches in {1, 3}, the cache on the device or in host memory, weights
  in host memory, prefetch 0 and 1, and once with an int4 KV cache: the tokens of the all-on-device run;
- the bytes over the link are exactly the host rows, each way, at every hand-off of a step: the embedding's output
  (stored), the input of every layer (loaded), every layer's output (stored), the logits' input (loaded); so
  (layers + 1) x sum_b (T_b - R_b) x D x 4 bytes per step and direction; act_gpu = 100 moves nothing;
- budget.plan_bytes counts what the runtime holds ("activations on the device"; host rows);
- what the runtime cannot hold is a ConfigError (an activation disk share; act_gpu < 100 on the row schedule);
- on the cupy stand-in: NumPy's tokens and bytes, every host copy pinned and on the copy engine;
- at tp = 2 under MPI: every rank moves the (replicated) hidden states' host rows, the one-rank tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

import offload_models as base
import test_offload_kv_quant as kvq
from hpcinfer.errors import ConfigError
from hpcinfer.offload import activations
from hpcinfer.offload.budget import act_plan_bytes, plan_bytes
from hpcinfer.offload.sizes import device_rows
from hpcinfer.parallel.micro_batches import micro_batches
from hpcinfer.parallel.stages import partition_layers
from offload_models import MAX_NEW, PROMPT_LENGTHS, config_for, make_prompts, offload, preset

HIDDEN, LAYERS = 64, 4                            # tiny-dense
SPLITS = (0, 30, 50, 100)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def dense_reference(prompts):
    return base.generate(base.build(preset("tiny-dense")), prompts)[0]


@pytest.fixture
def made(monkeypatch) -> list:
    """Every HostActivations a run makes."""
    out, init = [], activations.HostActivations.__init__

    def logged(self, *args, **kwargs):
        init(self, *args, **kwargs)
        out.append(self)

    monkeypatch.setattr(activations.HostActivations, "__init__", logged)
    return out


def zigzag(act_gpu: float, num_gpu_batches: int, cache_gpu: float = 100, prefetch_layers: int = 1):
    return offload(None, weights_gpu=0, weights_cpu=100, act_gpu=act_gpu, act_cpu=100 - act_gpu,
                   cache_gpu=cache_gpu, cache_cpu=100 - cache_gpu, schedule="zigzag",
                   num_gpu_batches=num_gpu_batches, prefetch_layers=prefetch_layers)


def step_tokens(num_gpu_batches: int) -> list:
    """Each step's T_b per GPU batch: the prompt tokens, then MAX_NEW - 1 decode steps of one token a sequence."""
    groups = micro_batches(len(PROMPT_LENGTHS), num_gpu_batches)
    prefill = [sum(PROMPT_LENGTHS[i] for i in g) for g in groups]
    return [prefill] + [[len(g) for g in groups]] * (MAX_NEW - 1)


def link_bytes(act_gpu: float, num_gpu_batches: int) -> int:
    """Bytes each way: every step, (LAYERS + 1) hand-offs of each batch's host rows of D float32 values."""
    host_rows = sum(t - device_rows(t, act_gpu) for step in step_tokens(num_gpu_batches) for t in step)
    return host_rows * (LAYERS + 1) * HIDDEN * 4


@pytest.mark.parametrize("num_gpu_batches", (1, 3))
@pytest.mark.parametrize("act_gpu", SPLITS)
@pytest.mark.parametrize("cache_gpu", (100, 0), ids=["cache-device", "cache-host"])
def test_placed_activations_give_the_all_on_device_tokens_and_move_only_host_rows(prompts, dense_reference, made,
                                                                                  cache_gpu, act_gpu,
                                                                                  num_gpu_batches):
    off = zigzag(act_gpu, num_gpu_batches, cache_gpu, prefetch_layers=num_gpu_batches % 2)   # prefetch 1 or 0
    out, times = base.generate(base.build(preset("tiny-dense"), off), prompts, off)
    assert out == dense_reference
    assert times.act_bytes_to_device == times.act_bytes_to_host == link_bytes(act_gpu, num_gpu_batches)
    (acts,) = made
    if act_gpu == 100:                                           # the old path: the layer outputs as they are
        assert not acts.staged and acts.staging == [] and acts.host == {} and acts.copies is None
    else:
        prefill = step_tokens(num_gpu_batches)[0]
        assert [a.shape[0] for a in acts.host.values()] == [t - device_rows(t, act_gpu) for t in prefill]
        assert [a.shape for a in acts.staging] == [(max(prefill), HIDDEN)] * 2


def test_the_link_bytes_shrink_with_the_host_rows():
    """The expectation itself: act_gpu = 0 moves every row, 100 none, 50 half of the rows (to the rounding)."""
    moved = [link_bytes(a, 3) for a in SPLITS]
    assert moved[0] > moved[1] > moved[2] > moved[3] == 0
    assert moved[0] == (sum(PROMPT_LENGTHS) + 8 * (MAX_NEW - 1)) * (LAYERS + 1) * HIDDEN * 4


def test_placed_activations_with_an_int4_cache_give_its_tokens(prompts):
    reference_off = zigzag(100, 3, cache_gpu=0)
    want, _ = kvq.generate(kvq.build(kvq.source(), reference_off, "int4"), prompts, reference_off)
    off = zigzag(30, 3, cache_gpu=0)
    out, times = kvq.generate(kvq.build(kvq.source(), off, "int4"), prompts, off)
    assert out == want
    assert times.act_bytes_to_host == link_bytes(30, 3) > 0
    assert times.kv_bytes_to_host > 0


@pytest.mark.parametrize("num_gpu_batches", (1, 3))
@pytest.mark.parametrize("act_gpu", SPLITS)
def test_the_budget_plan_counts_the_activations_the_runtime_holds(prompts, tmp_path, made, act_gpu,
                                                                  num_gpu_batches):
    config = config_for(tmp_path, weights_gpu=0, weights_cpu=100, act_gpu=act_gpu, act_cpu=100 - act_gpu,
                        schedule="zigzag", num_gpu_batches=num_gpu_batches)
    arch = preset("tiny-dense").arch
    plan = plan_bytes(arch, config, partition_layers(arch, 1)[0], list(PROMPT_LENGTHS))
    device, host = act_plan_bytes(arch, config, list(PROMPT_LENGTHS))
    _, times = base.generate(base.build(preset("tiny-dense"), config.offload), prompts, config.offload)
    (acts,) = made
    assert plan["parts"]["activations on the device"] == device == times.act_peak_device_bytes > 0
    assert host == acts.host_bytes
    prefill = step_tokens(num_gpu_batches)[0]
    if act_gpu == 100:                                           # the whole block's hidden states, held
        assert device == sum(prefill) * HIDDEN * 4 and host == 0
    else:
        rows = sum(device_rows(t, act_gpu) for t in prefill)
        assert device == (rows + 2 * max(prefill)) * HIDDEN * 4
        assert host == (sum(prefill) - rows) * HIDDEN * 4


def test_the_plan_takes_the_block_that_needs_most(tmp_path):
    """Two blocks of 4 prompts (batch_size 4): the plan is the larger block's, as the runtime runs one at a time."""
    arch = preset("tiny-dense").arch
    config = config_for(tmp_path, act_gpu=0, act_cpu=100, schedule="zigzag", num_gpu_batches=2)
    config = dataclasses.replace(config, generate=dataclasses.replace(config.generate, batch_size=4))
    device, host = act_plan_bytes(arch, config, list(PROMPT_LENGTHS))
    blocks = [PROMPT_LENGTHS[:4], PROMPT_LENGTHS[4:]]                # 27 and 28 tokens; GPU batches of 2 prompts
    tokens = [[sum(b[:2]), sum(b[2:])] for b in blocks]
    assert host == max(sum(t) for t in tokens) * HIDDEN * 4
    assert device == 2 * max(max(t) for t in tokens) * HIDDEN * 4


@pytest.mark.parametrize("keys, names", [
    (dict(act_gpu=50, act_cpu=0, schedule="zigzag"), ["offload.act_gpu + offload.act_cpu = 50", "must be 100",
                                                      "no disk tier"]),
    (dict(act_gpu=0, act_cpu=0, schedule="zigzag"), ["offload.act_gpu + offload.act_cpu = 0", "must be 100"]),
    (dict(act_gpu=50, act_cpu=50, schedule="row"), ["offload.act_gpu = 50", "schedule = \"zigzag\""]),
], ids=["act-disk-share", "act-all-disk", "row-schedule"])
def test_what_the_runtime_cannot_hold_is_an_error(tmp_path, keys, names):
    with pytest.raises(ConfigError) as info:
        config_for(tmp_path, weights_gpu=0, weights_cpu=100, **keys)
    for name in names:
        assert name in str(info.value), str(info.value)


def test_what_the_runtime_holds_is_accepted(tmp_path):
    for keys in (dict(act_gpu=30, act_cpu=70, schedule="zigzag"), dict(act_gpu=0, act_cpu=100, schedule="zigzag"),
                 dict(act_gpu=100, act_cpu=0, schedule="row")):
        assert config_for(tmp_path, weights_gpu=0, weights_cpu=100, **keys).offload.act_gpu == keys["act_gpu"]


def test_placed_activations_on_emulated_cupy_give_numpys_tokens_and_bytes():
    """act_gpu = 30 over 2 GPU batches on the stand-in for cupy: the host rows move on the copy stream from pinned
    buffers (a read before its event fails there), the device rows by device copies; NumPy's tokens and bytes."""
    off = offload(None, weights_gpu=100, act_gpu=30, act_cpu=70, schedule="zigzag", num_gpu_batches=2)
    base.emulated_cupy_matches_numpy(off, "act")


def test_hpcinfer_run_reports_the_activations_it_moved(run_cli, repo_root, tmp_path, prompts):
    """End to end: `act_gpu = 30` over 3 GPU batches writes the output of the run with every hidden state on the
    device, and the metrics' "activations" section reports the bytes moved and the device peak of the plan."""
    import json

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "tokens": p}) + "\n" for i, p in enumerate(prompts)))
    runs = {}
    for name, act_gpu in (("on-device", 100), ("placed", 30)):
        out = tmp_path / f"{name}.jsonl"
        config = tmp_path / f"{name}.toml"
        config.write_text(f'[model]\npreset = "tiny-dense"\n[generate]\nprompts = "{tmp_path / "p.jsonl"}"\n'
                          f'output = "{out}"\nbatch_size = {len(prompts)}\nmax_new_tokens = {MAX_NEW}\n'
                          f'ignore_eos = true\nmetrics = "{out}.metrics"\n[offload]\nschedule = "zigzag"\n'
                          f"num_gpu_batches = 3\nact_gpu = {act_gpu}\nact_cpu = {100 - act_gpu}\n")
        done = run_cli(["run", str(config)], timeout=120, cwd=repo_root)
        assert done.returncode == 0, done.stderr
        runs[name] = (out.read_text(), json.loads((tmp_path / f"{name}.jsonl.metrics").read_text())["activations"])
    assert runs["placed"][0] == runs["on-device"][0] and runs["placed"][0].count('"output_tokens"') == len(prompts)
    placed, on_device = runs["placed"][1], runs["on-device"][1]
    assert placed["fetched_bytes_to_device"] == placed["offloaded_bytes_to_host"] == link_bytes(30, 3)
    assert on_device["fetched_bytes_to_device"] == on_device["offloaded_bytes_to_host"] == 0
    arch, tokens = preset("tiny-dense").arch, step_tokens(3)[0]
    assert on_device["peak_device_bytes_per_rank"] == sum(tokens) * arch.hidden_size * 4
    rows = sum(device_rows(t, 30) for t in tokens)
    assert placed["peak_device_bytes_per_rank"] == (rows + 2 * max(tokens)) * arch.hidden_size * 4
