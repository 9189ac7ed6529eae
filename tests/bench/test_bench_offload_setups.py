"""bench/offload_setups.py's Table 4 ablations of the LP's policy and offload_report.py's ratios
against them (the benchmark's whole path runs in tests/bench/test_bench_offload.py)."""

from __future__ import annotations

import pytest

from bench.offload_report import ratios
from bench.offload_setups import Setup, plan_ablations

PLAN = dict(schedule="zigzag", gpu_batch_size=4, num_gpu_batches=2, weights_gpu=31, weights_cpu=69, cache_gpu=0,
            cache_cpu=100, act_gpu=100, act_cpu=0, cpu_attention=True, prefetch_layers=1)


def test_each_ablation_removes_one_thing_from_the_plan():
    plan = Setup("plan: search_policy", "policy", "the LP's policy", PLAN)
    got = {s.name: s.keys for s in plan_ablations(plan)}
    assert set(got) == {"plan: no overlap", "plan: no CPU attention"}     # row: its KV cache is on the host
    for name, key, value in (("plan: no overlap", "prefetch_layers", 0),
                             ("plan: no CPU attention", "cpu_attention", False)):
        assert got[name] == {**PLAN, key: value}
    assert plan.keys == PLAN                                             # the plan itself is untouched


def test_a_plan_without_overlap_is_compared_with_overlap_on():
    """On a NumPy-measured profile the plan has prefetch_layers = 0 (lp.default_prefetch): its Table 4 pair is
    then the same policy with prefetch 1, and the ratio says which is faster."""
    keys = {**PLAN, "prefetch_layers": 0}
    got = {s.name: s.keys for s in plan_ablations(Setup("plan: search_policy", "policy", "", keys))}
    assert "plan: no overlap" not in got and got["plan: prefetch 1"] == {**keys, "prefetch_layers": 1}
    runs = {name: {"name": name, "tokens_per_s": tps, "weights_bytes_from_host": 1}
            for name, tps in (("plan: search_policy", 50.0), ("plan: prefetch 1", 40.0))}
    assert ratios(runs)["plan: search_policy / plan: prefetch 1"] == pytest.approx(50 / 40)


@pytest.mark.parametrize("cache_gpu, cpu_attention, row", [(100, False, True), (0, False, False),
                                                           (100, True, False)])
def test_the_row_ablation_only_where_the_runtime_allows_row(cache_gpu, cpu_attention, row):
    keys = {**PLAN, "cache_gpu": cache_gpu, "cache_cpu": 100 - cache_gpu, "cpu_attention": cpu_attention}
    names = {s.name: s.keys for s in plan_ablations(Setup("plan: search_policy", "policy", "", keys))}
    assert ("plan: row schedule" in names) == row
    if row:
        assert names["plan: row schedule"] == {**keys, "schedule": "row"}


def test_the_plan_is_compared_with_the_best_row_run():
    runs = {name: {"name": name, "tokens_per_s": tps, "weights_bytes_from_host": 1}
            for name, tps in (("plan: search_policy", 50.0), ("host: row", 10.0), ("host: row, whole batch", 40.0),
                              ("plan: no overlap", 25.0))}
    got = ratios(runs)
    assert got["plan: search_policy / best row-by-row (host: row, whole batch)"] == pytest.approx(50 / 40)
    assert got["plan: search_policy / host: row"] == pytest.approx(5.0)
    assert got["plan: search_policy / plan: no overlap"] == pytest.approx(2.0)
    assert "plan: search_policy / plan: no CPU attention" not in got                   # not run: no ratio


def test_token_checks_compare_each_run_with_its_formats_reference():
    """summarize: a run is held to the all-on-device reference of its own weight and KV format; one with other
    tokens is a difference, one whose format has no reference run is 'no_reference' (not silently 'different',
    as `--only policy` reported before the references always ran)."""
    from bench.offload import summarize

    def run(group, tokens, kv="none"):
        return [{"run_s": 1.0, "cpu": None, "group": group, "quantize": "none", "kv_cache": kv, "tokens": tokens,
                 "weights_peak_device_bytes": 10}]

    samples = {"all on device": run("reference", [[1, 2]]), "host: zig-zag": run("host", [[1, 2]]),
               "host: row": run("host", [[1, 3]]), "cache int4": run("cache", [[1, 2]], kv="int4")}
    _, _, checks = summarize(samples, {}, budget=100)
    assert checks["same_tokens_as_all_on_device"] == ["all on device", "host: zig-zag"]
    assert checks["different_tokens"] == ["host: row"]
    assert checks["no_reference"] == ["cache int4"]
