"""The shipped bench config runs the MoE latency suite at DeepSpeed Inference's exact setting (prompt 128,
generate 100, batch 8) on a preset whose positions hold it (tiny-moe-256), instead of shrinking it."""

from __future__ import annotations

from pathlib import Path

from hpcinfer.bench.suites.config import SUITES, load_bench_config
from hpcinfer.bench.suites.run import SuiteRun
from hpcinfer.checkpoint.presets import PRESETS

CONFIG = Path(__file__).resolve().parents[2] / "inputs" / "bench-cpu.toml"


def test_shipped_moe_suite_runs_the_papers_setting(tmp_path):
    cfg = load_bench_config(str(CONFIG))
    suite = next(s for s in cfg.suites if s.name == "moe-latency")
    paper = SUITES["moe-latency"]
    assert (suite.prompt_len, suite.new_tokens) == (paper.prompt_len, paper.new_tokens)
    assert 8 in suite.batches
    arch = PRESETS[suite.model.preset]
    assert any(arch.moe_experts) and suite.prompt_len + suite.new_tokens <= arch.max_positions
    run = SuiteRun(cfg, suite, tmp_path)
    assert run.skip == "" and any(not c.skip for c in run.cells)


def test_tiny_moe_256_is_tiny_moe_with_more_positions():
    small, big = PRESETS["tiny-moe"], PRESETS["tiny-moe-256"]
    assert big.max_positions >= 256 > small.max_positions
    assert big.moe_experts == small.moe_experts and big.hidden_size == small.hidden_size


def test_moe_suite_runs_the_one_hot_dispatch_beside_each_layout(tmp_path):
    """Every runnable hpcinfer cell of the MoE suite has a one-hot MoE dispatch cell at the same layout and batch,
    whose job differs only by `[moe] dispatch = "one-hot"` (the run's all-to-all kept, so the ratio is the
    dispatch's alone); its ratio goes to the baselines like the other naive paths."""
    from hpcinfer.bench.suites.cells import job_sections

    cfg = load_bench_config(str(CONFIG))
    suite = next(s for s in cfg.suites if s.name == "moe-latency")
    run = SuiteRun(cfg, suite, tmp_path)
    ours = [c for c in run.cells if c.variant == "hpcinfer" and not c.skip]
    assert {c.layout.name for c in ours} == {"1 rank", "ep=2"}
    for cell in ours:
        (one_hot,) = [c for c in run.cells if c.variant == "one-hot MoE dispatch" and c.layout == cell.layout
                      and c.batch == cell.batch]
        assert one_hot.extra == {"moe": {"dispatch": "one-hot"}} and not one_hot.skip
        base = job_sections(cell, tmp_path / "p.jsonl", tmp_path, "t", 0)
        naive = job_sections(one_hot, tmp_path / "p.jsonl", tmp_path, "t", 0)
        assert naive.pop("moe") == {**base.pop("moe", {}), "dispatch": "one-hot"}
        assert naive == base


def test_one_hot_dispatch_is_no_longer_listed_as_not_measured():
    from hpcinfer.bench.suites.run import not_applicable

    for gpus in ([], [{"name": "GPU", "driver": "1"}]):
        assert "one-hot MoE dispatch" not in [n["name"] for n in not_applicable({"gpus": gpus})]
