"""Pipeline benchmark: pp=2 with equal micro-batch counts against hybrid counts (DeepSpeed Inference Fig. 3), with
the pp=1 single-rank baseline and dp=2 for reference, on SmolLM2 (float32) and the same prompts, all in one run,
in alternating rounds, through the real CLI (`mpiexec -n N python -m hpcinfer run CONFIG --set ...`). Its question
is the static schedule's (DeepSpeed's prompt and token micro-batch counts, which continuous batching does not have:
its pipeline forms micro-batches from the running set at every step), so every layout runs with
`[schedule] batching = "static"`, named. See docs/bench-scripts.md.

    python -m bench.pipeline --checkpoint models/smollm2.h5 --out bench/results --repeats 3

Writes bench/results/pipeline-<YYYY-MM-DD>.json (machine, versions, settings, every run's metrics, medians, ratios,
checks) and bench/results/pipeline-<YYYY-MM-DD>.md (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcinfer import __version__
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.generate.tokenizer import TextTokenizer
from hpcinfer.bench.common import (BUSY_WARN_CPUS, ChildCpuMeter, agreement, busy_warning, git_commit, loadavg, logger,
                                   machine_info, make_prompts, median, wait_quiet)

from . import REPO
from .results import write_results

RUN_TIMEOUT_S = 300        # MPIEXEC_TIMEOUT of one run: a backstop against a hung job
log = logger("bench.pipeline")


# ---- what is compared ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    name: str
    role: str                  # "baseline" | "equal" (the default 2/2) | "hybrid" | "equal-more" | "reference"
    ranks: int
    pp: int
    prompt_mb: int             # micro-batches of the prompt phase (what [schedule] resolves to)
    gen_mb: int                # micro-batches of the token phase
    batch_size: int            # [generate] batch_size: prompts per batch on each data-parallel replica

    def overrides(self) -> list[str]:
        sets = [f"parallel.pp={self.pp}", f"generate.batch_size={self.batch_size}", 'schedule.batching="static"']
        if self.pp > 1:
            sets += [f"schedule.prompt_micro_batches={self.prompt_mb}",
                     f"schedule.gen_micro_batches={self.gen_mb}"]
        return sets


def layouts(args) -> list[Layout]:
    out = [Layout("pp=1 (1 rank)", "baseline", 1, 1, 1, 1, args.batch),
           Layout("pp=2 equal 2/2", "equal", 2, 2, 2, 2, args.batch)]
    for m in args.hybrid:
        out.append(Layout(f"pp=2 hybrid {m}/{args.gen_micro_batches}", "hybrid", 2, 2, m, args.gen_micro_batches,
                          args.batch))
    for m in args.equal_more:
        # Equal counts, but more of them: the prompt phase's bubble shrinks as with hybrid, while every token step
        # now runs in m smaller micro-batches (each re-reads the stage's weights): what hybrid avoids.
        out.append(Layout(f"pp=2 equal {m}/{m}", "equal-more", 2, 2, m, m, args.batch))
    if not args.no_dp:
        # Batch b goes to replica b mod dp: two batches of batch/2, so each replica gets half the same prompts.
        out.append(Layout("dp=2 pp=1 (2 ranks)", "reference", 2, 1, 1, 1, max(1, args.batch // 2)))
    return out


# ---- one run of the CLI ----------------------------------------------------------------------------------------

class Runner:
    def __init__(self, args, workdir: Path):
        self.args, self.workdir = args, workdir
        self.count = 0

    def write_config(self, prompts_path: Path, new_tokens: int) -> Path:
        path = self.workdir / f"job-{new_tokens}.toml"
        path.write_text("\n".join([
            "[model]", f"checkpoint = {json.dumps(str(Path(self.args.checkpoint).resolve()))}", 'dtype = "float32"',
            "", "[parallel]", "tp = 1", "pp = 1",
            "", "[runtime]", 'backend = "numpy"',
            "", "[generate]", f"prompts = {json.dumps(str(prompts_path))}",
            f"output = {json.dumps(str(self.workdir / 'out.jsonl'))}",
            f"max_new_tokens = {new_tokens}", f"batch_size = {self.args.batch}", "temperature = 0.0",
            "ignore_eos = true", f"metrics = {json.dumps(str(self.workdir / 'metrics.json'))}", ""]))
        return path

    def run(self, layout: Layout, config: Path) -> dict:
        """One job; returns its metrics JSON, its output tokens (by prompt id) and the wall time of the command."""
        self.count += 1
        tag = f"run{self.count:03d}"
        output, metrics = self.workdir / f"{tag}.jsonl", self.workdir / f"{tag}.metrics.json"
        cmd = [self.args.mpiexec, "-n", str(layout.ranks), self.args.python, "-m", "hpcinfer", "run", str(config)]
        for s in layout.overrides() + [f"generate.output={output}", f"generate.metrics={metrics}"]:
            cmd += ["--set", s]
        env = {**os.environ, "MPIEXEC_TIMEOUT": str(RUN_TIMEOUT_S)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30)
        wall = time.perf_counter() - t0
        (self.workdir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not metrics.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise SystemExit(f"bench.pipeline: {layout.name} failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n"
                             f"{tail}")
        m = json.loads(metrics.read_text())
        tokens = {}
        for line in output.read_text().splitlines():
            rec = json.loads(line)
            tokens[rec["id"]] = rec["output_tokens"]
        return {"metrics": m, "tokens": tokens, "wall_s": wall}


def sample_of(m: dict, wall_s: float, cpu: dict | None) -> dict:
    """The figures of one run, from its metrics JSON (hpcinfer/metrics.py)."""
    pipe = m["pipeline"]
    return {"wall_s": wall_s, "load_s": m["load_s"], "total_s": m["total_s"], "generate_s": m["generate_s"],
            "prompt_phase_s": pipe["prompt_phase_s"], "gen_phase_s": pipe["gen_phase_s"],
            "decode_step_ms": m["decode_step_ms"]["median"], "decode_step_p90_ms": m["decode_step_ms"]["p90"],
            "decode_steps": m["decode_steps"], "generated_tokens": m["generated_tokens"],
            "prompt_tokens": m["prompt_tokens"], "tokens_per_s": m["tokens_per_s"],
            "bubble_fraction": pipe["bubble_fraction"],
            "stages": [{k: s[k] for k in ("stage", "busy_s", "wait_s", "bubble_fraction")} for s in pipe["stages"]],
            "threads_per_rank": m["mesh"]["threads_per_rank"],
            "mesh": {k: m["mesh"][k] for k in ("world", "pp", "dp", "tp")},
            "cpu": cpu}


# ---- summary ---------------------------------------------------------------------------------------------------

FIGURES = ("prompt_phase_s", "gen_phase_s", "decode_step_ms", "tokens_per_s", "generate_s", "bubble_fraction",
           "wall_s", "load_s")


def summarize_layout(samples: list) -> dict:
    out = {k: median(s[k] for s in samples) for k in FIGURES}
    stages = len(samples[0]["stages"])
    out["stages"] = [{k: median(s["stages"][i][k] for s in samples) for k in ("busy_s", "wait_s", "bubble_fraction")}
                     for i in range(stages)]
    out["other_cpus_max"] = max((s["cpu"] or {}).get("other_cpus", 0.0) for s in samples)
    return out


def ideal_prompt_phase(lay: Layout) -> float:
    """Prompt phase of P balanced stages and M equal micro-batches, as a fraction of one stage doing all of it
    alone: (M + P - 1) steps of 1/(M P) each (the fill-and-drain bubble is P - 1 steps)."""
    return (lay.prompt_mb + lay.pp - 1) / (lay.prompt_mb * lay.pp)


def ratios(raw: dict, lays: list, ref: Layout) -> dict:
    """Per layout: reference / layout for times (> 1: the layout is faster), layout / reference for tokens/s; the
    median over rounds of the paired per-round ratio."""
    out = {}
    for lay in lays:
        if lay.name == ref.name:
            continue
        pairs = list(zip(raw[ref.name], raw[lay.name]))
        out[lay.name] = {
            "prompt_phase_speedup": median(r["prompt_phase_s"] / x["prompt_phase_s"] for r, x in pairs),
            "gen_phase_speedup": median(r["gen_phase_s"] / x["gen_phase_s"] for r, x in pairs),
            "decode_step_speedup": median(r["decode_step_ms"] / x["decode_step_ms"] for r, x in pairs),
            "throughput_ratio": median(x["tokens_per_s"] / r["tokens_per_s"] for r, x in pairs),
            "prompt_phase_speedup_per_round": [r["prompt_phase_s"] / x["prompt_phase_s"] for r, x in pairs],
            "prompt_phase_speedup_ideal": ideal_prompt_phase(ref) / ideal_prompt_phase(lay) if ref.pp == lay.pp
            else None,
        }
    return out


def markdown(result: dict) -> str:
    s, mach = result["settings"], result["machine"]
    lines = [f"# Pipeline benchmark {result['date']}", "",
             f"SmolLM2-135M-Instruct float32 ({result['model']['layers']} layers), {s['batch']} prompts × "
             f"{s['prompt_len']} tokens of real text (one batch), {s['new_tokens']} new tokens each (greedy, EOS "
             f"ignored), through `mpiexec -n N python -m hpcinfer run`. {s['repeats']} round(s), configurations "
             f"alternated (round-robin, start rotated per round); medians over rounds. Machine: {mach['cpu_model']}, "
             f"{mach['cpus_usable']} usable CPU(s): with 2 ranks each rank gets 1 core and 1 BLAS thread, the "
             f"single rank 2. Commit: {result['software']['git_commit']}.", "",
             "| configuration | ranks | micro-batches prompt / gen | prompt phase (s) | gen phase (s) | "
             "per-token latency (ms) | throughput (tokens/s) | bubble mean | bubble per stage | busy per stage (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lay in result["layouts"]:
        med = result["medians"][lay["name"]]
        per_stage = " / ".join(f"{100 * st['bubble_fraction']:.0f}%" for st in med["stages"])
        busy = " / ".join(f"{st['busy_s']:.1f}" for st in med["stages"])
        mb = f"{lay['prompt_mb']} / {lay['gen_mb']}" if lay["pp"] > 1 else "–"
        lines.append(f"| {lay['name']} | {lay['ranks']} | {mb} | {med['prompt_phase_s']:.2f} | "
                     f"{med['gen_phase_s']:.2f} | {med['decode_step_ms']:.0f} | {med['tokens_per_s']:.1f} | "
                     f"{100 * med['bubble_fraction']:.0f}% | {per_stage} | {busy} |")
    eq = result["vs_equal"]
    if eq:
        lines += ["", "Against pp=2 equal 2/2 (median of per-round ratios; > 1: better than equal):", "",
                  "| configuration | prompt phase speedup | ideal | gen phase speedup | per-token latency speedup | "
                  "throughput ratio |", "|---|---:|---:|---:|---:|---:|"]
        for name, r in eq.items():
            lines.append(f"| {name} | {r['prompt_phase_speedup']:.2f}× | {r['prompt_phase_speedup_ideal']:.2f}× | "
                         f"{r['gen_phase_speedup']:.2f}× | {r['decode_step_speedup']:.2f}× | "
                         f"{r['throughput_ratio']:.2f}× |")
        lines += ["", "ideal = prompt-phase speedup of a pipeline with P balanced stages, equal micro-batches and "
                      "no per-micro-batch cost: (M + P − 1) / (M·P) of one stage's work, i.e. a fill-and-drain "
                      "bubble of P − 1 micro-batch steps."]
    checks = result["checks"]["tokens_vs_baseline"]
    agree = ", ".join(f"{name} {c['min']}/{c['length']}" for name, c in checks.items())
    busy = {lay["name"]: [((x["cpu"] or {}).get("other_cpus")) for x in result["raw"][lay["name"]]]
            for lay in result["layouts"]}
    lines += ["",
              "prompt phase = batch start until the last prompt micro-batch left the last stage (`prefill_s`); gen "
              "phase = the rest of the batch; per-token latency = median time from sending a micro-batch into the "
              "pipeline to its sampled tokens coming back to stage 0 (`decode_step_ms`; with pipelining a round "
              "trip through every stage, i.e. the time between two tokens of one sequence); throughput = "
              "generated tokens / generate_s (prompt phase included); bubble = time a stage waited for another "
              "stage / generate_s (mean over stages; stage 0 also waits for the sampled tokens to come back)."
              + (f" dp=2 runs two replicas of batch {s['batch'] // 2} (the same prompts, split)."
                 if s["dp_reference"] else ""),
              f"Greedy tokens against pp=1 (common prefix, min over sequences): {agree}.",
              f"Other processes' CPU use per run (CPUs, 0 = quiet): {busy}; "
              f"{len(result['discarded'])} disturbed run(s) run again (kept in the JSON as `discarded`). "
              f"Load average at start "
              f"{mach['loadavg_start']}, at end {mach['loadavg_end']}.",
              "Only ratios within one run count: this machine's speed drifts by 2× between runs."]
    if result.get("warnings"):
        lines += [""] + [f"**Warning:** {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


# ---- main ------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default="models/smollm2.h5", help="hpcinfer float32 checkpoint")
    p.add_argument("--out", default="bench/results", help="folder for pipeline-<date>.json and .md")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (each runs every configuration once)")
    p.add_argument("--batch", type=int, default=16, help="prompts, all in one batch ([generate] batch_size)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens (EOS ignored)")
    p.add_argument("--hybrid", type=lambda v: [int(x) for x in v.split(",") if x], default=[4, 8],
                   help="prompt micro-batch counts of the hybrid configurations (comma-separated)")
    p.add_argument("--gen-micro-batches", type=int, default=2, help="gen micro-batches of the hybrid "
                                                                     "configurations")
    p.add_argument("--equal-more", type=lambda v: [int(x) for x in v.split(",") if x], default=[4],
                   help="also pp=2 with these equal counts M/M (comma-separated; empty: none)")
    p.add_argument("--no-dp", action="store_true", help="leave out the dp=2 reference")
    p.add_argument("--quiet-wait", type=float, default=15.0,
                   help="before each run, wait up to this many seconds for other processes to use <= "
                        f"{BUSY_WARN_CPUS} CPUs")
    p.add_argument("--retries", type=int, default=1,
                   help="run a configuration again (up to this many times) when other processes used more than "
                        f"{BUSY_WARN_CPUS} CPUs during it; the discarded runs stay in the JSON")
    p.add_argument("--budget", type=float, default=330.0,
                   help="seconds after which the script stops waiting for quiet and stops retrying")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--mpiexec", default=str(REPO / ".venv/bin/mpiexec"))
    p.add_argument("--python", default=str(REPO / ".venv/bin/python"))
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (configs, outputs, logs)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.batch < 2 or args.new_tokens < 2 or args.prompt_len < 1:
        p.error("--repeats >= 1, --batch >= 2, --new-tokens >= 2, --prompt-len >= 1")
    if any(m < 1 or m > args.batch for m in args.hybrid + args.equal_more) or not 1 <= args.gen_micro_batches <= args.batch:
        p.error(f"micro-batch counts must be between 1 and --batch ({args.batch})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    started = _dt.datetime.now().astimezone()
    load_start = loadavg()
    for path in (args.checkpoint, args.mpiexec, args.python):
        if not Path(path).exists():
            raise SystemExit(f"bench.pipeline: {path} not found (make venv; make model; python -m hpcinfer convert "
                             f"models/SmolLM2-135M-Instruct.Q4_1.gguf {args.checkpoint} --dtype float32)")

    import numpy as np

    with open_checkpoint(args.checkpoint) as ckpt:
        tokenizer = TextTokenizer.from_checkpoint(ckpt)
        arch = ckpt.arch
    if tokenizer is None:
        raise SystemExit(f"bench.pipeline: {args.checkpoint} holds no tokenizer")
    prompts = make_prompts(tokenizer, args.batch, args.prompt_len)
    lays = layouts(args)
    log(f"load average {load_start}; configurations: {[lay.name for lay in lays]}")

    workdir = Path(tempfile.mkdtemp(prefix="hpcinfer-bench-pipeline-"))
    try:
        prompts_path = workdir / "prompts.jsonl"
        prompts_path.write_text("".join(json.dumps({"id": f"p{i:02d}", "tokens": p}) + "\n"
                                        for i, p in enumerate(prompts)))
        runner = Runner(args, workdir)
        config = runner.write_config(prompts_path, args.new_tokens)

        if not args.no_warmup:
            # Fresh processes every run: the warm-up fills the page cache with the checkpoint and the venv's
            # modules; one short run per rank count.
            warm = runner.write_config(prompts_path, 2)
            for lay in {lay.ranks: lay for lay in lays if lay.role != "reference"}.values():
                log(f"warm-up: {lay.name}")
                runner.run(lay, warm)

        meter = ChildCpuMeter()
        raw = {lay.name: [] for lay in lays}
        discarded = []
        tokens = {}
        order_log = []
        for r in range(args.repeats):
            order = lays[r % len(lays):] + lays[:r % len(lays)]
            order_log.append([lay.name for lay in order])
            for lay in order:
                for attempt in range(1 + args.retries):
                    in_budget = time.perf_counter() - t_start < args.budget
                    before = wait_quiet(args.quiet_wait if in_budget else 0.0)
                    meter.lap()
                    res = runner.run(lay, config)
                    cpu = meter.lap()
                    sample = sample_of(res["metrics"], res["wall_s"], cpu)
                    sample.update({"round": r, "attempt": attempt, "other_cpus_before": before})
                    other = (cpu or {}).get("other_cpus", 0.0)
                    if other <= BUSY_WARN_CPUS or attempt == args.retries or \
                            time.perf_counter() - t_start >= args.budget:
                        break
                    discarded.append(sample | {"config": lay.name})
                    log(f"round {r + 1} {lay.name}: other processes used {other} CPUs meanwhile; run again")
                raw[lay.name].append(sample)
                tokens.setdefault(lay.name, []).append(res["tokens"])
                log(f"round {r + 1}/{args.repeats} {lay.name}: prompt {sample['prompt_phase_s']:.2f} s, gen "
                    f"{sample['gen_phase_s']:.2f} s, step {sample['decode_step_ms']:.0f} ms, "
                    f"{sample['tokens_per_s']:.1f} tok/s, bubble {100 * sample['bubble_fraction']:.0f}%; other "
                    f"processes {(cpu or {}).get('other_cpus')} CPUs; {time.perf_counter() - t_start:.0f} s elapsed")
    finally:
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    medians = {lay.name: summarize_layout(raw[lay.name]) for lay in lays}
    equal = next(lay for lay in lays if lay.role == "equal")
    baseline = next(lay for lay in lays if lay.role == "baseline")
    ids = sorted(tokens[baseline.name][0])
    base_tokens = [tokens[baseline.name][0][i] for i in ids]
    checks = {lay.name: agreement(base_tokens, [tokens[lay.name][-1][i] for i in ids])
              for lay in lays if lay.name != baseline.name}
    stable = {lay.name: all(t == tokens[lay.name][0] for t in tokens[lay.name]) for lay in lays}
    warnings = []
    busy = [(x["cpu"] or {}).get("other_cpus", 0.0) for lay in lays for x in raw[lay.name]]
    warnings += busy_warning(busy, "a run (per run in the JSON: raw[...].cpu.other_cpus)")
    bad = [name for name, c in checks.items() if c["min"] < c["length"] // 2]
    if bad:
        warnings.append(f"greedy tokens of {bad} diverge from pp=1 early: not the same computation")

    result = {
        "schema": "hpcinfer-bench-pipeline/1",
        "date": started.date().isoformat(),
        "timestamp": started.isoformat(timespec="seconds"),
        "elapsed_s": None,
        "machine": {**machine_info(), "loadavg_start": load_start, "loadavg_end": None,
                    "_cpu_use": "per run (raw[config][i].cpu): own_cpus = this process and its mpiexec job, "
                                "other_cpus = every other process (0 = a quiet machine), steal_cpus = taken by the "
                                "hypervisor; in CPUs. Waiting MPI ranks busy-poll, so own_cpus ~ ranks"},
        "software": {"numpy": np.__version__, "hpcinfer": __version__,
                     "git_commit": git_commit(), "mpiexec": args.mpiexec, "python": args.python},
        "settings": {"repeats": args.repeats, "batch": args.batch, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "hybrid_prompt_micro_batches": args.hybrid,
                     "hybrid_gen_micro_batches": args.gen_micro_batches, "dp_reference": not args.no_dp,
                     "equal_more_micro_batches": args.equal_more, "quiet_wait_s": args.quiet_wait,
                     "retries": args.retries, "budget_s": args.budget, "busy_threshold_cpus": BUSY_WARN_CPUS,
                     "warmup": not args.no_warmup, "order_per_round": order_log,
                     "command": f"{args.mpiexec} -n N {args.python} -m hpcinfer run CONFIG --set parallel.pp=... "
                                f"--set schedule.prompt_micro_batches=... --set schedule.gen_micro_batches=... "
                                f"--set generate.batch_size=...",
                     "prompts": f"{args.batch} consecutive {args.prompt_len}-token slices of pydoc_data/topics.py, "
                                f"tokenized by the checkpoint's tokenizer without special tokens "
                                f"(bench.cpu)",
                     "threads": "runtime.threads = 0: usable cores / ranks on the node (BLAS threads per rank)"},
        "model": {"checkpoint": args.checkpoint, "family": arch.family, "layers": arch.num_layers,
                  "parameters": arch.param_count()},
        "layouts": [asdict(lay) for lay in lays],
        "raw": raw,
        "discarded": discarded,
        "medians": medians,
        "vs_equal": ratios(raw, [lay for lay in lays if lay.pp > 1], equal),
        "vs_baseline": ratios(raw, lays, baseline),
        "checks": {"tokens_vs_baseline": checks, "tokens_identical_across_rounds": stable},
        "warnings": warnings,
    }
    result["machine"]["loadavg_end"] = loadavg()
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)

    write_results(args.out, "pipeline", result, markdown(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
