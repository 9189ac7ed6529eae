"""Bench results schema 2 (docs/bench.md): every figure of issue 9 required in an hpcinfer cell, null only with a
reason, "n/a" in the report; the backend each cell ran on and the transformers baseline's device; the CUDA graphs
variant (planned on cupy, not applicable with its reason on NumPy); the scaling plot's batch. All on the CPU: the
GPU cases run with the backend named, or with a stand-in torch whose CUDA is (not) available."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcinfer.bench.hf_baseline import device_name, pick_device
from hpcinfer.bench.suites import figures as fig
from hpcinfer.bench.suites.cells import job_sections, toml_text
from hpcinfer.bench.suites.config import load_bench_config, resolve_backend
from hpcinfer.bench.suites.plan import CUDA_GRAPHS, plan_cells
from hpcinfer.bench.suites.report import markdown, scaling_batch
from hpcinfer.bench.suites.schema import V1, V2, validate
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError, InputError

DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURE = DATA / "bench-results-fixture.json"                 # schema 2, made by tests/data/bench-fixture.toml
FIXTURE_V1 = DATA / "bench-results-fixture-v1.json"           # the same config's 2026-11-21 results, schema 1
COMMITTED = Path(__file__).resolve().parents[2] / "bench" / "results"

TINY = """
[model]
preset = "tiny-dense"

[run]
quiet_wait_s = 0

[[layout]]
name = "1 rank"

[[layout]]
name = "tp=2"
ranks = 2
tp = 2

[[layout]]
name = "ep=2"
ranks = 2
ep = 2

[suite.dense-latency]
prompt_len = 8
new_tokens = 3
batches = [1, 2]
layouts = ["1 rank", "tp=2"]

[suite.moe-latency]
model = { preset = "tiny-moe" }
prompt_len = 8
new_tokens = 3
batches = [2]
layouts = ["ep=2"]

[suite.offload-max-batch]
prompt_len = 8
new_tokens = 3
batches = [2]
layouts = ["1 rank"]
"""


def load(path=FIXTURE) -> dict:
    return json.loads(path.read_text())


def first_ok(result: dict, variant: str = "hpcinfer") -> dict:
    return next(c for s in result["suites"] for c in s["cells"] if c["status"] == "ok" and c["variant"] == variant)


def config(tmp_path, text=TINY):
    path = tmp_path / "bench.toml"
    path.write_text(text)
    return load_bench_config(str(path))


# ---- the schema -------------------------------------------------------------------------------------------------

def test_fixture_is_schema_2_and_states_every_figure():
    result = load()
    assert result["schema"] == V2 and result["backend"] == "numpy"
    validate(result)
    for suite in result["suites"]:
        for cell in suite["cells"]:
            if cell["status"] != "ok":
                continue
            f = cell["figures"]
            assert f["backend"] == "numpy"
            for key in ("tflops_per_rank", "bandwidth_GBps_per_rank", "bandwidth_utilization", "bubble_fraction"):
                assert key in f and (f[key] is not None or key in f["null_reasons"]), key
            assert (f["bubble_fraction"] is None) == (cell["layout"]["pp"] == 1)


def test_removing_tflops_per_rank_fails_naming_it():
    result = load()
    first_ok(result)["figures"].pop("tflops_per_rank")
    with pytest.raises(InputError, match="'tflops_per_rank' is a required property"):
        validate(result)


@pytest.mark.parametrize("key", ["bandwidth_GBps_per_rank", "bubble_fraction", "memory", "mesh", "backend"])
def test_every_issue_figure_is_required(key):
    result = load()
    first_ok(result)["figures"].pop(key)
    with pytest.raises(InputError, match=f"'{key}' is a required property"):
        validate(result)


def test_a_null_figure_needs_its_reason():
    result = load()
    cell = next(c for s in result["suites"] for c in s["cells"] if c["status"] == "ok" and c["layout"]["pp"] > 1)
    f = cell["figures"]
    f["bubble_fraction"] = None                           # a pp=2 cell's bubble, nulled without a reason
    with pytest.raises(InputError, match="bubble_fraction"):
        validate(result)
    f.setdefault("null_reasons", {})["bubble_fraction"] = "not measured in this test"
    validate(result)
    f["memory"]["host_peak_rss_bytes_per_rank"] = None
    with pytest.raises(InputError, match="memory.host_peak_rss_bytes_per_rank"):
        validate(result)


def test_a_zero_is_not_a_missing_figure_reason():
    """null_reasons may not be empty strings: a reason says why."""
    result = load()
    f = first_ok(result)["figures"]
    f["null_reasons"]["bubble_fraction"] = ""
    with pytest.raises(InputError, match="null_reasons"):
        validate(result)


def test_transformers_baseline_states_its_device_and_keeps_lean_figures():
    result = load()
    hf = [b for s in result["suites"] for b in s["baselines"] if b["kind"] == "transformers" and b["status"] == "ok"]
    assert hf and {b["device"] for b in hf} == {"cpu"}
    assert all("tflops_per_rank" not in b["figures"] for b in hf)            # lean figures are enough
    hf[0].pop("device")
    with pytest.raises(InputError, match="'device' is a required property"):
        validate(result)


def test_older_results_validate_with_their_own_schema_version():
    """Results written before schema 2 (the committed bench/results/bench-cpu-2026-11-2[12].json and the v1
    fixture) carry "hpcinfer-bench/1" and are checked against that version's lean figures: they were measured
    before the cells recorded their backend or nulls with reasons, and re-running them would change the numbers
    the docs quote. A v1 file relabelled as v2 fails, so old files cannot pass as new ones."""
    committed = {p.name: load(p) for p in sorted(COMMITTED.glob("bench-cpu-*.json"))}
    for name in ("bench-cpu-2026-11-21.json", "bench-cpu-2026-11-22.json"):
        assert committed[name]["schema"] == V1, name
    for result in committed.values():                                      # each against its own version
        validate(result)
    old = [load(FIXTURE_V1)] + [r for r in committed.values() if r["schema"] == V1]
    for result in old:
        validate(result)
    relabelled = copy.deepcopy(old[0]) | {"schema": V2}
    with pytest.raises(InputError):
        validate(relabelled)
    with pytest.raises(InputError, match="not a bench results schema"):
        validate(copy.deepcopy(old[0]) | {"schema": "hpcinfer-bench/9"})


# ---- figures: backend and nulls ---------------------------------------------------------------------------------

def metrics(pp=1, backend=None, config_backend="numpy"):
    m = {"prefill_s": 0.5, "decode_step_ms": {"median": 20.0, "p90": 30.0}, "tokens_per_s": 100.0,
         "flop_rate_GFLOPs_per_rank": 1500.0, "decode_weight_bandwidth_GBps_per_rank": 2.0,
         "pipeline": {"bubble_fraction": 0.0 if pp == 1 else 0.25}, "generate_s": 3.0, "load_s": 1.0,
         "offload": {"weights_peak_device_bytes_per_rank": 0, "weights_bytes_from_host": 0,
                     "weights_bytes_from_disk": 0},
         "kv_cache": {"peak_device_bytes_per_rank": 4096},
         "memory": {"host_peak_rss_bytes_per_rank": 10**8, "weight_bytes_per_rank": 5 * 10**6},
         "mesh": {"world": pp, "pp": pp, "dp": 1, "tp": 1, "threads_per_rank": 1},
         "config": {"runtime": {"backend": config_backend}}}
    if backend:
        m["backend"] = backend
    return m


def test_bubble_without_a_pipeline_is_null_with_a_reason():
    one = fig.from_metrics(metrics(pp=1), 1, 8.0)
    assert one["bubble_fraction"] is None and "pp = 1" in one["null_reasons"]["bubble_fraction"]
    two = fig.from_metrics(metrics(pp=2), 2, 8.0)
    assert two["bubble_fraction"] == 0.25 and "bubble_fraction" not in two.get("null_reasons", {})


def test_backend_comes_from_the_run():
    assert fig.from_metrics(metrics(backend="cupy", config_backend="auto"), 1, 8.0)["backend"] == "cupy"
    assert fig.from_metrics(metrics(), 1, 8.0)["backend"] == "numpy"               # the config echo
    assert fig.from_metrics(metrics(config_backend="auto"), 1, 8.0, backend="numpy")["backend"] == "numpy"


def test_gpu_cells_do_not_compare_with_the_hosts_read_bandwidth():
    f = fig.from_metrics(metrics(backend="cupy"), 1, 8.0)
    assert f["bandwidth_utilization"] is None and "host" in f["null_reasons"]["bandwidth_utilization"]
    assert fig.from_metrics(metrics(), 1, 8.0)["bandwidth_utilization"] == 0.25


def test_medians_keep_nulls_and_their_reasons():
    runs = [fig.from_metrics(metrics(), 1, None) for _ in range(3)]
    med = fig.medians(runs)
    assert med["bubble_fraction"] is None and med["bandwidth_utilization"] is None
    assert set(med["null_reasons"]) == {"bubble_fraction", "bandwidth_utilization",
                                        "memory.device_total_bytes_per_rank"}
    assert med["backend"] == "numpy"


# ---- the report -------------------------------------------------------------------------------------------------

def test_report_prints_na_and_the_reason_for_a_null():
    result = load()
    text = markdown(result, [])
    assert "hpcinfer backend: numpy" in text and "transformers baseline device: cpu" in text
    assert "| 1 rank | 1 = 1×1×1 | 1 | hpcinfer | numpy |" in text
    assert "n/a `bubble_fraction`" in text and "pp = 1: no pipeline stages to wait for" in text
    cell = next(c for s in result["suites"] for c in s["cells"] if c["status"] == "ok" and c["layout"]["pp"] == 1)
    row = next(line for line in text.splitlines()
               if line.startswith(f"| {cell['layout']['name']} | ") and f"| {cell['batch']} | hpcinfer |" in line)
    assert row.split("|")[11].strip() == "n/a"                           # the bubble column, never "0%"
    assert "| transformers on cpu | 1 rank |" in text


def test_report_of_an_older_file_says_na_for_a_missing_figure():
    result = load(FIXTURE_V1)
    cell = first_ok(result)
    cell["figures"].pop("bubble_fraction")
    text = markdown(result, [])
    row = next(line for line in text.splitlines() if line.startswith(f"| {cell['layout']['name']} | "))
    assert row.split("|")[11].strip() == "n/a" and "backend: not recorded" in text


def test_report_says_when_transformers_ran_on_another_device():
    result = load()
    note = "torch has no CUDA here: the transformers baseline ran on the CPU against hpcinfer on the GPU"
    for s in result["suites"]:
        for b in s["baselines"]:
            if b["kind"] == "transformers" and b["status"] == "ok":
                b["device_note"] = note
    validate(result)
    assert f"**transformers device:** {note}" in markdown(result, [])


# ---- the transformers baseline's device -------------------------------------------------------------------------

def fake_torch(cuda: bool):
    return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: cuda, current_device=lambda: 0,
                                                get_device_name=lambda i: "NVIDIA H200"))


def test_transformers_runs_where_hpcinfer_runs():
    assert pick_device("numpy", fake_torch(True)) == ("cpu", "")         # never GPU against hpcinfer's CPU
    assert pick_device("cupy", fake_torch(True)) == ("cuda", "")
    device, note = pick_device("cupy", fake_torch(False))
    assert device == "cpu" and "GPU with a CPU" in note
    assert device_name("cuda", fake_torch(True)) == "cuda:0 (NVIDIA H200)" and device_name("cpu", None) == "cpu"


# ---- backend and the CUDA graphs variant ------------------------------------------------------------------------

def test_bench_backend_is_checked_and_resolved(tmp_path, monkeypatch):
    assert config(tmp_path).backend == "auto"
    assert config(tmp_path, TINY.replace("quiet_wait_s = 0", 'quiet_wait_s = 0\nbackend = "numpy"')).backend == \
        "numpy"
    with pytest.raises(ConfigError, match=r"\[run\].backend = 'gpu' must be one of auto, numpy, cupy"):
        config(tmp_path, TINY.replace("quiet_wait_s = 0", 'quiet_wait_s = 0\nbackend = "gpu"'))
    assert resolve_backend("numpy") == "numpy" and resolve_backend("cupy") == "cupy"
    from hpcinfer.backend import cupy_ops

    for gpu, resolved in ((True, "cupy"), (False, "numpy")):               # auto follows what cupy sees
        monkeypatch.setattr(cupy_ops, "gpu_available", lambda gpu=gpu: gpu)
        assert resolve_backend("auto") == resolved


def test_cells_name_their_backend_in_the_job_config(tmp_path):
    cfg = config(tmp_path)
    for backend in ("numpy", "cupy"):
        for cell in plan_cells(cfg, cfg.suites[0], PRESETS["tiny-dense"], backend):
            if cell.skip:
                continue
            path = tmp_path / "job.toml"
            path.write_text(toml_text(job_sections(cell, tmp_path / "p.jsonl", tmp_path, "t", 0)))
            job = load_config(str(path))                                  # the real loader accepts it
            assert job.runtime.backend == backend
            assert job.runtime.cuda_graphs == (cell.variant == CUDA_GRAPHS)


def test_cuda_graphs_variant_is_planned_on_cupy_only(tmp_path):
    cfg = config(tmp_path)
    dense, moe, offload = cfg.suites
    on_gpu = plan_cells(cfg, dense, PRESETS["tiny-dense"], "cupy")
    ours = [c for c in on_gpu if c.variant == "hpcinfer" and not c.skip]
    graphs = [c for c in on_gpu if c.variant == CUDA_GRAPHS]
    assert ours and [(c.layout, c.batch) for c in graphs] == [(c.layout, c.batch) for c in ours]
    assert all(c.extra == {"runtime": {"cuda_graphs": True}} and c.backend == "cupy" for c in graphs)
    assert not [c for c in plan_cells(cfg, dense, PRESETS["tiny-dense"], "numpy") if c.variant == CUDA_GRAPHS]
    # graphs cannot capture MoE layers or streamed weights: not planned there even on cupy
    assert not [c for c in plan_cells(cfg, moe, PRESETS["tiny-moe"], "cupy") if c.variant == CUDA_GRAPHS]
    assert not [c for c in plan_cells(cfg, offload, PRESETS["tiny-dense"], "cupy") if c.variant == CUDA_GRAPHS]


def test_no_cuda_graphs_is_not_applicable_with_the_reason_on_numpy():
    from hpcinfer.bench.suites.run import not_applicable

    on_cpu = {n["name"]: n["reason"] for n in not_applicable({"gpus": []}, "numpy")}
    assert "NumPy backend" in on_cpu["no CUDA graphs"]
    gpu_numpy = {n["name"]: n["reason"] for n in not_applicable({"gpus": [{"name": "H200"}]}, "numpy")}
    assert "[runtime] cuda_graphs needs cupy" in gpu_numpy["no CUDA graphs"]
    on_gpu = [n["name"] for n in not_applicable({"gpus": [{"name": "H200"}]}, "cupy")]
    assert "no CUDA graphs" not in on_gpu                 # a variant cell of the suites instead


def _ok(run, cell, tokens_per_s: float, per_token_ms: float) -> dict:
    run.tokens[cell.key] = {"p0000": [1, 2, 3], "p0001": [4, 5, 6]}
    f = fig.from_metrics(metrics(), 1, 8.0, backend=cell.backend)
    f.update(tokens_per_s=tokens_per_s, per_token_ms_median=per_token_ms)
    import dataclasses

    return {"layout": dataclasses.asdict(cell.layout) | {"dp": cell.layout.dp}, "batch": cell.batch,
            "variant": cell.variant, "status": "ok", "figures": f, "runs": [f]}


def test_cuda_graphs_ratio_is_off_over_on_and_moe_suites_say_why_not(tmp_path):
    """The graphs cell is the tuned path: its baseline "no CUDA graphs" is the layout's default hpcinfer cell, so
    the ratio is > 1 when graphs help. On cupy, a suite graphs cannot run in says so among its baselines."""
    from hpcinfer.bench.suites.run import SuiteRun, baselines

    cfg = config(tmp_path, TINY.replace("[suite.moe-latency]", "[suite.moe-latency]\nhf_baseline = false")
                 .replace("[suite.dense-latency]", "[suite.dense-latency]\nhf_baseline = false"))
    dense = SuiteRun(cfg, cfg.suites[0], tmp_path, "cupy")
    one = [c for c in dense.cells if c.layout.name == "1 rank" and c.batch == 1]
    plain, graphs = (next(c for c in one if c.variant == v) for v in ("hpcinfer", CUDA_GRAPHS))
    records = [_ok(dense, plain, 100.0, 10.0), _ok(dense, graphs, 150.0, 5.0)]
    (b,) = [b for b in baselines(dense, records) if b["kind"] == "naive"]
    assert (b["name"], b["status"], b["layout"], b["batch"]) == ("no CUDA graphs", "ok", "1 rank", 1)
    assert b["ratios"]["tokens_per_s"] == 1.5 and b["ratios"]["per_token_ms_median"] == 2.0
    assert b["checks"]["min"] == b["checks"]["length"] == 3
    moe = SuiteRun(cfg, cfg.suites[1], tmp_path, "cupy")
    na = [b for b in baselines(moe, []) if b["name"] == "no CUDA graphs"]
    assert na == [{"name": "no CUDA graphs", "kind": "naive", "status": "not applicable",
                   "reason": "cannot capture MoE layers: their per-expert row counts go to the host every step"}]
    assert not [b for b in baselines(SuiteRun(cfg, cfg.suites[1], tmp_path, "numpy"), [])
                if b["name"] == "no CUDA graphs"]


# ---- the scaling plot's batch -----------------------------------------------------------------------------------

def test_scaling_batch_is_the_largest_that_ran_on_every_rank_count():
    """On the committed 2026-11-22 results: dense-latency ran batches 1, 4, 16 on 1 and 2 ranks, so 16; with the
    2-rank batch-16 cells gone (as when a layout is rejected there) the plot compares rank counts at 4, not at a
    batch only one rank count ran."""
    result = load(COMMITTED / "bench-cpu-2026-11-22.json")
    dense = next(s for s in result["suites"] if s["name"] == "dense-latency")
    assert scaling_batch(dense) == (16, "")
    trimmed = copy.deepcopy(dense)
    trimmed["cells"] = [c for c in trimmed["cells"] if not (c["layout"]["ranks"] == 2 and c["batch"] == 16)]
    assert scaling_batch(trimmed) == (4, "")
    disjoint = copy.deepcopy(dense)
    disjoint["cells"] = [c for c in disjoint["cells"] if (c["layout"]["ranks"], c["batch"]) in ((1, 1), (2, 4))]
    batch, note = scaling_batch(disjoint)
    assert batch == 4 and "1 rank(s) missing" in note
    assert scaling_batch({"cells": []}) == (None, "")
