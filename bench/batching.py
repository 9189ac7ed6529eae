"""python -m bench.batching: continuous against static batching on a realistic job (issue 21).

The workload (written once and kept: inputs/batching-chat.jsonl, `--make-prompts`): chat questions about excerpts
of the standard library's pydoc_data/topics.py, the excerpt lengths drawn log-uniformly so that the prompts span
about 16 to 1,024 tokens, SmolLM2's chat template applied by `hpcinfer run` ("chat": true), answers stopping at
EOS or `max_new_tokens` (256). For each dp (1, 2 ranks), `hpcinfer run` runs the whole set with
`[schedule] batching = "static"`, then `"continuous"` with `kv_cache_memory` set to the static run's peak KV bytes
per rank (the same KV memory); then transformers' batched `generate` (greedy, left padding, batches of
batch_size) on the same token ids. Reported: generated tokens/s of each, continuous / static, occupancy, p50/p99
time between tokens, preemptions, the replicas' imbalance at dp = 2, whether the continuous and static files are
identical, and the machine. Writes bench/results/batching-<date>.json and .md.

    python -m bench.batching [--prompts N] [--max-new 256] [--batch 16] [--dp 1,2] [--no-hf]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
from pathlib import Path

from .chat_workload import CHECKPOINT, GGUF, QUESTIONS, hpcinfer_run, prompt_ids, run_transformers
from .chat_workload import make_prompts as make_chat_prompts
from hpcinfer.bench.common import git_commit, logger, machine_info
from .results import write_results

PROMPTS = Path("inputs/batching-chat.jsonl")
JOB_TIMEOUT_S = 3600            # one hpcinfer run of the whole set (about 8 minutes at the defaults here)
log = logger("bench.batching")


def make_prompts(count: int = 288, seed: int = 21) -> list[dict]:
    """`count` chat prompts with excerpts of 10 to 760 words (about 16 to 1,024 tokens with the template)."""
    return make_chat_prompts(count, seed, (10, 760))


def cell(metrics: dict) -> dict:
    b = metrics["batching"]
    return {"tokens_per_s": metrics["tokens_per_s"], "generated_tokens": metrics["generated_tokens"],
            "generate_s": metrics["generate_s"], "occupancy": b["occupancy"], "preemptions": b["preemptions"],
            "token_latency_s": b["token_latency_s"], "time_to_first_token_s": b["time_to_first_token_s"],
            "replica_imbalance": b["replica_imbalance"], "kv_peak_bytes_per_rank":
            metrics["kv_cache"]["peak_device_bytes_per_rank"], "kv_pool_blocks": b["kv_pool_blocks"]}


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def report(result: dict) -> str:
    s, rows = result["settings"], result["runs"]
    lines = [f"# Continuous against static batching, {result['date']}", "",
             f"SmolLM2-135M float32, numpy backend, {s['prompts']} chat prompts from pydoc_data/topics.py (prompt "
             f"lengths {s['prompt_tokens']['min']} to {s['prompt_tokens']['max']} tokens, median "
             f"{s['prompt_tokens']['median']}), max_new_tokens {s['max_new']}, EOS stops, batch_size {s['batch']}; "
             f"{result['machine'].get('cpu_model')}, {result['machine'].get('cpus_usable')} cores; commit "
             f"{result['commit']}.", "",
             "| run | tokens/s | vs static (same dp; transformers: dp=1) | occupancy | p50 / p99 s between tokens "
             "| preemptions | imbalance |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        same_dp = name.replace("continuous", "static") if name.startswith(("static", "continuous")) else "static dp=1"
        base = rows.get(same_dp, {}).get("tokens_per_s")
        lat = r.get("token_latency_s") or {}
        cells = [name, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x" if base else "",
                 _fmt(r.get("occupancy"), ".2f"),
                 f"{lat['p50']:.3f} / {lat['p99']:.3f}" if lat.get("p50") is not None else "",
                 str(r.get("preemptions", "")), _fmt(r.get("replica_imbalance"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {k}: {v}" for k, v in result["checks"].items()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batching", description=__doc__.split("\n\n")[0])
    p.add_argument("--make-prompts", action="store_true", help=f"(re)write {PROMPTS} and stop")
    p.add_argument("--prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dp", default="1,2", help="comma-separated replica counts")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.make_prompts:
        PROMPTS.write_text("".join(json.dumps(x) + "\n" for x in make_prompts()))
        log(f"wrote {PROMPTS}")
        return 0
    for path in (CHECKPOINT, PROMPTS) + (() if args.no_hf else (GGUF,)):
        if not path.exists():
            raise SystemExit(f"bench.batching: {path} not found (make demo; --make-prompts)")
    work = Path(tempfile.mkdtemp(prefix="hpcinfer-batching-"))
    prompts = work / "prompts.jsonl"
    lines = PROMPTS.read_text().splitlines()[:args.prompts]
    prompts.write_text("\n".join(lines) + "\n")
    ids, eos = prompt_ids(prompts)
    lengths = sorted(len(x) for x in ids)
    started = _dt.datetime.now().astimezone()
    result = {"schema": "hpcinfer-bench-batching/1", "date": started.date().isoformat(), "commit": git_commit(),
              "machine": machine_info(), "settings": {"prompts": len(ids), "max_new": args.max_new, "batch":
              args.batch, "prompt_tokens": {"min": lengths[0], "max": lengths[-1],
                                            "median": lengths[len(lengths) // 2]}}, "runs": {}, "checks": {}}
    for dp in (int(x) for x in args.dp.split(",")):
        outs = {}
        for mode in ("static", "continuous"):
            name = f"{mode} dp={dp}"
            outs[mode] = work / f"{mode}-dp{dp}.jsonl"
            schedule = {"batching": mode}
            if mode == "continuous":                # the static run's KV memory per rank
                schedule["kv_cache_memory"] = int(result["runs"][f"static dp={dp}"]["kv_peak_bytes_per_rank"])
            log(f"{name}: {len(ids)} prompts")
            result["runs"][name] = cell(hpcinfer_run(prompts, outs[mode], dp, args.batch, args.max_new, schedule,
                                                     JOB_TIMEOUT_S))
            log(f"{name}: {result['runs'][name]['tokens_per_s']:.1f} tokens/s")
        result["checks"][f"dp={dp}: continuous file == static file"] = \
            outs["continuous"].read_bytes() == outs["static"].read_bytes()
    if not args.no_hf:
        log("transformers generate")
        hf = run_transformers(ids, eos, args.batch, args.max_new, os.cpu_count() or 1)
        hf.pop("outputs")
        result["runs"]["transformers generate"] = hf
    write_results(args.out, "batching", result, report(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
