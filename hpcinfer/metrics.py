"""The metrics of one run: config echo, mesh, timings, tokens/s, achieved bandwidth and FLOP rate, and the
pipeline's per-stage busy time and bubble fraction. Built on rank 0 from every rank's RankReport."""

from __future__ import annotations

import dataclasses
import math
import resource
import sys

import numpy as np

from .arch import tensor_shapes
from .parallel.layers import weight_bytes


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (host memory high-water mark)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024            # Linux reports KiB, macOS bytes


def stored_matmul_params(arch) -> int:
    """Parameters of the matrices a token may go through, every expert counted (not the position table, nor the
    embedding lookup when the LM head is separate): the weights a rank reads, for the byte estimate."""
    total = arch.param_count()
    if arch.position == "learned":
        total -= arch.max_positions * arch.hidden_size
    if not arch.tied_embeddings:
        total -= arch.vocab_size * arch.hidden_size
    return total


def matmul_params(arch) -> int:
    """Parameters that take part in a matmul per token, 2 FLOPs each: stored_matmul_params with, in each MoE
    layer, only the top-k of its E experts a token is routed to (k/E of the expert stacks; the router, a PR-MoE
    residual MLP and its mixing coefficients run for every token)."""
    total = stored_matmul_params(arch)
    for name, shape in tensor_shapes(arch).items():
        if ".moe.experts." in name:                                # [E, ...]: a token runs top_k of them
            experts = shape[0]
            total -= math.prod(shape) // experts * (experts - min(arch.moe_top_k, experts))
    return total


# Attributes of a model object that hold no weights of its own (shared handles, rotary tables, the KV cache and
# the offload tiers).
_NOT_WEIGHTS = ("ops", "arch", "tp", "groups", "weights", "cache", "caches", "kv", "rope")


def is_sharded_layer(obj) -> bool:
    """A sharded layer of parallel/layers.py (its weights: a float matrix or a quantized one)."""
    return hasattr(obj, "qw") or hasattr(obj, "qtable")


def weight_leaves(obj, seen: set | None = None):
    """The weights a model (one rank's share) holds, each object once (a tied LM head is the embedding table):
    its sharded layers (and a layer's bias), and every other array reachable from it (norms, biases, MoE expert
    stacks)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, type):                 # a class (a dtype, say) holds no weights
        return
    seen.add(id(obj))
    if is_sharded_layer(obj):
        yield obj
        bias = getattr(obj, "b", None)
        if bias is not None:
            yield from weight_leaves(bias, seen)
    elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):       # an array (NumPy, or the ops' device arrays)
        yield obj
    elif isinstance(obj, (list, tuple, dict)) or hasattr(obj, "__dict__"):
        children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
            [v for k, v in vars(obj).items() if k not in _NOT_WEIGHTS]
        for child in children:
            yield from weight_leaves(child, seen)


def held_weight_bytes(obj) -> int:
    """Bytes of the weights a model (one rank's share) holds, as held: a sharded layer counts what
    parallel.layers.weight_bytes says (its quantized q, scale and min, or its float matrix), any other array its
    nbytes (weight_leaves)."""
    return sum(weight_bytes(x) if is_sharded_layer(x) else int(x.nbytes) for x in weight_leaves(obj))
    seen.add(id(obj))
    if hasattr(obj, "qw") or hasattr(obj, "qtable"):             # a sharded layer (parallel/layers.py)
        extra = getattr(obj, "b", None)
        return weight_bytes(obj) + (int(extra.nbytes) if extra is not None and id(extra) not in seen else 0)
    if hasattr(obj, "nbytes") and hasattr(obj, "shape"):         # an array (NumPy, or the ops' device arrays)
        return int(obj.nbytes)
    if isinstance(obj, (list, tuple)):
        return sum(held_weight_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(held_weight_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(held_weight_bytes(v, seen) for k, v in vars(obj).items() if k not in NOT_WEIGHTS)
    return 0


def dequant_scratch_bytes(ops) -> int:
    """The ops' reused dequantize buffers: weight tiles of NumpyOps.linear_q (`_scratch`) and dequantized KV rows
    (backend/kv_attention.py, `_kv_scratch`); 0 when nothing was dequantized."""
    buffers = [*ops.__dict__.get("_scratch", {}).values(), *ops.__dict__.get("_kv_scratch", {}).values()]
    return sum(int(b.nbytes) for b in buffers)


def held_bytes(model) -> dict:
    """What a rank reports (RankReport.held): {"weights": held_weight_bytes, "dequant_scratch": its ops' buffers,
    "backend": the backend it computed on (numpy / cupy), "streamed_per_step": streamed_bytes_per_step}, and with
    [offload] "offload_peak": the peaks of what its tiers held at once, {tier: bytes}, and
    "offload_peak_parts": {tier: {part: bytes at that peak}} (offload/tiers.TierMemory)."""
    held = {"weights": held_weight_bytes(model), "dequant_scratch": dequant_scratch_bytes(model.ops),
            "backend": getattr(model.ops, "name", None), "streamed_per_step": streamed_bytes_per_step(model)}
    memory = getattr(getattr(model, "weights", None), "memory", None)
    if memory is not None:
        held["offload_peak"] = dict(memory.peak)
        held["offload_peak_parts"] = {tier: dict(parts) for tier, parts in memory.peak_parts.items()}
    return held


def streamed_bytes_per_step(model) -> int:
    """Weight bytes an offloaded rank streams in per token step (of one GPU batch by row, of the block by
    zig-zag): every layer not on the device is fetched once per step, the whole layer on the device even when
    partitioned fetch brings each rank 1/N over the link. Not in held_weight_bytes (dropped after use); 0 without
    [offload]."""
    tiers = getattr(model, "weights", None)
    if tiers is None:
        return 0
    return sum(b for b, tier in zip(tiers.layer_bytes, tiers.tiers) if tier != "device")


def offload_peaks(reports: list) -> dict:
    """The memory section's offload counters: the largest device and host peak of any rank's tiers, and the parts
    of each at that rank's peak (None without [offload])."""
    held = [r.held for r in reports if getattr(r, "held", None) and "offload_peak" in r.held]
    out = {}
    for tier in ("device", "host"):
        top = max(held, key=lambda h: h["offload_peak"][tier], default=None)
        out[f"offload_{tier}_peak_bytes_per_rank"] = top["offload_peak"][tier] if top else None
        out[f"offload_{tier}_peak_parts"] = top["offload_peak_parts"][tier] if top else None
    return out


def weight_bytes_per_rank(config, arch, mesh, reports: list) -> tuple[float, int | None]:
    """(weight bytes per rank, dequantize scratch bytes per rank or None): the bytes the ranks report they hold
    (quantized weights counted as held, the largest rank's), else the float estimate from the parameter count."""
    held = [r.held for r in reports if getattr(r, "held", None)]
    if held:
        return max(h["weights"] for h in held), max(h["dequant_scratch"] for h in held)
    itemsize = 4 if config.model.dtype == "float32" else 2
    return stored_matmul_params(arch) * itemsize / (mesh.shape.tp * mesh.shape.pp), None


def decode_bytes_per_rank(weight_bytes: float, reports: list) -> float:
    """Weight bytes a decode step reads on a rank: what it holds, plus with [offload] the layers it streams in
    each step (the largest rank's)."""
    streamed = max((r.held.get("streamed_per_step", 0) for r in reports if getattr(r, "held", None)), default=0)
    return weight_bytes + streamed


def backend_of(reports: list) -> str | None:
    """The backend the ranks computed on ("numpy" / "cupy", as resolved from [runtime] backend = auto), "mixed"
    if they differ, None when they did not report it."""
    names = {r.held.get("backend") for r in reports if getattr(r, "held", None)} - {None}
    return None if not names else names.pop() if len(names) == 1 else "mixed"


def _stage_rows(reports: list, stages: int) -> list:
    """Per pipeline stage: the slowest rank's busy and waiting time; bubble = waiting / generation time."""
    rows = []
    for s in range(stages):
        mine = [r for r in reports if r.coords[0] == s]
        busy = max(r.times.busy_s for r in mine)
        wait = max(r.times.wait_s for r in mine)
        span = max(r.generate_s for r in mine)
        rows.append({"stage": s, "busy_s": busy, "wait_s": wait,
                     "bubble_fraction": wait / span if span > 0 else 0.0})
    return rows


def _expert_mesh(config, arch) -> dict:
    """The expert axes of an MoE run (ep, expert_tp, the all-to-all variant); nothing for a dense model."""
    if not any(arch.moe_experts):
        return {}
    return {"ep": config.parallel.ep, "expert_tp": config.parallel.expert_tp, "all_to_all": config.moe.all_to_all}


def _percentiles(values) -> dict:
    a = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(a, q)) if a.size else None for q in (50, 90, 99)}


def batching_summary(batch_size: int, firsts: list, lasts: list) -> dict:
    """`[schedule] batching` as it ran, over the dp replicas (a StepTimes each: first and last pipeline stage,
    tp rank 0): occupancy (running sequences / batch_size, over the decode steps while prompts waited), the paged
    KV pool (continuous), preemptions, time to first token and mean time between tokens per sequence (p50, p90,
    p99), and the replicas' busy time (imbalance = max / mean)."""
    steps = sum(t.occupancy_steps for t in firsts)
    blocks = max((t.kv_blocks_total for t in firsts), default=0)          # (the first stage decides)
    samples = sum(t.kv_block_samples for t in firsts)
    busy = [t.busy_s for t in firsts]
    return {
        "mode": lasts[0].batching if lasts else None,
        "occupancy": sum(t.occupancy_running for t in firsts) / (steps * batch_size) if steps else None,
        "kv_pool_blocks": blocks,
        "kv_pool_peak_fraction": max(t.kv_blocks_peak for t in firsts) / blocks if blocks else None,
        "kv_pool_mean_fraction": sum(t.kv_blocks_sum for t in firsts) / samples / blocks if blocks else None,
        "preemptions": sum(t.preemptions for t in firsts),
        "time_to_first_token_s": _percentiles([x for t in lasts for x in t.ttft_s]),
        "token_latency_s": _percentiles([x for t in lasts for x in t.token_latency_s]),
        "replica_busy_s": busy,
        "replica_imbalance": max(busy) / float(np.mean(busy)) if busy and np.mean(busy) > 0 else None,
    }


def summarize(config, arch, mesh, reports: list, load_s: float, total_s: float, threads: int) -> dict:
    P = mesh.shape.pp
    firsts = [r.times for r in reports if r.coords[0] == 0 and r.coords[2] == 0]        # one per dp replica
    lasts = [r.times for r in reports if r.coords[0] == P - 1 and r.coords[2] == 0]
    decode = np.concatenate([np.asarray(t.decode_s) for t in firsts]) if firsts else np.zeros(0)
    prompt_tokens = sum(t.prompt_tokens for t in lasts)
    generated = sum(t.generated_tokens for t in lasts)
    generate_s = max(r.generate_s for r in reports)
    prefill_s = max((t.prefill_s for t in firsts + lasts), default=0.0)   # (continuous: the first stage's steps)
    weight_bytes, scratch_bytes = weight_bytes_per_rank(config, arch, mesh, reports)
    median_step = float(np.median(decode)) if decode.size else float("nan")
    stages = _stage_rows(reports, P)
    return {
        "config": dataclasses.asdict(config),
        "mesh": {"world": mesh.world.size, "pp": P, "dp": mesh.shape.dp, "tp": mesh.shape.tp,
                 "ranks_per_node": mesh.ranks_per_node, "threads_per_rank": threads,
                 "backend": backend_of(reports), **_expert_mesh(config, arch)},
        "model": {"family": arch.family, "parameters": arch.param_count(), "layers": arch.num_layers,
                  "hidden": arch.hidden_size, "vocab": arch.vocab_size},
        "load_s": load_s,
        "generate_s": generate_s,
        "total_s": total_s,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "tokens_per_s": generated / generate_s if generate_s > 0 else 0.0,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_steps": int(decode.size),
        "decode_step_ms": {"median": median_step * 1e3,
                           "p90": float(np.percentile(decode, 90)) * 1e3 if decode.size else float("nan")},
        "decode_weight_bandwidth_GBps_per_rank": (decode_bytes_per_rank(weight_bytes, reports) / median_step / 1e9
                                                  if decode.size else 0.0),
        "flop_rate_GFLOPs_per_rank": (2 * matmul_params(arch) * (prompt_tokens + generated) / mesh.world.size
                                      / generate_s / 1e9) if generate_s > 0 else 0.0,
        "pipeline": {
            "prompt_phase_s": prefill_s,
            "gen_phase_s": max((t.gen_phase_s for t in lasts), default=0.0),
            "bubble_fraction": float(np.mean([s["bubble_fraction"] for s in stages])),
            "stages": stages,
        },
        "offload": {
            "weights_peak_device_bytes_per_rank": max(r.times.weights_peak_device_bytes for r in reports),
            "weights_bytes_from_host": sum(r.times.weights_bytes_from_host for r in reports),
            "weights_bytes_from_disk": sum(r.times.weights_bytes_from_disk for r in reports),
        },
        "memory": {
            "host_peak_rss_bytes_per_rank": max(getattr(r, "peak_rss_bytes", 0) for r in reports),
            "weight_bytes_per_rank": int(weight_bytes),              # as held: quantized weights at their size
            "dequant_scratch_bytes_per_rank": scratch_bytes,           # None when the ranks did not report it
            **offload_peaks(reports),                                  # what the offload tiers held at once
        },
        "batching": batching_summary(config.generate.batch_size, firsts, lasts),
        "kv_cache": {
            "peak_device_bytes_per_rank": max(r.times.kv_peak_device_bytes for r in reports),
            "offloaded_bytes_to_host": sum(r.times.kv_bytes_to_host for r in reports),
            "fetched_bytes_to_device": sum(r.times.kv_bytes_to_device for r in reports),
            "delegated_bytes_to_host": sum(r.times.attention_bytes_to_host for r in reports),
            "delegated_bytes_to_device": sum(r.times.attention_bytes_to_device for r in reports),
        },
        "activations": {                                  # zig-zag hidden states ([offload] act_gpu / act_cpu)
            "peak_device_bytes_per_rank": max(r.times.act_peak_device_bytes for r in reports),
            "offloaded_bytes_to_host": sum(r.times.act_bytes_to_host for r in reports),
            "fetched_bytes_to_device": sum(r.times.act_bytes_to_device for r in reports),
        },
        "cuda_graphs": {                                  # [runtime] cuda_graphs (generate/graphs.py); 0 when off
            "captures_per_rank": max(getattr(r.times, "graph_captures", 0) for r in reports),
            "replays_per_rank": max(getattr(r.times, "graph_replays", 0) for r in reports),
            "eager_steps_per_rank": max(getattr(r.times, "graph_eager_steps", 0) for r in reports),
        },
    }
