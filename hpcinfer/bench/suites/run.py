"""`hpcinfer bench CONFIG.toml`: run the configured suites cell by cell in alternating rounds, the transformers
baseline in this process, and write bench/results/bench-<date>.json, the markdown report and its plots."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ... import __version__
from ..common import ChildCpuMeter, agreement, busy_warning, git_commit, loadavg, logger, machine_info, \
    usable_cores, wait_quiet
from ..hf_baseline import Transformers, device_name, pick_device
from . import figures as fig
from .cells import run_cell
from .config import SUITES, BenchConfig, resolve_backend
from .plan import CUDA_GRAPHS, NO_GRAPHS_CPU, graphs_skip, is_moe, model_arch, plan_cells, suite_prompts, \
    write_prompts
from .schema import CURRENT

log = logger("hpcinfer bench")


class SuiteRun:
    """One suite's cells, prompts and samples while the rounds run."""

    def __init__(self, cfg: BenchConfig, suite, workdir: Path, backend: str = "numpy"):
        self.suite, self.arch, self.backend = suite, model_arch(suite), backend      # backend: resolved
        limit = self.arch.max_positions
        self.skip = "" if suite.prompt_len + suite.new_tokens <= limit else \
            f"prompt_len + new_tokens = {suite.prompt_len + suite.new_tokens} is above the model's {limit} positions"
        self.cells = [] if self.skip else plan_cells(cfg, suite, self.arch, backend)
        self.prompts = [] if self.skip else suite_prompts(suite, self.arch)
        self.files = {b: write_prompts(self.prompts[:b], workdir / f"{suite.name}-b{b}.jsonl")
                      for b in suite.batches if not self.skip}
        self.runs = {c.key: [] for c in self.cells}          # per cell: figures of every round
        self.outcome = {}                                    # per cell: the last job's outcome
        self.tokens = {}                                     # per cell: the generated tokens (of a run that ran)
        self.hf = {}                                         # batch -> [figures per round]
        self.hf_tokens = {}
        self.hf_device = ("", "")                            # (results' device, note when not hpcinfer's kind)


def run_rounds(cfg: BenchConfig, runs: list[SuiteRun], workdir: Path, machine_GBps: float, t_start: float):
    cells = [(r, c) for r in runs for c in r.cells if not c.skip]
    hf_models = {}                                           # hf_source -> the loaded transformers model
    count = 0
    for rnd in range(cfg.repeats):
        shift = rnd % max(1, len(cells))
        for run, cell in cells[shift:] + cells[:shift]:
            if run.outcome.get(cell.key, {}).get("status") in ("rejected", "failed"):
                continue                                     # set-up errors repeat: do not rerun them
            smaller = rejected_smaller(run, cell)
            if smaller:
                run.outcome[cell.key] = {"status": "rejected", "error": smaller}
                continue
            before = wait_quiet(cfg.quiet_wait_s)
            meter = ChildCpuMeter()
            count += 1
            res = run_cell(cell, run.files[cell.batch], workdir, f"cell{count:04d}", cfg)
            cpu = meter.lap()
            run.outcome[cell.key] = res
            if res["status"] != "ok":
                log(f"{cell.key}: {res['status']}: {res['error']}")
                continue
            ranks_on_node = cell.layout.ranks_per_node or cell.layout.ranks
            device_total = offload_device_total(run, cell, workdir / f"cell{count:04d}.toml")
            sample = fig.from_metrics(res["metrics"], ranks_on_node, machine_GBps, device_total, cell.backend)
            sample.update(round=rnd, wall_s=res["wall_s"], cpu=cpu, other_cpus_before=before["other_cpus"])
            run.runs[cell.key].append(sample)
            run.tokens[cell.key] = res["tokens"]
            log(f"round {rnd + 1}/{cfg.repeats} {cell.key}: prompt {sample['prompt_latency_ms']:.0f} ms, token "
                f"{sample['per_token_ms_median']:.1f} ms, {sample['tokens_per_s']:.1f} tokens/s; other processes "
                f"{(cpu or {}).get('other_cpus')} CPUs; {time.perf_counter() - t_start:.0f} s elapsed")
        for run in runs:
            hf_round(cfg, run, rnd, hf_models)


def offload_device_total(run: SuiteRun, cell, config_path: Path) -> int | None:
    """An offload cell's bytes on the device per rank, as its budget check counts them (None otherwise)."""
    if not run.suite.offload:
        return None
    return fig.offload_device_bytes(str(config_path), [len(p) for p in run.prompts[:cell.batch]])


def rejected_smaller(run: SuiteRun, cell) -> str:
    """Offload suite: a batch above one the budgets rejected needs more memory still, so it is not run."""
    if not run.suite.offload:
        return ""
    for other in run.cells:
        if other.layout == cell.layout and other.variant == cell.variant and other.batch < cell.batch and \
                run.outcome.get(other.key, {}).get("status") == "rejected":
            return f"not run: batch {other.batch} was already rejected by the offload budgets"
    return ""


def hf_applicability(run: SuiteRun) -> str:
    """Why the transformers baseline does not apply to this suite ("" = it does)."""
    s = run.suite
    if not s.hf_baseline:
        return "turned off in the bench config (hf_baseline = false)"
    if s.offload:
        return "transformers keeps every weight in memory: not FlexGen's offload setting"
    if s.model.preset is not None:
        return "preset weights are random and made by hpcinfer: transformers has no copy of them"
    if s.model.hf_source is None:
        return "no [model] hf_source (the GGUF file or Hugging Face folder the checkpoint was converted from)"
    if run.skip:
        return run.skip
    return ""


def hf_round(cfg: BenchConfig, run: SuiteRun, rnd: int, models: dict) -> None:
    """One round of the transformers baseline at every batch of the suite, in this process."""
    if hf_applicability(run):
        return
    import torch                        # lazy: the baseline's heavy optional dependency (the `test` extra)

    source = run.suite.model.hf_source
    device, note = pick_device(run.backend, torch)
    if (source, device) not in models:
        log(f"transformers baseline: loading {source} on {device}" + (f" ({note})" if note else ""))
        models[source, device] = Transformers(source, device)
    run.hf_device = (device_name(device, torch), note)
    torch.set_num_threads(cfg.threads or usable_cores())
    for batch in run.suite.batches:
        wait_quiet(cfg.quiet_wait_s)
        meter = ChildCpuMeter()
        prefill, steps, tokens = models[source, device].generate(run.prompts[:batch], run.suite.new_tokens)
        sample = fig.from_steps(prefill, steps, batch, run.suite.new_tokens)
        sample.update(round=rnd, cpu=meter.lap())
        run.hf.setdefault(batch, []).append(sample)
        run.hf_tokens[batch] = tokens
        log(f"round {rnd + 1} {run.suite.name} | transformers | batch {batch}: prompt "
            f"{sample['prompt_latency_ms']:.0f} ms, token {sample['per_token_ms_median']:.1f} ms")


# ---- assembling the results ------------------------------------------------------------------------------------

def _tokens_list(tokens: dict) -> list:
    return [tokens[k] for k in sorted(tokens)]


def cell_record(run: SuiteRun, cell) -> dict:
    lay = dataclasses.asdict(cell.layout) | {"dp": cell.layout.dp}
    rec = {"layout": lay, "batch": cell.batch, "variant": cell.variant}
    if cell.skip:
        return rec | {"status": "skipped", "reason": cell.skip}
    out = run.outcome.get(cell.key, {"status": "failed", "error": "not run"})
    if not run.runs[cell.key]:
        return rec | {"status": out["status"], "reason": out.get("error", "")}
    return rec | {"status": "ok", "figures": fig.medians(run.runs[cell.key]), "runs": run.runs[cell.key],
                  "command": out.get("command")}


def find(records: list, layout: str, batch: int, variant: str) -> dict | None:
    return next((r for r in records if r["layout"]["name"] == layout and r["batch"] == batch
                 and r["variant"] == variant), None)


def baselines(run: SuiteRun, records: list) -> list:
    """Ratios of hpcinfer against each baseline at the same layout and batch (> 1: hpcinfer is better). A naive
    variant is the baseline of the layout's hpcinfer cell; the CUDA graphs variant is the tuned path, and the
    hpcinfer cell (graphs off by default) is its baseline, "no CUDA graphs"."""
    out = []
    for rec in records:
        if rec["variant"] == "hpcinfer" or rec["status"] != "ok":
            continue
        plain = find(records, rec["layout"]["name"], rec["batch"], "hpcinfer")
        if not plain or plain["status"] != "ok":
            continue
        base, ours = (plain, rec) if rec["variant"] == CUDA_GRAPHS else (rec, plain)
        checks = agreement(_tokens_list(run.tokens[_key(run, ours)]), _tokens_list(run.tokens[_key(run, base)]))
        out.append({"name": "no CUDA graphs" if rec["variant"] == CUDA_GRAPHS else rec["variant"], "kind": "naive",
                    "layout": rec["layout"]["name"], "batch": rec["batch"], "status": "ok",
                    "ratios": fig.ratios(base["figures"], ours["figures"]), "checks": checks})
    graphs_why = graphs_skip(run.suite, is_moe(run.arch), run.backend) if not run.skip else ""
    if run.backend == "cupy" and graphs_why:         # on NumPy the results' not_applicable says it once
        out.append({"name": "no CUDA graphs", "kind": "naive", "status": "not applicable", "reason": graphs_why})
    why = hf_applicability(run)
    one = next((c.layout.name for c in run.cells if c.layout.ranks == 1 and not c.skip), None)
    if not why and one is None:
        why = "no 1-rank layout in this suite to compare with"
    if why:
        return out + [{"name": "transformers", "kind": "transformers", "status": "not applicable", "reason": why}]
    for batch, samples in sorted(run.hf.items()):
        ours = find(records, one, batch, "hpcinfer")
        if not ours or ours["status"] != "ok":
            continue
        figures = fig.medians(samples)
        device, note = run.hf_device
        out.append({"name": "transformers", "kind": "transformers", "layout": one, "batch": batch, "status": "ok",
                    "device": device, "figures": figures, "ratios": fig.ratios(figures, ours["figures"]),
                    "checks": agreement(_tokens_list(run.tokens[_key(run, ours)]), run.hf_tokens[batch]),
                    "runs": samples} | ({"device_note": note} if note else {}))
    return out


def _key(run: SuiteRun, rec: dict) -> str:
    return next(c.key for c in run.cells if c.layout.name == rec["layout"]["name"] and c.batch == rec["batch"]
                and c.variant == rec["variant"])


def max_batch(records: list) -> dict:
    """Per variant: the largest batch that ran (the offload suite's figure), with its tokens/s."""
    out = {}
    for rec in records:
        if rec["status"] == "ok" and rec["batch"] >= out.get(rec["variant"], {}).get("batch", 0):
            out[rec["variant"]] = {"batch": rec["batch"], "layout": rec["layout"]["name"],
                                   "tokens_per_s": rec["figures"]["tokens_per_s"]}
    return out


def suite_record(run: SuiteRun) -> dict:
    s, arch = run.suite, run.arch
    records = [cell_record(run, c) for c in run.cells]
    rec = {"name": s.name, "about": SUITES[s.name].about, "prompt_len": s.prompt_len, "new_tokens": s.new_tokens,
           "batches": list(s.batches), "offload": s.offload, "skipped": run.skip or None,
           "model": dataclasses.asdict(s.model) | {"family": arch.family, "parameters": arch.param_count(),
                                                   "layers": arch.num_layers, "moe": any(arch.moe_experts)},
           "cells": records, "baselines": baselines(run, records)}
    if s.offload:
        rec["max_batch"] = max_batch(records)
    return rec


def not_applicable(machine: dict, backend: str | None = None) -> list:
    """The baselines this run cannot measure, with why. backend: what the cells ran on (None: not known, as for a
    machine description alone). On cupy, no CUDA graphs is a variant cell of the suites (plan.tuned_variants),
    so it is not listed here; suites where graphs cannot apply say so in their own baselines."""
    on_cpu = backend == "numpy" or (backend is None and not machine["gpus"])
    fusion = NO_GRAPHS_CPU if on_cpu else "hpcinfer has no switch to turn kernel fusion off yet"
    out = [{"name": "no fusion", "reason": fusion}]
    if backend == "numpy" and machine["gpus"]:
        out.append({"name": "no CUDA graphs", "reason": "the cells ran on the NumPy backend ([run] backend = "
                                                        "\"numpy\"); [runtime] cuda_graphs needs cupy"})
    elif on_cpu:
        out.append({"name": "no CUDA graphs", "reason": NO_GRAPHS_CPU})
    elif backend is None:
        out.append({"name": "no CUDA graphs", "reason": "[runtime] cuda_graphs switches them (off by default); the "
                                                        "bench runs graphs on against off as a variant cell when "
                                                        "its cells run on cupy"})
    return out


def run_bench(cfg: BenchConfig, out: str, keep: bool = False) -> dict:
    t_start, started, load_start = time.perf_counter(), _dt.datetime.now().astimezone(), loadavg()
    machine = machine_info()
    backend = resolve_backend(cfg.backend)
    log(f"backend of every cell: {backend} ([run] backend = {cfg.backend})")
    bandwidth = fig.read_bandwidth_GBps()
    log(f"memory read bandwidth {bandwidth['GBps']:.1f} GB/s; load average {load_start}")
    workdir = Path(tempfile.mkdtemp(prefix="hpcinfer-bench-"))
    try:
        runs = [SuiteRun(cfg, s, workdir, backend) for s in cfg.suites]
        log("cells: " + ", ".join(f"{r.suite.name} {sum(not c.skip for c in r.cells)}" for r in runs))
        run_rounds(cfg, runs, workdir, bandwidth["GBps"], t_start)
    finally:
        if keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    suites = [suite_record(r) for r in runs]
    others = [(s.get("cpu") or {}).get("other_cpus") for x in suites for c in x["cells"] for s in c.get("runs", [])]
    failed = [f"{x['name']} | {c['layout']['name']} | batch {c['batch']} | {c['variant']}: {c['reason']}"
              for x in suites for c in x["cells"] if c["status"] == "failed"]
    return {
        "schema": CURRENT,
        "backend": backend,
        "date": started.date().isoformat(), "timestamp": started.isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "config": {"path": cfg.path, "repeats": cfg.repeats, "quiet_wait_s": cfg.quiet_wait_s,
                   "threads": cfg.threads, "backend": cfg.backend,
                   "launcher": list(cfg.launcher) or ["mpiexec", "-n", "{ranks}"],
                   "layouts": [dataclasses.asdict(lay) for lay in cfg.layouts]},
        "machine": machine | {"memory_read": bandwidth, "loadavg_start": load_start, "loadavg_end": loadavg()},
        "software": {"hpcinfer": __version__, "numpy": np.__version__, "git_commit": git_commit()},
        "suites": suites,
        "not_applicable": not_applicable(machine, backend),
        "warnings": busy_warning(others, "a cell (cells[].runs[].cpu.other_cpus)")
                    + [f"failed: {f}" for f in failed],
    }
