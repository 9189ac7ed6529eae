"""python -m bench.cpu_ops: where one step of the NumPy backend goes, op by op (issue 23).

On SmolLM2 float32 over the continuous schedule's KV store (NumPy's dense slots; --store paged: the paged pool): a
decode step of `--batch` sequences at a few context lengths, and a prefill of batch x length prompts, each timed
`--repeats` times after a warm-up (medians).
Every call of the Ops seam (backend/interface.Ops) the model makes is timed by wrapping the ops object's methods;
a decode step's projections are reported as weight bytes read per second and its attention as K/V bytes read per
second, next to the machine's read bandwidth (bench/cpu.Bandwidth, measured in the same run). Also the same
prefill in transformers, as the issue's prefill target compares them. Then the projections alone per token count
(gemm_rows), against the read bandwidth and the BLAS's own GEMM peak.

    python -m bench.cpu_ops [--batch 8] [--contexts 128,400,1024] [--prefill 16x128,8x414]
                                             [--gemm 1,2,4,8,16,32,64]

Writes bench/results/cpu-ops-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from collections import defaultdict

import numpy as np

from hpcinfer.api import load_model
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.generate.paged_cache import PagedKVCache
from hpcinfer.generate.slot_cache import SlotKVCache
from hpcinfer.metrics import held_weight_bytes, is_sharded_layer, weight_leaves
from hpcinfer.quant.formats import quantize
from hpcinfer.quant.kv import kv_bytes_per_token
from .chat_workload import CHECKPOINT, GGUF
from hpcinfer.bench.common import git_commit, logger, machine_info, median
from hpcinfer.bench.hf_baseline import Transformers
from .cpu import Bandwidth
from .results import write_results

OPS = ("embedding", "linear", "fused_linear", "rms_norm", "layer_norm", "rotary", "attention", "activation",
       "gated_activation", "argmax")
BLOCK = 16
log = logger("bench.cpu_ops")


class OpClock:
    """Wraps the named methods of an ops object: seconds per op name, summed until `take()`. Only the outermost
    call counts (fused_linear's own norm and linear calls are fused_linear's time)."""

    def __init__(self, ops, names=OPS):
        self.seconds: dict = defaultdict(float)
        self.depth = 0
        for name in names:
            setattr(ops, name, self._timed(name, getattr(ops, name)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds[name] += time.perf_counter() - t0
        return timed

    def take(self) -> dict:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


class Steps:
    """SmolLM2 on the NumPy backend with the continuous schedule's KV store big enough for the runs below: dense
    slots (generate/slot_cache.py, what NumPy runs) or the paged pool."""

    def __init__(self, checkpoint, sequences: int, longest: int, store: str = "slots", cpu_kernels: str = "auto"):
        self.model = load_model(str(checkpoint), cpu_kernels=cpu_kernels)
        self.clock = OpClock(self.model.ops)
        m, arch = self.model, self.model.arch
        shape = (m.ops, m.num_local_layers, sequences * -(-longest // BLOCK), m.kv_heads_local, BLOCK, arch.head_dim)
        self.cache = SlotKVCache(*shape, sequences, longest) if store == "slots" else PagedKVCache(*shape)
        self.rng = np.random.default_rng(0)

    def prefill(self, ids: list, lengths: list) -> float:
        """One packed prompt step of sequences `ids` with `lengths` tokens each (their blocks taken): seconds."""
        for i, n in zip(ids, lengths):
            self.cache.tables.release(i)
            self.cache.tables.grow(i, n + 1)
        layout = self.cache.layout(ids, [0] * len(ids), lengths)
        tokens = self.rng.integers(1, self.model.arch.vocab_size, size=sum(lengths))
        t0 = time.perf_counter()
        self.model.forward(tokens, layout, self.cache)
        return time.perf_counter() - t0

    def decode(self, ids: list, context: int) -> float:
        """One decode step of `ids` at position `context` (rewritten in place at every repeat): seconds."""
        layout = self.cache.layout(ids, [context] * len(ids), [1] * len(ids))
        tokens = self.rng.integers(1, self.model.arch.vocab_size, size=len(ids))
        t0 = time.perf_counter()
        self.model.forward(tokens, layout, self.cache)
        return time.perf_counter() - t0

    def repeat(self, fn, repeats: int) -> tuple[float, dict]:
        """fn() once to warm up, then `repeats` times: (median seconds, median seconds per op)."""
        fn()
        self.clock.take()
        runs = []
        for _ in range(repeats):
            seconds = fn()
            runs.append((seconds, self.clock.take()))
        ops = {name: median(r[1].get(name, 0.0) for r in runs) for name in runs[0][1]}
        return median(r[0] for r in runs), ops


def decode_rows(steps: Steps, batch: int, contexts: list, repeats: int) -> list:
    model, arch = steps.model, steps.model.arch
    kv_per_token = kv_bytes_per_token(model.kv_heads_local, arch.head_dim, model.num_local_layers)
    projections = held_weight_bytes(model)               # every weight a decode step reads (tied LM head once)
    rows = []
    for context in contexts:
        ids = list(range(batch))
        steps.prefill(ids, [context] * batch)
        seconds, ops = steps.repeat(lambda: steps.decode(ids, context), repeats)
        linear_s = ops.get("linear", 0.0) + ops.get("fused_linear", 0.0)
        kv_bytes = kv_per_token * batch * (context + 1)
        rows.append({"batch": batch, "context": context, "step_ms": seconds * 1e3,
                     "ops_ms": {k: v * 1e3 for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
                     "weight_bytes": projections, "weight_GBps": projections / linear_s / 1e9 if linear_s else None,
                     "kv_bytes": kv_bytes, "attention_GBps": kv_bytes / ops["attention"] / 1e9})
        log(f"decode b{batch} ctx {context}: {seconds * 1e3:.1f} ms")
    return rows


def attention_rows(model, batch: int, contexts: list, repeats: int, blocks: tuple = (BLOCK,)) -> list:
    """Decode attention alone (ops.attention over every layer, one new token for each of `batch` sequences), with
    cpu_kernels numpy and numba, over the dense slot store and the paged pool (blocks of each size of `blocks`, in a
    shuffled order, as a running pool hands them out), interleaved ABAB per context (medians of `repeats`): ms and
    GB/s of K/V read (the bytes decode_rows counts)."""
    ops, arch, layers = model.ops, model.arch, model.num_local_layers
    kv_heads, hd = model.kv_heads_local, arch.head_dim
    heads = kv_heads * (arch.num_heads // arch.num_kv_heads)
    rng = np.random.default_rng(3)
    rows = []
    for context in contexts:
        length = context + 1
        dense = [rng.standard_normal((2, batch, kv_heads, length, hd), dtype=np.float32) for _ in range(layers)]
        steps = {"slots": StepLayout.build(np.arange(batch), [context] * batch, [1] * batch)}
        caches = {"slots": dense}
        for block in blocks:
            caches[f"paged bs{block}"], steps[f"paged bs{block}"] = _paged_copy(dense, batch, length, block, rng)
        q = rng.standard_normal((batch, heads, hd), dtype=np.float32)
        k, v = (rng.standard_normal((batch, kv_heads, hd), dtype=np.float32) for _ in range(2))
        runs = {(kernels, store): [] for kernels in ("numpy", "numba") for store in caches}
        for _ in range(repeats + 1):                                                  # the first round warms up
            for kernels, store in runs:
                ops.cpu_kernels = kernels
                t0 = time.perf_counter()
                for cache in caches[store]:
                    ops.attention(q, k, v, cache[0], cache[1], steps[store], 0.125)
                runs[(kernels, store)].append(time.perf_counter() - t0)
        ops.cpu_kernels = "numba"
        kv_bytes = kv_bytes_per_token(kv_heads, hd, layers) * batch * length
        for (kernels, store), times in runs.items():
            seconds = median(times[1:])
            rows.append({"batch": batch, "context": context, "kernels": kernels, "store": store,
                         "ms": seconds * 1e3, "kv_bytes": kv_bytes, "GBps": kv_bytes / seconds / 1e9})
        log(f"decode attention b{batch} ctx {context}: " + ", ".join(
            f"{r['kernels']} {r['store']} {r['ms']:.1f} ms" for r in rows[-len(runs):]))
    return rows


def _paged_copy(dense, batch: int, length: int, block: int, rng) -> tuple:
    """The rows of `dense` (per layer [2, S, Hkv, length, hd]) in pools of `block`-position blocks, handed out in a
    shuffled order -> (the pools per layer [2, blocks, Hkv, block, hd], the paged decode step over them)."""
    _, _, kv_heads, _, hd = dense[0].shape
    per_seq = -(-length // block)
    order = rng.permutation(batch * per_seq)                                          # the pool's blocks, shuffled
    pools = [np.zeros((2, batch * per_seq, kv_heads, block, hd), dtype=np.float32) for _ in dense]
    for d, p in zip(dense, pools):
        padded = np.zeros((2, batch, kv_heads, per_seq * block, hd), dtype=np.float32)
        padded[..., :length, :] = d
        p[:, order] = padded.reshape(2, batch, kv_heads, per_seq, block, hd).transpose(0, 1, 3, 2, 4, 5) \
            .reshape(2, batch * per_seq, kv_heads, block, hd)
    context = length - 1
    return pools, StepLayout.paged(order.reshape(batch, per_seq), block, [context] * batch, [1] * batch)


def prefill_rows(steps: Steps, shapes: list, repeats: int, hf, kernels: str = "numba") -> list:
    """Prefill steps with cpu_kernels = `kernels`."""
    steps.model.ops.cpu_kernels = kernels
    rows = []
    for batch, length in shapes:
        ids = list(range(batch))
        seconds, ops = steps.repeat(lambda: steps.prefill(ids, [length] * batch), repeats)
        row = {"batch": batch, "length": length, "kernels": kernels, "step_ms": seconds * 1e3,
               "ops_ms": {k: v * 1e3 for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
               "tokens_per_s": batch * length / seconds}
        if hf is not None:
            prompts = np.random.default_rng(1).integers(1, 40000, size=(batch, length)).tolist()
            hf.generate(prompts, 1)
            row["transformers_ms"] = median(hf.generate(prompts, 1)[0] for _ in range(repeats)) * 1e3
        rows.append(row)
        log(f"prefill {batch}x{length} ({kernels}): {seconds * 1e3:.0f} ms")
    steps.model.ops.cpu_kernels = "numba"
    return rows


def weight_matrices(model) -> list:
    """The float32 [out, in] matrices a model holds (each once; the tied LM head is the embedding table): what a
    decode step multiplies by, as metrics.held_weight_bytes counts it."""
    held = [_float_matrix(leaf) for leaf in weight_leaves(model)]
    return [m for m in held if isinstance(m, np.ndarray) and m.ndim == 2 and m.dtype == np.float32
            and min(m.shape) > 1]


def _float_matrix(leaf):
    """A weight leaf's float array: a sharded layer's matrix `w` or `table` (None when quantized), or the array."""
    if not is_sharded_layer(leaf):
        return leaf
    return leaf.w if getattr(leaf, "w", None) is not None else getattr(leaf, "table", None)


def gemm_rows(model, tokens: list, repeats: int, bandwidth: float, threads: int) -> dict:
    """The projections alone: ops.linear of `tokens` rows over every weight matrix the model holds, per token
    count (median of `repeats`), with cpu_kernels = numba and numpy interleaved, as GB/s of weights and GFLOP/s,
    against the roofline: the larger of the bytes over the read bandwidth and the FLOPs over the BLAS's float32
    GEMM peak on a large square product (2048^3), both measured in the same run. Then int8 and int4 weights (the
    same matrices quantized) against float32 at 1 token, numba's linear_q."""
    matrices = weight_matrices(model)
    nbytes = sum(int(w.nbytes) for w in matrices)
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((2048, 2048), dtype=np.float32) for _ in range(2))
    peak = 2 * 2048**3 / median(_seconds(lambda: a @ b) for _ in range(repeats)) / 1e9
    ops = {kind: NumpyOps(threads, kind) for kind in ("numba", "numpy")}
    rows = []
    for t in tokens:
        xs = {n: rng.standard_normal((t, n), dtype=np.float32) for n in {w.shape[1] for w in matrices}}
        runs = {kind: (lambda o=o: [o.linear(xs[w.shape[1]], w) for w in matrices]) for kind, o in ops.items()}
        times = _interleaved(runs, repeats)
        flops = 2 * t * nbytes / 4
        roofline = max(nbytes / bandwidth / 1e9, flops / peak / 1e9)
        row = {"tokens": t, "roofline_ms": roofline * 1e3}
        for kind, seconds in times.items():
            row[kind] = {"ms": seconds * 1e3, "weight_GBps": nbytes / seconds / 1e9, "GFLOPs": flops / seconds / 1e9,
                         "roofline_share": roofline / seconds}
        rows.append(row)
        log(f"projections of {t} tokens: numba {times['numba'] * 1e3:.1f} ms, numpy {times['numpy'] * 1e3:.1f} ms, "
            f"roofline {roofline * 1e3:.1f} ms")
    return {"weight_bytes": nbytes, "matrices": len(matrices), "peak_GFLOPs": peak, "rows": rows,
            "quantized_1_token": quantized_row(matrices, ops["numba"], repeats, rng)}


def quantized_row(matrices, ops, repeats: int, rng) -> dict:
    """1 token through the projections: float32 (ops.linear) against int8 and int4 g64 (ops.linear_q) -> ms and
    bytes of weights of each, interleaved."""
    weights = {"float32": matrices, "int8": [quantize(w, "int8") for w in matrices],
               "int4": [quantize(w, "int4", 64) for w in matrices if w.shape[1] % 64 == 0]}
    xs = {n: rng.standard_normal((1, n), dtype=np.float32) for n in {w.shape[1] for w in matrices}}
    runs = {"float32": lambda: [ops.linear(xs[w.shape[1]], w) for w in matrices]}
    for mode in ("int8", "int4"):
        runs[mode] = lambda mode=mode: [ops.linear_q(xs[q.shape[1]], q) for q in weights[mode]]
    times = _interleaved(runs, repeats)
    return {mode: {"ms": times[mode] * 1e3, "weight_bytes": sum(int(w.nbytes) for w in weights[mode]),
                   "matrices": len(weights[mode])} for mode in runs}


def _interleaved(runs: dict, repeats: int) -> dict:
    """Median seconds of each named run, after one warm-up each, taken in turns (ABAB: drift hits all alike)."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(_seconds(fn))
    return {name: median(t) for name, t in times.items()}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def report(result: dict) -> str:
    lines = [f"# One step of the NumPy backend, op by op, {result['date']}", "",
             f"SmolLM2-135M float32, KV store {result['store']} (blocks of {BLOCK}), cpu_kernels "
             f"{result.get('cpu_kernels', 'numpy')}; {result['machine'].get('cpu_model')}, "
             f"{result['machine'].get('cpus_usable')} cores, {result['threads']} BLAS threads; commit "
             f"{result['commit']}. Read bandwidth {result['bandwidth_GBps']:.1f} GB/s (the best of "
             + ", ".join(f"{k} {v:.1f}" for k, v in result.get("bandwidth_kernels_GBps", {}).items())
             + "; bench/cpu.Bandwidth).", "",
             "| decode | step ms | projections ms (GB/s) | attention ms (GB/s of K/V, share of bandwidth) | other ops ms |",
             "|---|---|---|---|---|"]
    bw = result["bandwidth_GBps"]
    for r in result["decode"]:
        ops = r["ops_ms"]
        lin = ops.get("linear", 0) + ops.get("fused_linear", 0)
        rest = sum(v for k, v in ops.items() if k not in ("linear", "fused_linear", "attention"))
        lines.append(f"| {r['batch']} x ctx {r['context']} | {r['step_ms']:.1f} | {lin:.1f} ({r['weight_GBps']:.1f}) "
                     f"| {ops['attention']:.1f} ({r['attention_GBps']:.1f}, {r['attention_GBps'] / bw:.0%}) | {rest:.1f} |")
    if result.get("attention"):
        lines += ["", "Decode attention alone (ops.attention over every layer, 1 token per sequence), cpu_kernels numpy "
                  "vs numba, over the dense slot store and the paged pool (shuffled blocks of bs positions):", "",
                  "| decode attention | kernels | store | ms | GB/s of K/V | share of read bandwidth |",
                  "|---|---|---|---|---|---|"]
        for r in result["attention"]:
            lines.append(f"| {r['batch']} x ctx {r['context']} | {r['kernels']} | {r['store']} | {r['ms']:.2f} | "
                         f"{r['GBps']:.1f} | {r['GBps'] / bw:.0%} |")
    lines += ["", "| prefill | kernels | ms | tokens/s | attention ms | projections ms | transformers ms | vs transformers |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["prefill"]:
        ops, hf = r["ops_ms"], r.get("transformers_ms")
        vs = "" if hf is None else f"{hf:.0f} | {hf / r['step_ms']:.2f}x"
        lines.append(f"| {r['batch']} x {r['length']} | {r.get('kernels', '')} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{ops['attention']:.0f} | {ops.get('linear', 0) + ops.get('fused_linear', 0):.0f} | "
                     f"{vs or ' | '} |")
    gemm = result.get("gemm")
    if gemm:
        lines += ["", f"Projections alone (ops.linear over the {gemm['matrices']} weight matrices, "
                  f"{gemm['weight_bytes'] / 1e6:.0f} MB; the BLAS's float32 GEMM peak on 2048^3: "
                  f"{gemm['peak_GFLOPs']:.0f} GFLOP/s; roofline = max(bytes / read bandwidth, FLOPs / peak)):", "",
                  "| tokens | roofline ms | numba ms | numba GB/s | numba share of roofline | numpy ms | numpy GB/s "
                  "| numpy share of roofline |", "|---|---|---|---|---|---|---|---|"]
        for r in gemm["rows"]:
            cells = [f"{r[k]['ms']:.1f} | {r[k]['weight_GBps']:.1f} | {r[k]['roofline_share']:.0%}"
                     for k in ("numba", "numpy")]
            lines.append(f"| {r['tokens']} | {r['roofline_ms']:.1f} | {cells[0]} | {cells[1]} |")
        quant = gemm.get("quantized_1_token")
        if quant:
            lines += ["", "1 token, numba: float32 against quantized weights (int4: the matrices whose inputs divide "
                      "into groups of 64):", "", "| weights | matrices | MB | ms | GB/s of weights |",
                      "|---|---|---|---|---|"]
            lines += [f"| {mode} | {q['matrices']} | {q['weight_bytes'] / 1e6:.0f} | {q['ms']:.1f} | "
                      f"{q['weight_bytes'] / q['ms'] / 1e6:.1f} |" for mode, q in quant.items()]
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", default="128,400,1024")
    p.add_argument("--prefill", default="16x128,8x414")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gemm", default="1,2,4,8,16,32,64",
                   help="token counts of the projections-alone table (\"\" = none)")
    p.add_argument("--store", choices=("slots", "paged"), default="slots",
                   help="the KV store: NumPy's dense slots (what `hpcinfer run` uses) or the paged pool")
    p.add_argument("--cpu-kernels", choices=("auto", "numba", "numpy"), default="auto",
                   help="[runtime] cpu_kernels of the decode and prefill steps (the projections table runs both)")
    p.add_argument("--attention-blocks", default=str(BLOCK),
                   help="block sizes of the paged pools in the attention-alone table, e.g. 16,128")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    shapes = [tuple(int(v) for v in x.split("x")) for x in args.prefill.split(",") if x]     # "" = no prefill
    longest = max(contexts + [n for _, n in shapes]) + 2
    steps = Steps(CHECKPOINT, max([args.batch] + [b for b, _ in shapes]), longest, args.store, args.cpu_kernels)
    bw = Bandwidth(2**30)
    bw.run(1)
    kernels = {k: bw.nbytes / median(t) / 1e9 for k, t in bw.run(4).items()}      # GB/s, median of 4 per kernel
    bandwidth = max(kernels.values())                                                 # the best kernel's
    bw.release()
    result = {"schema": "hpcinfer-bench-cpu-ops/1", "date": _dt.date.today().isoformat(), "commit": git_commit(),
              "machine": machine_info(), "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)),
              "bandwidth_GBps": bandwidth, "bandwidth_kernels_GBps": kernels, "store": args.store,
              "cpu_kernels": steps.model.ops.cpu_kernels}
    result["decode"] = decode_rows(steps, args.batch, contexts, args.repeats)
    blocks = tuple(int(x) for x in args.attention_blocks.split(",") if x)
    result["attention"] = attention_rows(steps.model, args.batch, contexts, args.repeats, blocks)
    result["gemm"] = gemm_rows(steps.model, [int(x) for x in args.gemm.split(",") if x], args.repeats, bandwidth,
                               result["threads"])
    hf = None if args.no_hf else Transformers(str(GGUF))
    result["prefill"] = [row for kernels in ("numpy", "numba")
                         for row in prefill_rows(steps, shapes, args.repeats, hf, kernels)]
    write_results(args.out, "cpu-ops", result, report(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
