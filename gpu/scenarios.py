"""The papers' headline scenarios on a GPU (issue 32), one entry each, as steps of the prepared GPU command
(gpu/check.py chains them after its regression steps, each under its own timeout; docs/gpu.md):

    python -m gpu.scenarios flexgen --out DIR/flexgen.json [--budget S] [--scale full|tiny]
    python -m gpu.scenarios zero    --out DIR/zero.json
    python -m gpu.scenarios moe     --out DIR/moe.json
    python -m gpu.scenarios --report FILE.json ...    the markdown tables of result files

flexgen and zero: gpu/scenario_offload.py; moe: gpu/scenario_moe.py (their docstrings say what each case measures
and against which bound). The results file is rewritten after every case and each case's line is printed as it
ends, so a step cut by its timeout keeps the cases that ended; a case that would not fit the time left is skipped
(recorded). `--scale tiny` (the default on the CPU stand-in of cupy, `python -m emu_cupy -m gpu.scenarios ...`)
runs the same code on tiny shapes: the rehearsal of tests/bench/test_gpu_scenarios.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcinfer.backend.cupy_ops import CupyOps

from . import scenario_moe, scenario_offload
from .scenario_common import Results

RUN = {"flexgen": scenario_offload.flexgen, "zero": scenario_offload.zero, "moe": scenario_moe.moe}
BUDGET_S = {"flexgen": 170.0, "zero": 100.0, "moe": 120.0}     # under 3 minutes each on an H100 / H200
COLUMNS = {
    "flexgen": ("tokens_per_s", "predicted_tokens_per_s", "measured_over_predicted", "pcie_bound_tokens_per_s",
                "fraction_of_bound", "h2d_bytes", "run_s"),
    "zero": ("batch", "decode_median_s", "achieved_GBps", "fraction_of_pinned", "hidden", "transfer_s",
             "compute_s"),
    "moe": ("batch", "decode_median_s", "roofline_s", "fraction_of_roofline", "onehot_over_table",
            "moe_over_dense"),
}


def run(name: str, out: Path, budget_s: float, scale: str, kernels: bool = True) -> dict:
    results = Results(out, name, scale, budget_s)
    ops = CupyOps(device=0, kernels=kernels)
    RUN[name](ops, results, scale)
    return results.data


def markdown(data: dict) -> str:
    """One scenario's results as a table: a row per case, the scenario's columns (blank where a case has none)."""
    cols = COLUMNS[data["scenario"]]
    lines = [f"### {data['scenario']} ({data['scale']} scale)", ""]
    links = data.get("links") or {}
    if links:
        lines += [f"Links measured in the run: host -> device {links.get('h2d_pinned', 0) / 1e9:.1f} GB/s pinned "
                  f"({links.get('h2d_pageable', 0) / 1e9:.1f} pageable), device -> host "
                  f"{links.get('d2h_pinned', 0) / 1e9:.1f} GB/s, device copy {links.get('device_copy', 0) / 1e9:.0f}"
                  f" GB/s.", ""]
    if data.get("policy"):
        lines += [f"LP policy: {json.dumps(data['policy'])}", ""]
    lines += ["| case | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for case, figures in data.get("cases", {}).items():
        cells = [figures.get("error", "") if c == cols[0] and "error" in figures else _cell(figures.get(c))
                 for c in cols]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    for case, why in data.get("skipped", {}).items():
        lines.append(f"| {case} | skipped: {why} |" + " |" * (len(cols) - 1))
    return "\n".join(lines) + "\n"


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu.scenarios", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", nargs="?", choices=sorted(RUN))
    p.add_argument("--out", help="the results file (JSON)")
    p.add_argument("--budget", type=float, help="seconds for the scenario (default: its own, under 3 minutes)")
    p.add_argument("--scale", choices=("full", "tiny"), help="full: the papers' shapes; tiny: the rehearsal's "
                                                             "(default: tiny on the CPU stand-in of cupy)")
    p.add_argument("--kernels", choices=("on", "off"), default="on", help="the cuda_src/ kernels (off: plain CuPy)")
    p.add_argument("--report", nargs="+", metavar="FILE", help="print the markdown tables of these result files")
    args = p.parse_args(argv)
    if args.report:
        print("\n".join(markdown(json.loads(Path(f).read_text())) for f in args.report))
        return 0
    if not args.scenario or not args.out:
        p.error("a scenario and --out are needed (or --report FILE...)")
    import cupy

    scale = args.scale or ("tiny" if getattr(cupy, "_emulated", False) else "full")
    data = run(args.scenario, Path(args.out), args.budget or BUDGET_S[args.scenario], scale, args.kernels == "on")
    print(markdown(data), flush=True)
    return int(any("error" in c for c in data["cases"].values()))


if __name__ == "__main__":
    sys.exit(main())
