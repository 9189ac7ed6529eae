"""`hpcinfer bench` (docs/bench.md): the bench config and the suites, the cells each suite plans, the job configs
they generate (checked by the real config loader), the figures and ratios, the results JSON schema, the report
generator on a stored results file, and one tiny end-to-end run on 1 and 2 ranks."""

import copy
import json
import shutil
import tomllib
from pathlib import Path

import pytest

from hpcinfer.bench.suites import figures as fig
from hpcinfer.bench.suites.cells import job_sections, launch_argv, toml_text
from hpcinfer.bench.suites.config import SUITES, load_bench_config
from hpcinfer.bench.suites.plan import plan_cells
from hpcinfer.bench.suites.report import PLOTS, markdown, report_from_file
from hpcinfer.bench.suites.schema import validate
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError, InputError

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "bench-results-fixture.json"

TINY = """
[model]
preset = "tiny-dense"

[run]
repeats = 1
quiet_wait_s = 0

[[layout]]
name = "1 rank"
ranks = 1

[[layout]]
name = "dp=2"
ranks = 2

[[layout]]
name = "ep=2"
ranks = 2
ep = 2

[suite.dense-latency]
prompt_len = 8
new_tokens = 3
batches = [1, 2]
layouts = ["1 rank", "dp=2", "ep=2"]

[suite.moe-latency]
model = { preset = "tiny-moe" }
prompt_len = 8
new_tokens = 3
batches = [2]
layouts = ["ep=2"]
"""


def write(tmp_path, text, name="bench.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- the suites and the bench config -------------------------------------------------------------------------

def test_suites_default_to_the_papers_workloads():
    assert (SUITES["dense-latency"].prompt_len, SUITES["dense-latency"].new_tokens) == (128, 8)
    assert SUITES["dense-latency"].batches == (1, 2, 4, 8, 16, 32, 64, 128)
    assert (SUITES["moe-latency"].prompt_len, SUITES["moe-latency"].new_tokens, SUITES["moe-latency"].batches) \
        == (128, 100, (8,))
    assert (SUITES["throughput"].prompt_len, SUITES["throughput"].new_tokens) == (512, 50)
    assert (SUITES["offload-max-batch"].prompt_len, SUITES["offload-max-batch"].new_tokens) == (512, 32)


def test_a_suite_without_a_table_gets_the_defaults(tmp_path):
    cfg = load_bench_config(write(tmp_path, '[model]\npreset = "gpt2-1.5b"\n[run]\nsuites = ["throughput"]\n'))
    (suite,) = cfg.suites
    assert (suite.prompt_len, suite.new_tokens, suite.batches) == (512, 50, SUITES["throughput"].batches)
    assert [lay.name for lay in cfg.layouts] == ["1 rank"]


def test_bench_config_shrinks_suites_and_overrides_the_model(tmp_path):
    cfg = load_bench_config(write(tmp_path, TINY))
    dense, moe = cfg.suites
    assert (dense.prompt_len, dense.new_tokens, dense.batches) == (8, 3, (1, 2))
    assert dense.model.preset == "tiny-dense" and moe.model.preset == "tiny-moe"
    assert [s.name for s in load_bench_config(write(tmp_path, TINY), ["moe-latency"]).suites] == ["moe-latency"]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t + "\n[suite.offload-max-batch]\nbogus = 1\n", "unknown key 'bogus' in [suite.offload-max-batch]"),
    (lambda t: t.replace("[suite.dense-latency]", "[suite.dense-latenc]"), "unknown key 'dense-latenc'"),
    (lambda t: t.replace("prompt_len = 8\nnew_tokens = 3\nbatches = [1, 2]", "prompt_len = 126\nnew_tokens = 3\n"
                         "batches = [1, 2]"), "is above tiny-dense's 128 positions"),
    (lambda t: t.replace("batches = [1, 2]", "batches = [0]"), "batches = [0] must be a non-empty list"),
    (lambda t: t.replace('layouts = ["ep=2"]', 'layouts = ["ep=4"]'), "not a [[layout]] name"),
    (lambda t: t.replace("name = \"dp=2\"\nranks = 2", "name = \"dp=2\"\nranks = 3\npp = 2"),
     "ranks = 3 must be a multiple of tp * pp = 2"),
    (lambda t: t.replace('preset = "tiny-dense"', 'preset = "tiny-dense"\ncheckpoint = "x.h5"'),
     "needs exactly one of 'checkpoint'"),
])
def test_bench_config_errors_name_the_key(tmp_path, edit, message):
    with pytest.raises(ConfigError, match="bench.toml") as err:
        load_bench_config(write(tmp_path, edit(TINY)))
    assert message in str(err.value)


def test_unknown_suite_on_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match="--suite 'latency' is not a suite"):
        load_bench_config(write(tmp_path, TINY), ["latency"])


# ---- the cells ------------------------------------------------------------------------------------------------

def test_cells_skip_what_cannot_run_and_add_the_naive_paths(tmp_path):
    cfg = load_bench_config(write(tmp_path, TINY))
    dense, moe = cfg.suites
    cells = {c.key: c for c in plan_cells(cfg, dense, PRESETS["tiny-dense"])}
    assert cells["dense-latency | dp=2 | batch 1 | hpcinfer"].skip.startswith("batch 1 is not a multiple of dp")
    assert cells["dense-latency | ep=2 | batch 2 | hpcinfer"].skip == "ep / expert_tp > 1 need an MoE model"
    assert not cells["dense-latency | dp=2 | batch 2 | hpcinfer"].skip
    assert not any(c.variant != "hpcinfer" for c in cells.values())           # a dense model has no naive path
    moe_cells = plan_cells(cfg, moe, PRESETS["tiny-moe"])
    assert [(c.variant, c.extra) for c in moe_cells] == [("hpcinfer", {}),
                                                         ("one-hot MoE dispatch", {"moe": {"dispatch": "one-hot"}}),
                                                         ("flat all-to-all", {"moe": {"all_to_all": "flat"}})]


def test_offload_suite_runs_row_by_row_beside_zigzag(tmp_path):
    text = TINY + '\n[suite.offload-max-batch]\nprompt_len = 8\nnew_tokens = 3\nbatches = [4]\n' \
                  'offload = { device_memory = "1MB" }\n'
    cfg = load_bench_config(write(tmp_path, text), ["offload-max-batch"])
    (suite,) = cfg.suites
    assert suite.offload["schedule"] == "zigzag" and suite.offload["device_memory"] == "1MB"
    cells = plan_cells(cfg, suite, PRESETS["tiny-dense"])
    runnable = [c for c in cells if not c.skip]
    assert {c.layout.name for c in runnable} == {"1 rank", "dp=2"}
    assert {c.variant for c in runnable} == {"hpcinfer", "row-by-row offload"}


def test_offload_batches_above_a_rejected_one_are_not_run(tmp_path):
    from hpcinfer.bench.suites.run import SuiteRun, rejected_smaller

    text = TINY + '\n[suite.offload-max-batch]\nprompt_len = 8\nnew_tokens = 3\nbatches = [2, 4, 8]\n'
    cfg = load_bench_config(write(tmp_path, text), ["offload-max-batch"])
    run = SuiteRun(cfg, cfg.suites[0], tmp_path)
    b2, b4, b8 = [c for c in run.cells if c.variant == "hpcinfer" and c.layout.name == "1 rank"]
    run.outcome[b4.key] = {"status": "rejected", "error": "does not fit"}
    assert rejected_smaller(run, b2) == rejected_smaller(run, b4) == ""
    assert "batch 4 was already rejected" in rejected_smaller(run, b8)
    row8 = next(c for c in run.cells if c.variant == "row-by-row offload" and c.batch == 8 and not c.skip)
    assert rejected_smaller(run, row8) == ""                  # another variant: its own budgets


def test_generated_job_configs_pass_the_real_config_loader(tmp_path):
    cfg = load_bench_config(write(tmp_path, TINY + '\n[suite.offload-max-batch]\nprompt_len = 8\nnew_tokens = 3\n'
                                                    'batches = [4]\n'))
    for suite in cfg.suites:
        arch = PRESETS[suite.model.preset]
        for cell in plan_cells(cfg, suite, arch):
            if cell.skip:
                continue
            text = toml_text(job_sections(cell, tmp_path / "p.jsonl", tmp_path, "t", 0))
            path = write(tmp_path, text, "job.toml")
            job = load_config(path)
            assert job.generate.max_new_tokens == suite.new_tokens
            assert (job.parallel.tp, job.parallel.pp, job.parallel.ep) == (cell.layout.tp, cell.layout.pp,
                                                                            cell.layout.ep)
            per_replica = cell.batch if cell.moe else cell.batch // cell.layout.dp
            assert job.generate.batch_size == per_replica
            if cell.variant == "row-by-row offload":
                assert job.offload.schedule == "row" and job.offload.cache_gpu == 100.0
            if cell.variant == "flat all-to-all":
                assert job.moe.all_to_all == "flat"
            assert job.moe.dispatch == ("one-hot" if cell.variant == "one-hot MoE dispatch" else "indexed")


def test_toml_text_round_trips_and_refuses_tables():
    sections = {"a": {"s": 'quote " and \\ back', "i": 3, "f": 0.5, "b": False}}
    assert tomllib.loads(toml_text(sections)) == sections
    with pytest.raises(TypeError, match="not a TOML scalar"):
        toml_text({"a": {"x": [1]}})


def test_launcher_fills_in_the_rank_count(tmp_path):
    argv = launch_argv(("srun", "-n", "{ranks}", "--mpi=pmi2"), "/py", 8, tmp_path / "c.toml")
    assert argv == ["srun", "-n", "8", "--mpi=pmi2", "/py", "-m", "hpcinfer", "run", str(tmp_path / "c.toml")]


# ---- figures and ratios ----------------------------------------------------------------------------------------

def metrics(prefill_s=0.5, median_ms=20.0, p90_ms=30.0, tps=100.0, bw=2.0):
    return {"prefill_s": prefill_s, "decode_step_ms": {"median": median_ms, "p90": p90_ms}, "tokens_per_s": tps,
            "flop_rate_GFLOPs_per_rank": 1500.0, "decode_weight_bandwidth_GBps_per_rank": bw,
            "pipeline": {"bubble_fraction": 0.25}, "generate_s": 3.0, "load_s": 1.0,
            "offload": {"weights_peak_device_bytes_per_rank": 0, "weights_bytes_from_host": 0,
                        "weights_bytes_from_disk": 0},
            "kv_cache": {"peak_device_bytes_per_rank": 4096},
            "memory": {"host_peak_rss_bytes_per_rank": 10**8, "weight_bytes_per_rank": 5 * 10**6},
            "mesh": {"world": 2, "pp": 2, "dp": 1, "tp": 1, "threads_per_rank": 1}}


def test_figures_from_metrics():
    f = fig.from_metrics(metrics(), ranks_on_node=2, machine_GBps=8.0)
    assert f["prompt_latency_ms"] == 500.0 and f["tflops_per_rank"] == 1.5
    assert f["bandwidth_utilization"] == 0.5                    # 2 ranks x 2 GB/s of 8 GB/s
    assert f["memory"]["device_weights_bytes_per_rank"] == 5 * 10**6     # not offloaded: the resident weights
    assert fig.from_metrics(metrics(), 1, None)["bandwidth_utilization"] is None


def test_figures_of_the_transformers_baseline():
    f = fig.from_steps(0.2, [0.01, 0.03, 0.02], batch=4, new_tokens=4)
    assert f["prompt_latency_ms"] == pytest.approx(200.0) and f["per_token_ms_median"] == pytest.approx(20.0)
    assert f["tokens_per_s"] == pytest.approx(16 / 0.26)


def test_ratios_are_better_than_one_when_hpcinfer_is_better():
    base = fig.from_metrics(metrics(prefill_s=1.0, median_ms=40.0, tps=50.0), 1, None)
    ours = fig.from_metrics(metrics(prefill_s=0.5, median_ms=20.0, tps=100.0), 1, None)
    r = fig.ratios(base, ours)
    assert (r["prompt_latency_ms"], r["per_token_ms_median"], r["tokens_per_s"]) == (2.0, 2.0, 2.0)


def test_medians_over_rounds():
    runs = [fig.from_metrics(metrics(median_ms=m), 1, None) for m in (10.0, 30.0, 20.0)]
    assert fig.medians(runs)["per_token_ms_median"] == 20.0


# ---- the results schema and the report -------------------------------------------------------------------------

def test_stored_results_fixture_passes_the_schema():
    result = json.loads(FIXTURE.read_text())
    validate(result)
    config = load_bench_config(str(FIXTURE.parent / "bench-fixture.toml"))      # the config that made it
    assert [s.name for s in config.suites] == [s["name"] for s in result["suites"]]


def test_shipped_bench_config_loads():
    config = load_bench_config(str(Path(__file__).resolve().parents[2] / "inputs" / "bench-cpu.toml"))
    assert [s.name for s in config.suites] == list(SUITES)
    assert config.model.hf_source.endswith(".gguf")


@pytest.mark.parametrize("break_it, where", [
    (lambda r: r["suites"][0]["cells"][0].pop("figures"), "suites/0/cells/0"),
    (lambda r: r["suites"][0]["cells"][0].update(status="done"), "suites/0/cells/0"),
    (lambda r: r.update(schema="hpcinfer-bench/0"), "schema"),
    (lambda r: r["machine"].pop("gpus"), "machine"),
    (lambda r: r["suites"][0]["baselines"].append({"name": "x", "kind": "naive", "status": "ok"}),
     "suites/0/baselines"),
])
def test_schema_names_what_is_wrong(break_it, where):
    result = json.loads(FIXTURE.read_text())
    break_it(result)
    with pytest.raises(InputError, match=where):
        validate(result)


def test_report_from_the_stored_results(tmp_path):
    pytest.importorskip("matplotlib")
    stored = tmp_path / FIXTURE.name
    shutil.copy(FIXTURE, stored)
    path, plots = report_from_file(str(stored))
    text = path.read_text()
    result = json.loads(FIXTURE.read_text())
    for suite in result["suites"]:
        assert f"## {suite['name']}" in text
        for cell in suite["cells"]:
            if cell["status"] == "ok":
                assert f"| {cell['layout']['name']} | {cell['layout']['ranks']} = " in text
        for b in suite["baselines"]:
            if b["status"] == "ok":
                name = f"{b['name']} on {b['device']}" if b["kind"] == "transformers" else b["name"]
                assert f"| {name} | {b['layout']} | {b['batch']} | {b['ratios']['prompt_latency_ms']:.2f}× |" in text
    assert [Path(p).name for p in plots] == [f"{FIXTURE.stem}-{name}.png" for name in PLOTS]
    assert all(Path(p).stat().st_size > 1000 and f"]({Path(p).name})" in text for p in plots)


def test_report_shows_the_one_hot_dispatch_ratio():
    """A stored result with a one-hot MoE dispatch cell beside hpcinfer's: the report's baselines table gives its
    ratios, and the one-hot dispatch is no longer among the paths not measured."""
    from hpcinfer.bench.suites.run import not_applicable

    result = copy.deepcopy(json.loads(FIXTURE.read_text()))
    suite = next(s for s in result["suites"] if s["model"]["moe"])
    ours = next(c for c in suite["cells"] if c["status"] == "ok" and c["variant"] == "hpcinfer")
    slow = copy.deepcopy(ours) | {"variant": "one-hot MoE dispatch"}
    slow["figures"] = fig.medians([fig.from_metrics(metrics(prefill_s=1.5, median_ms=50.0, tps=40.0), 1, None,
                                                  backend="numpy")])
    suite["cells"].append(slow)
    ratios = fig.ratios(slow["figures"], ours["figures"])
    suite["baselines"].append({"name": "one-hot MoE dispatch", "kind": "naive", "layout": ours["layout"]["name"],
                               "batch": ours["batch"], "status": "ok", "ratios": ratios,
                               "checks": {"min": 3, "length": 3}})
    result["not_applicable"] = not_applicable(result["machine"])
    validate(result)
    text = markdown(result, [])
    assert ratios["per_token_ms_median"] > 1
    assert (f"| one-hot MoE dispatch | {ours['layout']['name']} | {ours['batch']} | "
            f"{ratios['prompt_latency_ms']:.2f}× | {ratios['per_token_ms_median']:.2f}× | "
            f"{ratios['tokens_per_s']:.2f}× | 3/3 |") in text
    assert "- one-hot MoE dispatch:" not in text.split("## Not measured here")[1]


def test_report_without_plots_and_with_warnings():
    result = copy.deepcopy(json.loads(FIXTURE.read_text()))
    result["warnings"] = ["other processes were busy"]
    text = markdown(result, [])
    assert "## Plots" not in text and "**Warning:** other processes were busy" in text


def test_report_of_a_missing_or_broken_file(tmp_path):
    with pytest.raises(InputError, match="do not exist"):
        report_from_file(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="are not JSON"):
        report_from_file(str(tmp_path / "bad.json"))


# ---- end to end ------------------------------------------------------------------------------------------------

def test_bench_end_to_end_on_one_and_two_ranks(tmp_path, run_cli):
    pytest.importorskip("matplotlib")
    config = write(tmp_path, TINY.replace("batches = [1, 2]", "batches = [2]"))
    proc = run_cli(["bench", config, "--out", str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = (tmp_path / "out").glob("bench-*.json")
    result = json.loads(results.read_text())
    validate(result)
    dense, moe = result["suites"]
    status = {(c["layout"]["name"], c["variant"]): c["status"] for c in dense["cells"] + moe["cells"]}
    assert status == {("1 rank", "hpcinfer"): "ok", ("dp=2", "hpcinfer"): "ok", ("ep=2", "hpcinfer"): "ok",
                      ("ep=2", "flat all-to-all"): "ok", ("ep=2", "one-hot MoE dispatch"): "ok"}
    assert {c["figures"]["mesh"]["world"] for c in dense["cells"] if c["status"] == "ok"} == {1, 2}
    naive = {b["name"]: b for b in moe["baselines"] if b["kind"] == "naive"}
    assert sorted(naive) == ["flat all-to-all", "one-hot MoE dispatch"]
    for b in naive.values():                     # flat and pcc, one-hot and indexed: the same tokens
        assert b["checks"]["min"] == b["checks"]["length"] == 3, b["name"]
    assert "one-hot MoE dispatch" not in [n["name"] for n in result["not_applicable"]]
    assert results.with_suffix(".md").is_file()
    assert len(list((tmp_path / "out").glob("bench-*.png"))) == len(PLOTS)


def test_bench_without_config_or_report_is_an_error(run_cli):
    proc = run_cli(["bench"], timeout=60)
    assert proc.returncode == 2 and "needs a bench config" in proc.stderr
