"""The `hpcinfer bench` command: run a bench config's suites and write the results JSON and the report, or
regenerate a report from stored results (docs/bench.md)."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import ConfigError
from ..common import logger
from .config import load_bench_config
from .report import report_from_file, write_report
from .run import run_bench
from .schema import validate


def main_bench(config: str | None, suites: list[str], out: str, report: str | None, keep: bool) -> int:
    """The `hpcinfer bench` command: run a bench config, or (--report) regenerate a report from results."""
    log = logger("hpcinfer bench")
    if report is not None:
        path, plots = report_from_file(report)
        log(f"wrote {path} and {len(plots)} plot(s)")
        return 0
    if config is None:
        raise ConfigError("hpcinfer bench needs a bench config (docs/bench.md) or --report RESULTS.json")
    cfg = load_bench_config(config, suites or None)
    result = run_bench(cfg, out, keep)
    validate(result)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = Path(config).stem if Path(config).stem.startswith("bench") else f"bench-{Path(config).stem}"
    stem = out_dir / f"{name}-{result['date']}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    path, plots = write_report(result, stem)
    print(path.read_text())
    log(f"wrote {stem}.json, {path} and {len(plots)} plot(s) in {result['elapsed_s']:.0f} s")
    for w in result["warnings"]:
        log(f"warning: {w}")
    return 0
