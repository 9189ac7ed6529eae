"""The shipped bench config runs the MoE latency suite at DeepSpeed Inference's exact setting (prompt 128,
generate 100, batch 8) on a preset whose positions hold it (tiny-moe-256), instead of shrinking it."""

from __future__ import annotations

from pathlib import Path

from hpcinfer.bench.run import SuiteRun
from hpcinfer.bench.suites import SUITES, load_bench_config
from hpcinfer.checkpoint.presets import PRESETS

CONFIG = Path(__file__).resolve().parent.parent / "inputs" / "bench-cpu.toml"


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
