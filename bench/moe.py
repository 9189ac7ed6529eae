"""MoE benchmark, in one run: (a) gating + dispatch + combine of the table/scan ops (hpcinfer.backend.moe_ops)
against the one-hot einsum formulation of GShard / DeepSpeed (tests/helpers/moe_reference.py), both NumPy, same inputs;
(b) messages and bytes per rank per MoE layer of each all-to-all variant at simulated world sizes (from the
schedules, hpcinfer.comm.all_to_all.message_stats), and the measured MoE layer time of each variant at 4 and 8
ranks (moe_layer.py under the venv's mpiexec). See docs/bench-scripts.md.

    python -m bench.moe --out bench/results

Writes bench/results/moe-<YYYY-MM-DD>.json (machine, settings, every raw timing, medians, ratios, checks) and
bench/results/moe-<YYYY-MM-DD>.md (the tables), and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hpcinfer import __version__
from hpcinfer.backend import moe_ops
from hpcinfer.backend.moe_ops import capacity_for
from hpcinfer.comm.all_to_all import message_stats
from hpcinfer.bench.common import (BUSY_WARN_CPUS, ChildCpuMeter, CpuMeter, busy_warning, git_commit, loadavg, logger,
                                   machine_info, median, usable_cores, wait_quiet)

from . import REPO
from .results import write_results

sys.path.insert(0, str(REPO / "tests" / "helpers"))        # tests/helpers/moe_reference.py: the einsum formulation

KINDS = ("flat", "hierarchical", "pcc", "pcc+hierarchical")
MPI_TIMEOUT_S = 120


log = logger("bench.moe")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


# ---- (a) gating + dispatch + combine: table/scan against one-hot einsum -------------------------------------------

GATINGS = [  # name, top-k, normalize, capacity factor (0: no limit)
    {"name": "top-1, capacity factor 1.0", "k": 1, "normalize": "none", "capacity_factor": 1.0},
    {"name": "top-2, no capacity", "k": 2, "normalize": "topk", "capacity_factor": 0.0},
]


def table_path(x, logits, scale, k: int, normalize: str, capacity):
    """hpcinfer.backend.moe_ops, the path the model takes: top-k -> routing tables (sort + scan) -> permute rows
    into expert order -> the per-expert op on each row -> unpermute, weighting by the gates. x [T, D], logits
    [T, E], scale [E] (the trivial expert: multiply by the expert's constant) -> [T, D]."""
    experts, weights = moe_ops.top_k_gating(logits, k, normalize)                  # [T, K]
    routing = moe_ops.route(experts, weights, logits.shape[1], capacity)
    rows = moe_ops.permute(x, routing)                                              # [R, D]
    rows = rows * scale[routing.expert_of_row][:, None]                             # expert e: x * scale[e]
    return moe_ops.unpermute(rows, routing, x.shape[0])


def einsum_path(x, logits, scale, k: int, normalize: str, capacity):
    """The one-hot formulation (moe_reference.einsum_gating + einsum_moe's dispatch and combine einsums): masks
    and combine weights [T, E, C], dispatched [E, C, D] = einsum("tec,td->ecd"), the same per-expert op on the
    expert buffers, combine einsum("tec,ecd->td")."""
    from moe_reference import einsum_gating

    combine, dispatch = einsum_gating(logits, k, normalize, capacity)               # [T, E, C]
    dispatched = np.einsum("tec,td->ecd", dispatch.astype(x.dtype), x, optimize=True)   # [E, C, D]
    expert_out = dispatched * scale[:, None, None]
    return np.einsum("tec,ecd->td", combine, expert_out, optimize=True)             # [T, D]


IMPLS = {"table": table_path, "einsum": einsum_path}


class Cell:
    def __init__(self, gating: dict, tokens: int, experts: int, hidden: int, min_capacity: int, seed: int):
        self.gating, self.tokens, self.experts = gating, tokens, experts
        rng = np.random.default_rng([seed, tokens, experts, gating["k"]])
        self.x = rng.standard_normal((tokens, hidden)).astype(np.float32)                       # [T, D]
        self.gate_w = (rng.standard_normal((experts, hidden)) / hidden ** 0.5).astype(np.float32)  # [E, D]
        self.logits = self.x @ self.gate_w.T                        # [T, E], as moe_reference computes them
        self.scale = (1 + 0.5 * np.arange(experts) / experts).astype(np.float32)                # [E]
        cf = gating["capacity_factor"]
        self.capacity = capacity_for(tokens, experts, cf, min_capacity) if cf > 0 else None
        self.C = tokens if self.capacity is None else self.capacity     # the einsum path's buffer length
        self.key = f"{gating['name']} | T={tokens} | E={experts}"
        self.n_inner = {}

    def run(self, impl: str):
        g = self.gating
        return IMPLS[impl](self.x, self.logits, self.scale, g["k"], g["normalize"], self.capacity)

    def sample(self, impl: str) -> float:
        n = self.n_inner[impl]
        t0 = time.perf_counter()
        for _ in range(n):
            self.run(impl)
        return (time.perf_counter() - t0) / n

    def check(self) -> dict:
        """Both paths give the same output, and each equals its moe_reference function (einsum_moe, table_moe
        with the scaling expert): raises SystemExit before any timing otherwise."""
        from moe_reference import einsum_moe, table_moe

        g = self.gating
        table, einsum = self.run("table"), self.run("einsum")
        expert_fn = lambda e, x_e: x_e * self.scale[e]                      # noqa: E731
        ref_e = einsum_moe(self.x, self.gate_w, expert_fn, g["k"], g["normalize"], self.capacity)
        ref_t, routing = table_moe(self.x, self.gate_w, expert_fn, g["k"], g["normalize"], self.capacity,
                                   return_routing=True)
        try:
            np.testing.assert_allclose(table, einsum, rtol=1e-5, atol=1e-6, err_msg="table vs einsum")
            np.testing.assert_allclose(einsum, ref_e, rtol=1e-5, atol=1e-6, err_msg="einsum vs einsum_moe")
            np.testing.assert_allclose(table, ref_t, rtol=1e-5, atol=1e-6, err_msg="table vs table_moe")
        except AssertionError as e:
            raise SystemExit(f"bench.moe: {self.key}: the implementations disagree, nothing timed:\n{e}")
        experts, _ = moe_ops.top_k_gating(self.logits, g["k"], g["normalize"])
        return {"allclose": True, "max_abs_diff": float(np.max(np.abs(table - einsum))),
                "dropped_pairs": int(routing.dropped.sum()), "pairs": int(experts.size),
                "max_expert_load": int(np.bincount(experts.reshape(-1), minlength=self.experts).max())}

    def calibrate(self, min_sample_s: float) -> dict:
        """Warm each path, time one call, and pick the calls per sample so that a sample lasts >= min_sample_s."""
        single = {}
        for impl in IMPLS:
            self.run(impl)
            calls, t0 = 0, time.perf_counter()
            while calls < 1 or time.perf_counter() - t0 < min_sample_s:     # several calls: one may stall
                self.run(impl)
                calls += 1
            single[impl] = (time.perf_counter() - t0) / calls
            self.n_inner[impl] = max(1, math.ceil(min_sample_s / max(single[impl], 1e-7)))
        return single


def part_a(args, deadline: float) -> dict:
    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads)
    cells = [Cell(g, t, e, args.hidden, args.min_capacity, args.seed)
             for g in GATINGS for t in args.tokens for e in args.experts]
    log(f"(a) {len(cells)} cells, D = {args.hidden}, {args.threads} BLAS thread(s): checking outputs")
    checks, single = {}, {}
    for c in cells:
        checks[c.key] = c.check()
        single[c.key] = c.calibrate(args.min_sample_s)
    log(f"(a) outputs agree in every cell (max |table - einsum| = "
        f"{max(ch['max_abs_diff'] for ch in checks.values()):.2e}); timing {args.repeats} rounds")

    meter = CpuMeter()
    raw = {c.key: {impl: [] for impl in IMPLS} for c in cells}
    cpu, waits = [], []
    for r in range(args.repeats):
        waits.append(wait_quiet(args.quiet_wait if time.perf_counter() < deadline else 0.0))
        meter.lap()
        for i, c in enumerate(cells):
            order = list(IMPLS) if (r + i) % 2 == 0 else list(IMPLS)[::-1]          # alternate who goes first
            for impl in order:
                raw[c.key][impl].append(c.sample(impl))
        cpu.append(meter.lap())
        log(f"(a) round {r + 1}/{args.repeats}: other processes {(cpu[-1] or {}).get('other_cpus')} CPUs")

    rows = []
    for c in cells:
        t, e = raw[c.key]["table"], raw[c.key]["einsum"]
        rows.append({
            "gating": c.gating["name"], "tokens": c.tokens, "experts": c.experts, "k": c.gating["k"],
            "capacity": c.capacity, "C": c.C, "einsum_tensor_elements": c.tokens * c.experts * c.C,
            "table_ms": 1e3 * median(t), "einsum_ms": 1e3 * median(e), "speedup": median(e) / median(t),
            "speedup_per_round": [b / a for a, b in zip(t, e)],
            "calls_per_sample": dict(c.n_inner), **checks[c.key]})
    return {"cells": rows, "raw_s": raw, "first_call_s": single, "cpu_use_per_round": cpu,
            "quiet_wait_per_round": waits}


# ---- (b) messages and bytes from the schedules --------------------------------------------------------------------

def per_layer(kind: str, world: int, rpn: int, tp: int, rows: int, row_bytes: int) -> dict:
    """message_stats gives one exchange (PCC: its all-to-all steps and the tp all-gather). The Dispatcher runs
    the all-to-all twice a layer (tokens out, expert outputs back) and the PCC all-gather once, after the return."""
    stats = message_stats(kind, world, rpn, tp, rows, row_bytes)
    steps = stats["steps"]
    a2a, gather = (steps[:-1], steps[-1:]) if kind.startswith("pcc") else (steps, [])
    return {"messages": 2 * sum(s["messages"] for s in a2a) + sum(s["messages"] for s in gather),
            "bytes": 2 * sum(s["bytes"] for s in a2a) + sum(s["bytes"] for s in gather),
            "message_stats": stats}


def part_b_stats(args) -> dict:
    rows_out = []
    for world in args.worlds:
        for tp in args.tps:
            if world % tp or args.ranks_per_node % tp or world % args.ranks_per_node:
                continue
            rows = args.stats_tokens * args.top_k // world
            entry = {"world": world, "tp": tp, "rows_per_pair": rows}
            for kind in KINDS:
                entry[kind] = per_layer(kind, world, args.ranks_per_node, tp, rows, 4 * args.hidden)
            rows_out.append(entry)
    return {"rows": rows_out, "assumption": (
        f"{args.stats_tokens} tokens per rank (replicated over its tp group), top-{args.top_k}, routing spread "
        f"evenly: rows_per_pair = tokens * k / world rows of D = {args.hidden} float32 ({4 * args.hidden} bytes) "
        f"from every rank to every other in a flat exchange; {args.ranks_per_node} ranks per node; per MoE layer "
        f"= 2 x the all-to-all steps (dispatch and return) + the PCC all-gather once; only payload messages to "
        f"other ranks (the int64 expert index sent alongside on the way out, 8 bytes a row, and the counts are "
        f"left out). Messages do not depend on the token count while every pair gets a row; bytes scale "
        f"linearly with it.")}


# ---- (b) measured MoE layer time under MPI ------------------------------------------------------------------------

def parse_layout(text: str) -> dict:
    n, tp, rpn = (int(v) for v in text.split(":"))
    return {"ranks": n, "tp": tp, "ranks_per_node": rpn}


def run_layer_job(args, lay: dict) -> dict:
    cmd = [args.mpiexec, "-n", str(lay["ranks"]), args.python, "-m", "bench.moe_layer",
           "--tp", str(lay["tp"]), "--ranks-per-node", str(lay["ranks_per_node"]), "--tokens", str(args.layer_tokens),
           "--hidden", str(args.layer_hidden), "--experts", str(args.layer_experts), "--ffn", str(args.layer_ffn),
           "--top-k", str(args.top_k), "--repeats", str(args.layer_repeats), "--inner", str(args.layer_inner)]
    env = {**os.environ, "MPIEXEC_TIMEOUT": str(MPI_TIMEOUT_S), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=MPI_TIMEOUT_S + 30)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise SystemExit(f"bench.moe: MPI job failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n{tail}")
    out = json.loads(lines[-1])
    if "error" in out or not out["checks"]["allclose"]:
        raise SystemExit(f"bench.moe: {' '.join(cmd)}: the all-to-all variants disagree: {out}")
    out["wall_s"], out["command"] = round(wall, 2), " ".join(cmd)
    return out


def part_b_measured(args, deadline: float) -> dict:
    meter = ChildCpuMeter()
    jobs, discarded = [], []
    cores = usable_cores()
    for lay in args.layouts:
        for attempt in range(1 + args.retries):
            before = wait_quiet(args.quiet_wait if time.perf_counter() < deadline else 0.0)
            meter.lap()
            res = run_layer_job(args, lay)
            cpu = meter.lap()
            res.update(cpu=cpu, other_cpus_before=before, attempt=attempt, cores=cores,
                       oversubscription=lay["ranks"] / cores)
            other = (cpu or {}).get("other_cpus", 0.0)
            if other <= BUSY_WARN_CPUS or attempt == args.retries or time.perf_counter() >= deadline:
                break
            discarded.append(res)
            log(f"(b) {lay}: other processes used {other} CPUs meanwhile; run again")
        # The model at this job's own size, for the measured counts: tokens * k / world rows a pair.
        rows = args.layer_tokens * args.top_k // lay["ranks"]
        res["model_per_layer"] = {}
        for kind in KINDS:
            try:
                res["model_per_layer"][kind] = per_layer(kind, lay["ranks"], lay["ranks_per_node"], lay["tp"], rows,
                                                         4 * args.layer_hidden)
            except ValueError as e:                       # e.g. pcc+hierarchical with tp not dividing the node
                res["model_per_layer"][kind] = {"error": str(e)}
        jobs.append(res)
        med = res["layer_s_median"]
        log(f"(b) {lay['ranks']} ranks tp={lay['tp']} ranks_per_node={lay['ranks_per_node']}: "
            + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in med.items())
            + f" ms; other processes {(cpu or {}).get('other_cpus')} CPUs; job {res['wall_s']:.1f} s")
    return {"jobs": jobs, "discarded": discarded}


# ---- report -------------------------------------------------------------------------------------------------------

def fmt_mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def markdown(result: dict) -> str:
    s, mach = result["settings"], result["machine"]
    lines = [f"# MoE benchmark {result['date']}", "",
             f"Machine: {mach['cpu_model']}, {mach['cpus_usable']} usable CPU(s); load average at start "
             f"{mach['loadavg_start']}, at end {mach['loadavg_end']}. Commit: {result['software']['git_commit']}. "
             f"NumPy {result['software']['numpy']}. Whole run {result['elapsed_s']:.0f} s.", ""]
    a = result.get("a")
    if a:
        lines += [f"## (a) Gating + dispatch + combine: table/scan against one-hot einsum (NumPy, D = {s['hidden']})",
                  "",
                  f"Router logits given; timed: top-k, routing tables, permute into expert buffers, a per-expert "
                  f"scaling (x · c_e, so no FFN cost), combine with the gate weights. {s['threads']} BLAS thread(s); "
                  f"{s['repeats']} alternating rounds after a check and a warm-up; medians (ms). Capacity "
                  f"C = max(ceil(T / E · 1.0), min_capacity = {s['min_capacity']}) for top-1 (DeepSpeed's "
                  f"setting); top-2 has no capacity limit, so the einsum path's buffers are C = T.", "",
                  "| gating | T | E | C | T·E·C | dropped | table (ms) | einsum (ms) | speedup |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in a["cells"]:
            lines.append(f"| {c['gating']} | {c['tokens']} | {c['experts']} | {c['C']} | "
                         f"{c['einsum_tensor_elements']:,} | {c['dropped_pairs']}/{c['pairs']} | "
                         f"{c['table_ms']:.3f} | {c['einsum_ms']:.3f} | **{c['speedup']:.1f}×** |")
        sp = [c["speedup"] for c in a["cells"]]
        lines += ["", f"speedup = einsum time / table time (> 1: the table/scan path is faster); range "
                      f"{min(sp):.1f}× to {max(sp):.0f}× (the paper reports over 6× for its GPU kernels). "
                      f"Both paths give the same output in every cell (allclose, max |diff| "
                      f"{max(c['max_abs_diff'] for c in a['cells']):.1e}; each also equals its "
                      f"tests/helpers/moe_reference.py function). Other processes' CPU use per round "
                      f"(CPUs, 0 = quiet): "
                      f"{[r['other_cpus'] for r in a['cpu_use_per_round'] if r]}.", ""]
    st = result.get("b_stats")
    if st:
        lines += ["## (b) Messages and bytes each rank sends per MoE layer (from the schedules)", "",
                  st["assumption"], "",
                  "| world | tp | rows/pair | flat msgs | flat MB | hier msgs | hier MB | pcc msgs | pcc MB | "
                  "pcc+hier msgs | pcc+hier MB |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in st["rows"]:
            cells = " | ".join(f"{r[k]['messages']} | {fmt_mb(r[k]['bytes'])}" for k in KINDS)
            lines.append(f"| {r['world']} | {r['tp']} | {r['rows_per_pair']} | {cells} |")
        lines += ["", "flat and hierarchical do not depend on tp (every rank of a tp group dispatches the whole "
                      "replicated batch); hierarchical trades fewer messages for up to 2× the bytes (rows cross "
                      "twice; at 8 ranks, one node, it is the flat exchange). PCC: 2·(world/tp − 1) all-to-all "
                      "messages of 1/tp of the rows + (tp − 1) all-gather messages a layer; per layer it also "
                      "sends fewer bytes than flat, as the all-gather runs once, after the return trip "
                      "(message_stats' one-exchange view, all-gather included, has flat's bytes).", ""]
    bm = result.get("b_measured")
    if bm:
        ls = s["layer"]
        lines += ["## (b) Measured MoE layer time at 4 and 8 ranks", "",
                  f"Router + top-{s['top_k']} gating (no capacity) + routing + Dispatcher + ExpertStack on random "
                  f"SiLU-gated experts: D = {ls['hidden']}, E = {ls['experts']}, F = {ls['ffn']}, "
                  f"{ls['tokens']} tokens per rank (replicated over its tp group), ep = ranks, expert_tp = 1; one "
                  f"`mpiexec` job per layout (`python -m bench.moe_layer`), every variant in the "
                  f"same job, "
                  f"{ls['repeats']} rotated rounds of {ls['inner']} layer calls after a check and a warm-up; a "
                  f"sample is the slowest rank's time from a common barrier; medians (ms). 1 BLAS thread a rank. "
                  f"local = every expert on every rank, no exchange (the single-rank path on the same tokens, run "
                  f"on all ranks at once); not a lower bound: each rank then reads all E experts' weights (ep "
                  f"times an expert-parallel rank's) and runs E smaller GEMMs a call. in exchange = mean over ranks "
                  f"of the time inside the all-to-alls and the "
                  f"PCC all-gather (waiting for slower peers included). levels: the exchange group (stage, or dp "
                  f"for PCC) and, when hierarchical, G×M = its ranks per node × nodes (G = 1 is a single "
                  f"inter-node level). messages / MB: measured payload (float32 "
                  f"rows) per rank per layer, mean over ranks, against the schedule model at this size "
                  f"(tokens · k / world rows a pair); + ids: the int64 index messages sent alongside.", "",
                  "| ranks | tp | ranks/node | variant | levels | layer (ms) | vs flat | in exchange (ms) | "
                  "messages (model) | + ids | MB (model) |",
                  "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        for j in bm["jobs"]:
            med, comm = j["layer_s_median"], j["in_comm_s_median"]
            for v in list(KINDS) + ["local"]:
                if v not in med:
                    continue
                if v == "local":
                    lev, msgs, ids, mb = "no exchange", "–", "–", "–"
                else:
                    lv = j["levels"][v]
                    lev = (f"{lv['group']} {lv['group_size']}: " +
                           (f"{lv['ranks_per_node_G']}×{lv['nodes_M']}" if lv["hierarchical"] else "flat")
                           + (" + tp all-gather" if lv["pcc_all_gather"] else ""))
                    m, model = j["measured_per_layer"][v], j["model_per_layer"][v]
                    msgs = f"{m['rows']['messages_mean']:.0f} ({model.get('messages', '?')})"
                    ids = f"{m['ids']['messages_mean']:.0f}"
                    mb = f"{m['rows']['bytes_mean'] / 1e6:.3f} ({fmt_mb(model['bytes']) if 'bytes' in model else '?'})"
                lines.append(f"| {j['world']} | {j['tp']} | {j['ranks_per_node']} | {v} | {lev} | "
                             f"{1e3 * med[v]:.1f} | {med['flat'] / med[v]:.2f}× | {1e3 * comm[v]:.1f} | {msgs} | "
                             f"{ids} | {mb} |")
        over = sorted({(j["world"], j["oversubscription"]) for j in bm["jobs"]})
        checks = all(j["checks"]["allclose"] for j in bm["jobs"])
        identical = all(j["checks"]["identical_between_variants"] for j in bm["jobs"])
        lines += ["",
                  f"**Oversubscribed:** this machine has {bm['jobs'][0]['cores']} usable core(s); "
                  + ", ".join(f"{w} ranks = {o:.0f} ranks a core" for w, o in over)
                  + ". MPICH ranks busy-poll while they wait, so a waiting rank takes CPU time from the ranks it "
                    "waits for: these timings (the 8-rank ones most) are dominated by oversubscription and time "
                    "slicing, not by the exchange schedules, and say little about the variants' relative speed on "
                    "real nodes (where the message counts above matter). vs flat = flat time / variant time "
                    "(> 1: faster than flat).",
                  f"Checks: every variant's output allclose to the single-rank path on every rank: {checks}; "
                  f"bitwise identical across variants: {identical}. Other processes' CPU use per job (CPUs, 0 = "
                  f"quiet): {[(j['world'], j['tp'], (j['cpu'] or {}).get('other_cpus')) for j in bm['jobs']]}; "
                  f"{len(bm['discarded'])} disturbed job(s) run again."]
    lines += ["", "Only ratios within one run count: this machine's speed drifts by 2× between runs."]
    if result.get("warnings"):
        lines += [""] + [f"**Warning:** {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


# ---- main -------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    cores = usable_cores()
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench/results", help="folder for moe-<date>.json and .md")
    p.add_argument("--parts", default="a,b", help="a: table vs einsum; b: message counts and MPI layer times")
    # (a)
    p.add_argument("--tokens", type=ints, default=[8, 64, 512], help="(a) token counts T (comma-separated)")
    p.add_argument("--experts", type=ints, default=[16, 64, 128], help="(a) expert counts E")
    p.add_argument("--hidden", type=int, default=1024, help="(a) hidden size D; (b) row size of the message model")
    p.add_argument("--min-capacity", type=int, default=4, help="(a) top-1 min_capacity (DeepSpeed's default)")
    p.add_argument("--repeats", type=int, default=5, help="(a) timed rounds")
    p.add_argument("--min-sample-s", type=float, default=0.02, help="(a) calls per sample so a sample lasts this")
    p.add_argument("--threads", type=int, default=cores, help="(a) BLAS threads")
    p.add_argument("--seed", type=int, default=0)
    # (b)
    p.add_argument("--top-k", type=int, default=2, help="(b) top-k of the message model and the MPI layer")
    p.add_argument("--worlds", type=ints, default=[8, 16, 32, 64, 128, 256], help="(b) simulated world sizes")
    p.add_argument("--tps", type=ints, default=[1, 2, 8], help="(b) tp degrees (where they divide)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="(b) ranks per node of the message model")
    p.add_argument("--stats-tokens", type=int, default=1024, help="(b) tokens per rank of the message model")
    p.add_argument("--layouts", type=lambda v: [parse_layout(x) for x in v.split(",") if x],
                   default=[parse_layout(x) for x in ("4:1:2", "4:2:2", "8:1:4", "8:2:4")],
                   help="(b) MPI jobs as ranks:tp:ranks_per_node (comma-separated)")
    p.add_argument("--layer-tokens", type=int, default=64, help="(b) tokens per rank of the MPI layer")
    p.add_argument("--layer-hidden", type=int, default=256)
    p.add_argument("--layer-experts", type=int, default=16)
    p.add_argument("--layer-ffn", type=int, default=512)
    p.add_argument("--layer-repeats", type=int, default=9, help="(b) rounds in each MPI job")
    p.add_argument("--layer-inner", type=int, default=3, help="(b) layer calls per sample")
    p.add_argument("--quiet-wait", type=float, default=15.0,
                   help=f"before each round / job, wait up to this many s for other processes to use <= "
                        f"{BUSY_WARN_CPUS} CPUs")
    p.add_argument("--retries", type=int, default=1, help="(b) rerun a job disturbed by other processes")
    p.add_argument("--budget", type=float, default=240.0, help="s after which waiting for quiet and retries stop")
    p.add_argument("--mpiexec", default=str(REPO / ".venv/bin/mpiexec"))
    p.add_argument("--python", default=str(REPO / ".venv/bin/python"))
    args = p.parse_args(argv)
    args.parts = set(args.parts.split(","))
    if args.repeats < 1 or args.layer_repeats < 1 or args.layer_inner < 1 or args.top_k < 1:
        p.error("--repeats, --layer-repeats, --layer-inner and --top-k must be >= 1")
    bad = [w for w in args.worlds if (args.stats_tokens * args.top_k) % w]
    if bad:
        p.error(f"--stats-tokens * --top-k = {args.stats_tokens * args.top_k} must be a multiple of every world "
                f"size (rows per pair); not of {bad}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    started = _dt.datetime.now().astimezone()
    load_start = loadavg()
    log(f"load average {load_start}")
    if "b" in args.parts:
        for path in (args.mpiexec, args.python):
            if not Path(path).exists():
                raise SystemExit(f"bench.moe: {path} not found (make venv)")

    result = {"schema": "hpcinfer-bench-moe/1", "date": started.date().isoformat(),
              "timestamp": started.isoformat(timespec="seconds"), "elapsed_s": None}
    warnings = []
    if "a" in args.parts:
        result["a"] = part_a(args, deadline)
        busy = [r["other_cpus"] for r in result["a"]["cpu_use_per_round"] if r]
        warnings += [f"(a): {w}" for w in busy_warning(busy, "a round")]
    if "b" in args.parts:
        result["b_stats"] = part_b_stats(args)
        log(f"(b) message model at worlds {args.worlds}; MPI jobs {args.layouts}")
        result["b_measured"] = part_b_measured(args, deadline)
        busy = [(j["cpu"] or {}).get("other_cpus", 0.0) for j in result["b_measured"]["jobs"]]
        warnings += [f"(b): {w}" for w in busy_warning(busy, "an MPI job")]

    s = vars(args).copy()
    s["parts"] = sorted(args.parts)
    s["layer"] = {"tokens": args.layer_tokens, "hidden": args.layer_hidden, "experts": args.layer_experts,
                  "ffn": args.layer_ffn, "repeats": args.layer_repeats, "inner": args.layer_inner}
    s["gatings"] = GATINGS
    s["busy_threshold_cpus"] = BUSY_WARN_CPUS
    result.update({
        "machine": {**machine_info(), "loadavg_start": load_start, "loadavg_end": loadavg()},
        "software": {"numpy": np.__version__, "hpcinfer": __version__,
                     "git_commit": git_commit(), "mpiexec": args.mpiexec},
        "settings": s,
        "warnings": warnings,
    })
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_results(args.out, "moe", result, markdown(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
