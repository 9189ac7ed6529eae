"""python -m bench.abab: is this checkout slower than an earlier commit on the CPU? (issue 30's "no CPU slowdown")

The same `hpcinfer run` jobs, on this checkout (B) and on a git worktree of `--baseline` (A), taken in turns,
A B A B ..., so that the machine's drift hits both alike. Each side runs its own package: the worktree's
`python -m hpcinfer` imports the worktree's code (its directory comes first on sys.path) with this venv's
libraries, and compiles its own Numba kernels into its own caches (an untimed warm-up run per side first).

Cases, on SmolLM2 float32 and the chat workload (inputs/cpu-chat.jsonl, bench/chat_cpu.py), greedy, at most 160 new
tokens, each side's default schedule (and `[runtime] cpu_kernels` when --cpu-kernels is given: numpy times the
schedule and the NumPy reference ops alone, apart from the compiled kernels either side has):
  chat8     all 64 prompts, batch_size 8 (the chat benchmark's hpcinfer cell)
  decode1   the first 4 prompts, batch_size 1
  decode16  the first 16 prompts, batch_size 16
Reported per case: each round's tokens/s, the medians, B / A, and whether both generated the same tokens.

    python -m bench.abab --baseline REV [--cases chat8,decode1,decode16] [--rounds 2] [--cpu-kernels numpy]

Writes bench/results/abab-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path

from hpcinfer.bench.common import git_commit, logger, machine_info, median
from hpcinfer.bench.suites.cells import run_job, toml_text
from .chat_workload import CHECKPOINT
from .results import write_results

PROMPTS = Path("inputs/cpu-chat.jsonl")
CASES = {"chat8": (64, 8), "decode1": (4, 1), "decode16": (16, 16)}      # name -> (prompts, batch_size)
WARM_UP = (2, 2)      # an untimed run per side first: Numba compiles per argument type, not per shape
MAX_NEW = 160
JOB_TIMEOUT_S = 1800
log = logger("bench.abab")


def worktree(rev: str, root: Path) -> Path:
    """A detached git worktree of `rev` under root (made once, reused)."""
    tree = root / subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True,
                                 check=True).stdout.strip()
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True)
    return tree


def run_case(tree: Path, case: str, work: Path, tag: str, cpu_kernels: str | None = None) -> dict:
    """One `hpcinfer run` of `case` with the code of `tree`: tokens/s and the generated ids per prompt."""
    count, batch = CASES.get(case, WARM_UP)
    prompts = work / f"{case}.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:count]))
    out = work / f"{case}-{tag}.jsonl"
    for stale in (out, Path(f"{out}.metrics.json"), Path(f"{out}.state.json")):   # else an earlier run's is resumed
        stale.unlink(missing_ok=True)
    config = out.with_suffix(".toml")
    runtime = {"backend": "numpy", "threads": os.cpu_count() or 1}
    runtime.update({"cpu_kernels": cpu_kernels} if cpu_kernels else {})
    config.write_text(toml_text({
        "model": {"checkpoint": str(CHECKPOINT.resolve()), "dtype": "float32"},
        "generate": {"prompts": str(prompts.resolve()), "output": str(out.resolve()),
                     "metrics": f"{out.resolve()}.metrics.json", "max_new_tokens": MAX_NEW, "batch_size": batch,
                     "temperature": 0.0},
        "runtime": runtime}))
    argv = ["bash", "-c", f'cd "{tree}" && exec "{sys.executable}" -m hpcinfer run "{config.resolve()}"']
    code, output = run_job(argv, JOB_TIMEOUT_S, out.with_suffix(".log"))
    if code != 0:
        raise SystemExit(f"bench.abab: {case} on {tree} failed:\n{output[-3000:]}")
    metrics = json.loads(Path(f"{out}.metrics.json").read_text())
    return {"tokens_per_s": metrics["tokens_per_s"],
            "outputs": [json.loads(line)["output_tokens"] for line in out.read_text().splitlines()]}


def compare(trees: dict, cases: list, rounds: int, work: Path, cpu_kernels: str | None = None) -> list:
    for side, tree in trees.items():                                      # each side's Numba caches
        run_case(tree, "warm-up", work, side, cpu_kernels)
    rows = []
    for case in cases:
        runs = {side: [] for side in trees}
        for r in range(rounds):
            for side, tree in trees.items():
                runs[side].append(run_case(tree, case, work, f"{side}{r}", cpu_kernels))
                log(f"{case} round {r} {side}: {runs[side][-1]['tokens_per_s']:.1f} tokens/s")
        a, b = (median(x["tokens_per_s"] for x in runs[side]) for side in ("A", "B"))
        rows.append({"case": case, "prompts": CASES[case][0], "batch_size": CASES[case][1],
                     "A": [x["tokens_per_s"] for x in runs["A"]], "B": [x["tokens_per_s"] for x in runs["B"]],
                     "A_median": a, "B_median": b, "ratio": b / a,
                     "same_tokens": all(x["outputs"] == runs["A"][0]["outputs"] for x in runs["A"] + runs["B"])})
    return rows


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"# ABAB: this checkout (B) against {result['baseline']} (A), {result['date']}", "",
             f"SmolLM2-135M float32 on the NumPy backend, each side's default schedule, cpu_kernels "
             f"{result.get('cpu_kernels') or 'as each side defaults'}, greedy, up to {MAX_NEW} new "
             f"tokens; {m['cpu_model']}, {m['cpus_online']} cores; B = commit {result['commit']}. Rounds taken in "
             f"turns A B A B after an untimed warm-up per side.", "",
             "| case | prompts | batch_size | A tokens/s (rounds) | B tokens/s (rounds) | B / A (medians) "
             "| same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
        lines.append(f"| {r['case']} | {r['prompts']} | {r['batch_size']} | {fmt(r['A'])} | {fmt(r['B'])} | "
                     f"{r['ratio']:.3f} | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.abab", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the git revision to compare against (A)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpu-kernels", choices=("numba", "numpy"), help="[runtime] cpu_kernels on both sides")
    p.add_argument("--work", default="out/abab")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown or args.rounds < 1:
        p.error(f"--cases: choose from {', '.join(CASES)}; --rounds >= 1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trees = {"A": worktree(args.baseline, work.resolve()), "B": Path.cwd()}
    result = {"date": _dt.date.today().isoformat(), "baseline": args.baseline, "commit": git_commit(),
              "cpu_kernels": args.cpu_kernels, "machine": machine_info(),
              "rows": compare(trees, cases, args.rounds, work, args.cpu_kernels)}
    name = "abab" + (f"-{args.cpu_kernels}" if args.cpu_kernels else "")
    write_results(args.out, name, result, report(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
