"""`hpcinfer bench`: the papers' workloads as named suites, run as real `hpcinfer run` jobs, with the baselines in
the same run, a results JSON (schema.py), a markdown report and plots (report.py). docs/bench.md.

    common.py       machine info, quiet-machine checks, prompts, the results tail (also used by bench/*.py)
    suites.py       the bench config and the suites' defaults
    plan.py         which cells a suite runs (layouts x batches x variants) and its prompts
    cells.py        one cell = one generated config launched under mpiexec/srun; its metrics
    figures.py      figures from a job's metrics, medians, ratios, the machine's read bandwidth
    hf_baseline.py  the Hugging Face transformers baseline (in process)
    run.py          the rounds and the results
    schema.py       the results' JSON Schema
    report.py       markdown + PNG plots from a results file
"""

from __future__ import annotations


def main_bench(config: str | None, suites: list[str], out: str, report: str | None, keep: bool) -> int:
    """The `hpcinfer bench` command: run a bench config, or (--report) regenerate a report from results."""
    from ..errors import ConfigError
    from .common import logger

    log = logger("hpcinfer bench")
    if report is not None:
        from .report import report_from_file

        path, plots = report_from_file(report)
        log(f"wrote {path} and {len(plots)} plot(s)")
        return 0
    if config is None:
        raise ConfigError("hpcinfer bench needs a bench config (docs/bench.md) or --report RESULTS.json")
    from pathlib import Path

    from .report import write_report
    from .run import run_bench
    from .schema import validate
    from .suites import load_bench_config

    cfg = load_bench_config(config, suites or None)
    result = run_bench(cfg, out, keep)
    validate(result)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = Path(config).stem if Path(config).stem.startswith("bench") else f"bench-{Path(config).stem}"
    stem = out_dir / f"{name}-{result['date']}"
    import json

    Path(f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    path, plots = write_report(result, stem)
    print(path.read_text())
    log(f"wrote {stem}.json, {path} and {len(plots)} plot(s) in {result['elapsed_s']:.0f} s")
    for w in result["warnings"]:
        log(f"warning: {w}")
    return 0
