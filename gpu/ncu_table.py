"""python -m gpu.ncu_table NCU.csv [--layers N]: where a profiled stretch of decode spends its GPU time.

Reads the CSV that `ncu --metrics gpu__time_duration.sum --csv --log-file NCU.csv ...` writes (one row per kernel
launch) and prints a markdown table per kernel and launch shape (grid, block): launches, total and mean
microseconds, share of the total; with --layers, the mean per layer too (launches of the profiled stretch divided
by the number of layers it covered). docs/gpu.md, "Where a decode step goes".
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernel_times(path: str) -> dict:
    """{(kernel, grid, block): [microseconds of each launch]} of gpu__time_duration rows."""
    times = collections.defaultdict(list)
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]
    header, body = rows[0], rows[1:]
    col = {name: header.index(name) for name in ("Kernel Name", "Grid Size", "Block Size", "Metric Name",
                                                  "Metric Unit", "Metric Value")}
    for r in body:
        if r[col["Metric Name"]] != "gpu__time_duration.sum":
            continue
        value = float(r[col["Metric Value"]].replace(",", "")) * UNIT_US[r[col["Metric Unit"]]]
        times[(r[col["Kernel Name"]].split("(")[0], r[col["Grid Size"]], r[col["Block Size"]])].append(value)
    return times


def table(times: dict, layers: float | None = None) -> str:
    total = sum(sum(v) for v in times.values())
    lines = [f"{sum(len(v) for v in times.values())} launches, {total:.1f} us", "",
             "| kernel | grid | block | launches | total us | mean us | share |" + (" us per layer |" if layers else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if layers else "")]
    for (name, grid, block), v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {grid} | {block} | {len(v)} | {sum(v):.1f} | {sum(v) / len(v):.2f} | "
                     f"{100 * sum(v) / total:.1f}% |" + (f" {sum(v) / layers:.2f} |" if layers else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu.ncu_table", description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--layers", type=float, default=None, help="layers the profiled stretch covered")
    args = p.parse_args(argv)
    print(table(kernel_times(args.csv), args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
