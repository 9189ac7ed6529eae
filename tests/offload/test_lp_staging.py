"""The planner's staging terms match the runtime, and the planner places activations (issue 6, offload planning).

The runtime (generate/schedules/zigzag.py) holds the KV cache and the activations of each GPU batch by rows, the nearest
whole row of each share on the device (budget.device_rows), and as soon as ANY row is off the device two device
staging buffers of one GPU batch's rows (two of one layer's cache of a batch; two [b s, D] hidden states): a
step function of the placement. The cost model counts it exactly (CostTerms.peak, budget.kv_plan_bytes' bytes)
and the LP solves both sides of each step (all on the device, no buffers / some off it, buffers counted).

The tiny model of test_offload_policy (float32, 4 layers, 4 KV heads of 16, D = 64), prompt s = 8, n = 4:
  one GPU batch of b = 2: 8 cache rows (sequence, KV head), each 12 positions x 512 / 4 x 4 layers = 6144 bytes;
  the block's cache KV = 49152; two staging buffers of one layer's cache 2 x 2 x 12 x 512 = 24576;
  activations: b s = 16 rows of 256 bytes per GPU batch; two staging buffers 2 x 16 x 256 = 8192.
"""

from __future__ import annotations

import tomllib
import types

import pytest

from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.errors import ConfigError
from hpcinfer.offload.budget import kv_plan_bytes
from hpcinfer.offload.cost_model import CostModel, evaluate
from hpcinfer.offload.lp import PlacementError, search_policy, solve_placement
from hpcinfer.offload.policy import Policy
from hpcinfer.offload.sizes import device_rows
from test_offload_policy import ACT, ARCH, KV, N, S, TABLES, W, WORK, WT, machine, policy

CACHE_ROWS, CACHE_ROW = 2 * 4, (S + N) * 512 * 4 // 4       # a GPU batch's cache rows; bytes of one (4 layers)
CACHE_STAGING = 2 * 2 * (S + N) * 512                       # 24576
ACT_ROWS, ACT_ROW = 2 * S, 256                              # a GPU batch's hidden-state rows in prefill
ACT_STAGING = 2 * ACT_ROWS * ACT_ROW                        # 8192
ALL_ON_DEVICE = TABLES + WT + KV + ACT + WORK               # b = 2, k = 1: every byte on the device
DEVICE_ROW = TABLES + 2 * W + KV + ACT + WORK                # b = 2 with every weight streamed


def runtime_kv(arch, p: Policy, prompt_len: int, gen_len: int) -> tuple[int, int, int]:
    """budget.kv_plan_bytes (the runtime's allocation) of one block under policy p: (device rows, host rows,
    staging) bytes."""
    config = types.SimpleNamespace(
        offload=types.SimpleNamespace(num_gpu_batches=p.num_gpu_batches, cache_gpu=p.cache_gpu,
                                      cpu_attention=p.cpu_attention),
        parallel=types.SimpleNamespace(tp=1), model=types.SimpleNamespace(kv_cache="none", kv_cache_group=64),
        generate=types.SimpleNamespace(batch_size=p.block_size, max_new_tokens=gen_len), path="plan.toml")
    return kv_plan_bytes(arch, config, arch.num_layers, [prompt_len] * p.block_size)


# ---- the cache: a step function -----------------------------------------------------------------------------

def test_the_cost_model_counts_the_staging_buffers_of_any_split_cache():
    """Predicted device bytes of the cache are the runtime's: the whole rows kept plus both staging buffers,
    which exist for 1 % off the device as for 100 %; with the whole cache on the device there are none."""
    model = CostModel(ARCH, S, N, machine(), "float32")
    for cache_gpu in (100, 99, 90, 50, 41, 0):
        p = policy(cache_gpu=cache_gpu, cache_cpu=100 - cache_gpu)
        device, host, staging = runtime_kv(ARCH, p, S, N)
        terms = model.terms(2, 1)
        assert terms.device_bytes("cache", p.fractions()) == device + staging, cache_gpu
        rows = device_rows(CACHE_ROWS, cache_gpu)
        assert device == rows * CACHE_ROW and host == (CACHE_ROWS - rows) * CACHE_ROW
        assert staging == (0 if rows == CACHE_ROWS else CACHE_STAGING)
        whole = model.predict(policy())
        assert model.predict(p).peak["device"] == whole.peak["device"] - KV + device + staging


def test_a_budget_a_sliver_below_all_on_device_moves_enough_cache_to_pay_for_its_staging():
    """The weights held on the device, a device budget 1000 bytes below everything on it: the old linear term
    (device = ... + cg (KV - buffers) + buffers) let ~4 % of the cache move (1000 / (KV - 24576)), a plan whose
    staging buffers (24576 bytes) the runtime's budget check then refuses. Exactly: keeping R of the 8 rows costs
    R/8 KV + 24576 <= KV - 1000, so R = 3 (4 rows would need 49152)."""
    budget = ALL_ON_DEVICE - 1000
    hw = machine(device=budget)
    model = CostModel(ARCH, S, N, hw, "float32")
    old_choice = policy(cache_gpu=96, cache_cpu=4)                   # the old term's fit, rounded up to a percent
    assert not model.predict(old_choice).fits
    old_device, _, old_staging = runtime_kv(ARCH, old_choice, S, N)
    assert model.predict(old_choice).peak["device"] == ALL_ON_DEVICE - KV + old_device + old_staging > budget

    p, pred = solve_placement(ARCH, S, N, 2, 1, hw, cpu_attention=False, fixed={"weights_gpu": 100})
    assert (p.weights_gpu, p.act_gpu, p.cache_gpu + p.cache_cpu) == (100, 100, 100)
    assert device_rows(CACHE_ROWS, p.cache_gpu) == 3                  # the most rows that fit
    device, host, staging = runtime_kv(ARCH, p, S, N)                 # the runtime's truth for the printed policy
    assert pred.fits and pred.peak["device"] == ALL_ON_DEVICE - KV + device + staging <= budget
    assert pred.peak["host"] == host == 5 * CACHE_ROW


def test_a_budget_that_fits_everything_keeps_the_cache_whole():
    """At exactly the all-on-device bytes nothing moves (no staging buffers, cc = 0), whatever the tie-break."""
    p, pred = solve_placement(ARCH, S, N, 2, 1, machine(device=ALL_ON_DEVICE), cpu_attention=False,
                              fixed={"weights_gpu": 100})
    assert (p.cache_gpu, p.act_gpu) == (100, 100) and pred.peak["device"] == ALL_ON_DEVICE


@pytest.mark.parametrize("cut", [0.05, 0.3, 0.6])
def test_the_printed_policy_on_a_preset_matches_the_runtimes_kv_bytes(cut):
    """tiny-dense, 3 GPU batches of 2, the weights held on the device and a device budget `cut` of the cache below
    all on the device: the LP's plan fits, and its predicted cache bytes (rows + staging, device and host) are
    budget.kv_plan_bytes' for the policy as printed (the TOML read back)."""
    arch = PRESETS["tiny-dense"]
    model = CostModel(arch, S, N, machine(), "float32")
    whole = model.predict(policy(num_gpu_batches=3)).peak["device"]
    kv = 3 * 2 * (S + N) * model.sizes.kv_bytes * arch.num_layers
    hw = machine(device=int(whole - cut * kv))
    p, pred = solve_placement(arch, S, N, 2, 3, hw, cpu_attention=False, fixed={"weights_gpu": 100})
    printed = Policy(**{k: v for k, v in tomllib.loads(p.to_toml_section())["offload"].items()})
    assert printed == p and pred.fits and p.cache_cpu > 0
    device, host, staging = runtime_kv(arch, printed, S, N)
    terms = model.terms(2, 3)
    assert terms.device_bytes("cache", printed.fractions()) == device + staging
    assert pred.peak["device"] == whole - kv + device + staging <= hw.device_memory
    assert pred.peak["host"] == host


# ---- the activations: placed by the LP ---------------------------------------------------------------------------

def test_the_cost_model_counts_activation_rows_staging_and_traffic():
    """act_gpu = 50 over 4 GPU batches: half of each batch's 16 rows on the device, two [16, D] staging buffers;
    the host rows are stored after and loaded before each of the L + 1 boundaries (the embedding output, each
    layer's output) of the whole block: per layer 8 x 8 x 256 / 2 x 5/4 bytes each way in prefill."""
    hw = machine(host_to_device=1e6, device_to_host=2e6)
    model = CostModel(ARCH, S, N, hw, "float32")
    base, half = (model.predict(policy(num_gpu_batches=4, act_gpu=g, act_cpu=100 - g)) for g in (100, 50))
    block_act = 4 * ACT                                             # B s act, B = 8
    assert half.peak["device"] == base.peak["device"] - block_act / 2 + ACT_STAGING
    assert half.peak["host"] == base.peak["host"] + block_act / 2
    moved = block_act / 2 * 5 / 4
    assert half.prefill_terms["host_to_device"] == pytest.approx(moved / 1e6)
    assert half.prefill_terms["device_to_host"] == pytest.approx(moved / 2e6)
    assert half.decode_terms["host_to_device"] == pytest.approx(8 * 256 / 2 * 5 / 4 / 1e6)
    assert model.terms(2, 4).device_bytes("act", half.policy.fractions()) == block_act / 2 + ACT_STAGING


def test_the_cost_models_activation_bytes_are_the_runtimes():
    """budget.act_plan_bytes (what offload/activations.py holds; H3's) for 4 GPU batches of 2 prompts of s tokens:
    the predicted device bytes (whole rows + staging) and host bytes of the activations are the same."""
    from hpcinfer.offload import budget

    if not hasattr(budget, "act_plan_bytes"):
        pytest.skip("budget.act_plan_bytes is not there yet")
    terms = CostModel(ARCH, S, N, machine(), "float32").terms(2, 4)
    for act_gpu in (100, 75, 50, 46, 3, 0):
        p = policy(num_gpu_batches=4, act_gpu=act_gpu, act_cpu=100 - act_gpu)
        config = types.SimpleNamespace(offload=types.SimpleNamespace(num_gpu_batches=4, act_gpu=act_gpu,
                                                                     schedule="zigzag"),
                                       generate=types.SimpleNamespace(batch_size=8))
        device, host = budget.act_plan_bytes(ARCH, config, [S] * 8)
        assert terms.device_bytes("act", p.fractions()) == device, act_gpu
        rows = device_rows(ACT_ROWS, act_gpu)
        assert host == 4 * (ACT_ROWS - rows) * ACT_ROW
        assert device == 4 * rows * ACT_ROW + (ACT_STAGING if rows < ACT_ROWS else 0)


def act_only_budget(k: int = 4) -> int:
    """The least device bytes with the activations on the device (every weight streamed: 2 layers resident, the
    cache in host memory under CPU attention), minus 100 bytes (beyond Prediction.fits' rounding tolerance): only
    moving activations makes a plan fit."""
    return TABLES + 2 * W + WORK + k * ACT - 100


def test_only_moving_activations_to_host_fits():
    """Device = act_only_budget(): R of each batch's 16 rows on the device costs 4 R 256 + 8192 (staging) <=
    16284, so R = 7 (8 rows are 100 bytes too many; the LP's 47 % rounds to 8 rows, so 46 % is printed). The plan names act_cpu > 0, sums to
    100, fits as predicted, and runs as printed; pinned to the device the activations fit nowhere."""
    hw = machine(device=act_only_budget())
    p, pred = solve_placement(ARCH, S, N, 2, 4, hw)
    assert p.act_cpu > 0 and p.act_gpu + p.act_cpu == 100 and p.act_disk == 0
    assert device_rows(ACT_ROWS, p.act_gpu) == 7
    assert pred.fits and pred.peak["device"] <= hw.device_memory
    assert p.cpu_attention and (p.cache_gpu, p.weights_gpu) == (0, 0)
    section = tomllib.loads(p.to_toml_section())["offload"]
    assert (section["act_gpu"], section["act_cpu"]) == (p.act_gpu, p.act_cpu) and section["schedule"] == "zigzag"
    with pytest.raises(PlacementError) as info:
        solve_placement(ARCH, S, N, 2, 4, hw, fixed={"act_gpu": 100})
    assert info.value.tier == "device"


def test_a_roomy_device_keeps_the_activations_there():
    _, _, candidates = search_policy(ARCH, S, N, machine(device=2 * ALL_ON_DEVICE), gpu_batch_sizes=[1, 2],
                                     num_gpu_batches=[1, 2, 4])
    assert all((p.act_gpu, p.act_cpu) == (100, 0) for p, _ in candidates)


def test_the_row_schedule_keeps_cache_and_activations_on_the_device():
    """config refuses the row schedule with the cache or the activations off the device (or CPU attention):
    the planner never proposes it, and the budget only moving activations fits has no row plan."""
    _, _, candidates = search_policy(ARCH, S, N, machine(device=DEVICE_ROW), schedule="row",
                                     gpu_batch_sizes=[1, 2, 4])
    assert candidates
    for p, pred in candidates:
        assert (p.act_gpu, p.cache_gpu, p.cpu_attention) == (100, 100, False) and pred.fits
    with pytest.raises(PlacementError):
        solve_placement(ARCH, S, N, 2, 4, machine(device=act_only_budget()), schedule="row")
    with pytest.raises(ValueError, match="act_gpu = 50"):
        solve_placement(ARCH, S, N, 2, 1, machine(), schedule="row", fixed={"act_gpu": 50})
    with pytest.raises(ConfigError, match="cpu_attention = true with schedule = row"):
        solve_placement(ARCH, S, N, 2, 1, machine(), schedule="row", cpu_attention=True)



def test_predictions_of_lp_plans_are_exact_peaks():
    """Every candidate's predicted peak is CostTerms.peak of its printed policy (whole rows, staging buffers),
    and fits: the LP never prints a plan its own prediction (the runtime's bytes) refuses."""
    hw = machine(device=act_only_budget() + 20000, host=2 * 10**6)
    _, _, candidates = search_policy(ARCH, S, N, hw, gpu_batch_sizes=[1, 2, 4], num_gpu_batches=[1, 2, 4, 8])
    model = CostModel(ARCH, S, N, hw, "float32")
    for p, pred in candidates:
        terms = model.terms(p.gpu_batch_size, p.num_gpu_batches, p.cpu_attention, p.schedule, p.prefetch_layers)
        assert evaluate(terms, p, hw).peak == pred.peak and pred.fits, p
