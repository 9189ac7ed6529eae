"""Issue 32's paper scenarios (gpu/scenarios.py) rehearsed on the CPU stand-in of cupy under the prepared GPU
command (gpu/check.py's flexgen, zero and moe steps, tiny shapes): every case runs and is recorded in
summary.json (no file of their own), the report carries their tables; and the pieces a GPU run leans on: the
results file is rewritten after every case, a case that does not fit the time left is skipped and recorded, the
roofline counts the experts a batch hits."""

from __future__ import annotations

import json

import pytest

import kernel_emulator as emulate
from gpu import check as gpu_check
from gpu import scenarios
from gpu.scenario_common import Results, guarded, mixtral_8x7b, opt_30b
from gpu.scenario_moe import step_bytes

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")

EXPECTED = {
    "flexgen": {"lp-policy", "cpu-attention-flipped", "float16-2-layers", "int4-2-layers"},
    "zero": {"prefetch-1-batch-1", "prefetch-1-batch-2", "prefetch-0-batch-1", "prefetch-0-batch-2",
             "hidden-batch-1", "hidden-batch-2"},
    "moe": {f"{m}-{g}-batch-{b}" for m in ("mixtral-8x7b", "tiny-moe") for g in ("table", "one-hot")
            for b in (1, 2)} | {f"dense-of-mixtral-active-table-batch-{b}" for b in (1, 2)}
           | {f"{m}-ratios-batch-{b}" for m in ("mixtral-8x7b", "tiny-moe") for b in (1, 2)},
}


def test_the_scenarios_rehearse_under_the_gpu_command(tmp_path):
    out = tmp_path / "out"
    assert gpu_check.main(["--fake", "--steps", ",".join(gpu_check.SCENARIOS), "--out", str(out),
                           "--carry", str(tmp_path / "none")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name in gpu_check.SCENARIOS:
        step = summary["steps"][name]
        results = step["results"]
        assert step["rc"] == 0 and results["scale"] == "tiny" and not results["skipped"], (name, step)
        cases = results["cases"]
        flipped = f"cpu-attention-{'off' if results.get('policy', {}).get('cpu_attention') else 'on'}"
        assert {c.replace(flipped, "cpu-attention-flipped") for c in cases} == EXPECTED[name], name
        assert not [c for c, f in cases.items() if "error" in f], name
    flexgen = summary["steps"]["flexgen"]["results"]
    assert flexgen["policy"]["weights_gpu"] < 100                         # the LP offloaded under the budget
    assert all(f["h2d_bytes"] > 0 and f["predicted_tokens_per_s"] > 0 for f in flexgen["cases"].values())
    assert (flexgen["cases"]["int4-2-layers"]["weights_bytes_from_host"]
            < flexgen["cases"]["float16-2-layers"]["weights_bytes_from_host"] / 2)
    assert 0 <= summary["steps"]["zero"]["results"]["cases"]["hidden-batch-2"]["hidden"] <= 1
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.json"]
    assert gpu_check.main(["--report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "### flexgen (tiny scale)" in text and "| mixtral-8x7b-ratios-batch-1 |" in text
    assert "| zero | 0 |" in text and "6 cases (0 failed), 0 skipped" in text


def test_results_are_rewritten_after_every_case_and_short_time_skips(tmp_path):
    path = tmp_path / "r.json"
    results = Results(path, "zero", "tiny", budget_s=60)
    guarded(results, "first", 1, lambda: {"x": 1.0})
    assert json.loads(path.read_text())["cases"]["first"]["x"] == 1.0          # on disk before the next case
    guarded(results, "broken", 1, lambda: 1 / 0)
    guarded(results, "too-long", 3600, lambda: pytest.fail("a case that does not fit must not start"))
    data = json.loads(path.read_text())
    assert "ZeroDivisionError" in data["cases"]["broken"]["error"]
    assert "needs about 3600" in data["skipped"]["too-long"]
    assert "| too-long | skipped:" in scenarios.markdown(data)


def test_the_roofline_counts_the_experts_a_batch_hits():
    arch = mixtral_8x7b(1)
    expert = 8 * 3 * 4096 * 14336 * 2                                           # one layer's 8 experts, float16
    one, many = step_bytes(arch, 1, 0), step_bytes(arch, 64, 0)
    assert one["experts"] == pytest.approx(expert * 2 / 8)                     # top-2 of 8 at one token
    assert many["experts"] == pytest.approx(expert * (1 - (6 / 8) ** 64))
    assert one["dense"] == many["dense"] and one["kv"] == 0


def test_the_shapes_are_the_papers():
    assert 29e9 < sum_params(opt_30b()) < 31e9
    assert 46e9 < sum_params(mixtral_8x7b()) < 47.5e9


def sum_params(arch) -> int:
    import math

    from hpcinfer.arch import tensor_shapes

    return sum(math.prod(s) for s in tensor_shapes(arch).values())
