"""The figures of one run, from its metrics JSON (hpcinfer/metrics.py, docs/formats.md) or from the transformers
baseline's own timings, and their medians over rounds."""

from __future__ import annotations

import time

import numpy as np

from ...config import load_config
from ...offload.budget import plan_bytes
from ...parallel.stages import partition_layers
from ...preflight import open_model_source
from ...quant.storage import configure, quant_of
from ..common import median

# Figures whose median over rounds the results keep (memory is the same in every round: the last run's is kept).
TIMED = ("prompt_latency_ms", "per_token_ms_median", "per_token_ms_p90", "tokens_per_s", "tflops_per_rank",
         "bandwidth_GBps_per_rank", "bandwidth_utilization", "bubble_fraction", "generate_s", "load_s")


def run_backend(m: dict) -> str | None:
    """The backend a job ran on: the metrics' own `backend` (the resolved Ops), else the config it echoes when
    that names one (the bench writes `[runtime] backend` explicitly into every cell's config); None if neither."""
    if m.get("backend") in ("numpy", "cupy"):
        return m["backend"]
    echoed = ((m.get("config") or {}).get("runtime") or {}).get("backend")
    return echoed if echoed in ("numpy", "cupy") else None


def from_metrics(m: dict, ranks_on_node: int, machine_GBps: float | None, device_total: int | None = None,
                 backend: str | None = None) -> dict:
    """One hpcinfer job's figures (schema hpcinfer-bench/2). bandwidth_utilization = the weight bytes all ranks
    of a node stream per decode step / the machine's measured read bandwidth (decode reads every weight once per
    step). device_total: an offloaded job's bytes on the device per rank (offload_device_bytes), kept as
    device_total_bytes_per_rank: its device_weights figure is only the streamed weights' peak. backend: the one
    the cell asked for, used only when the metrics do not say. A figure that does not apply is None with its
    reason in `null_reasons` (never a silent 0)."""
    bw = m["decode_weight_bandwidth_GBps_per_rank"]
    offload, kv, mem = m.get("offload", {}), m.get("kv_cache", {}), m.get("memory", {})
    device_weights = offload.get("weights_peak_device_bytes_per_rank") or mem.get("weight_bytes_per_rank")
    backend = run_backend(m) or backend
    reasons = {}
    if backend == "cupy":
        util = None
        reasons["bandwidth_utilization"] = ("the cells ran on the GPU and machine.memory_read is the host's "
                                            "read bandwidth: no device bandwidth to compare with")
    elif machine_GBps:
        util = bw * ranks_on_node / machine_GBps
    else:
        util = None
        reasons["bandwidth_utilization"] = "the machine's read bandwidth was not measured"
    pp = m["mesh"]["pp"]
    bubble = m["pipeline"]["bubble_fraction"] if pp > 1 else None
    if bubble is None:
        reasons["bubble_fraction"] = "pp = 1: no pipeline stages to wait for"
    memory = {"device_weights_bytes_per_rank": device_weights,
              "device_kv_peak_bytes_per_rank": kv.get("peak_device_bytes_per_rank"),
              "host_peak_rss_bytes_per_rank": mem.get("host_peak_rss_bytes_per_rank"),
              "weights_from_host_bytes": offload.get("weights_bytes_from_host"),
              "weights_from_disk_bytes": offload.get("weights_bytes_from_disk"),
              "device_total_bytes_per_rank": device_total}
    for tier, value in memory.items():
        if value is None:
            reasons[f"memory.{tier}"] = MEMORY_NULL.get(tier, "the job's metrics do not report it")
    out = {
        "prompt_latency_ms": m["prefill_s"] * 1e3,
        "per_token_ms_median": m["decode_step_ms"]["median"],
        "per_token_ms_p90": m["decode_step_ms"]["p90"],
        "tokens_per_s": m["tokens_per_s"],
        "tflops_per_rank": m["flop_rate_GFLOPs_per_rank"] / 1e3,
        "bandwidth_GBps_per_rank": bw,
        "bandwidth_utilization": util,
        "bubble_fraction": bubble,
        "generate_s": m["generate_s"],
        "load_s": m["load_s"],
        "memory": memory,
        "mesh": m["mesh"],
        "backend": backend,
    }
    if reasons:
        out["null_reasons"] = reasons
    return out


# Why a memory tier is null when the job did not report it (the usual, expected cases).
MEMORY_NULL = {
    "device_total_bytes_per_rank": "no [offload]: the device holds the resident weights and the KV cache, counted "
                                   "above",
    "host_peak_rss_bytes_per_rank": "the job's metrics do not report the ranks' peak resident set",
}


def offload_device_bytes(config_path: str, prompt_lengths: list) -> int | None:
    """What an offloaded job holds on the device per rank, as its budget check counts it before it runs
    (offload/budget.plan_bytes: resident layers, streaming window, embedding tables, KV cache on the device and
    its staging; the largest stage). None when the job's config has no active [offload]."""
    config = load_config(str(config_path))
    if not config.offload.active:
        return None
    ckpt = open_model_source(config.model)
    try:
        configure(ckpt, config.model.quantize, config.model.quantize_group)
        quantized = quant_of(ckpt)
        stages = partition_layers(ckpt.arch, config.parallel.pp, config.path)
        return max(int(plan_bytes(ckpt.arch, config, s, prompt_lengths, quantized)["device"]) for s in stages)
    finally:
        close = getattr(ckpt, "close", None)
        if close is not None:
            close()


def from_steps(prefill_s: float, steps: list, batch: int, new_tokens: int) -> dict:
    """The transformers baseline's figures from its prefill time and decode step times (one process)."""
    total = prefill_s + sum(steps)
    return {"prompt_latency_ms": prefill_s * 1e3,
            "per_token_ms_median": median(steps) * 1e3,
            "per_token_ms_p90": float(np.percentile(steps, 90)) * 1e3 if steps else float("nan"),
            "tokens_per_s": batch * new_tokens / total if total > 0 else 0.0,
            "generate_s": total}


def medians(runs: list[dict]) -> dict:
    """Median over rounds of every timed figure present; a figure null in every round stays null (with its
    reason); memory, mesh, backend and the null reasons from the last round."""
    out = {}
    for key in TIMED:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = median(values)
        elif key in runs[-1]:
            out[key] = None
    for key in ("memory", "mesh", "backend"):
        if key in runs[-1]:
            out[key] = runs[-1][key]
    reasons = {k: v for k, v in (runs[-1].get("null_reasons") or {}).items()
               if k.startswith("memory.") or out.get(k) is None}
    if reasons:
        out["null_reasons"] = reasons
    return out


def ratios(base: dict, ours: dict) -> dict:
    """How much better hpcinfer is than a baseline (> 1: hpcinfer is better): baseline time / hpcinfer time for
    latencies, hpcinfer / baseline for tokens/s."""
    out = {}
    for key in ("prompt_latency_ms", "per_token_ms_median", "per_token_ms_p90"):
        if base.get(key) and ours.get(key):
            out[key] = base[key] / ours[key]
    if base.get("tokens_per_s") and ours.get("tokens_per_s"):
        out["tokens_per_s"] = ours["tokens_per_s"] / base["tokens_per_s"]
    return out


def read_bandwidth_GBps(nbytes: int = 256 * 2**20, passes: int = 5) -> dict:
    """The machine's memory read bandwidth as the benchmarks' decode sees it: NumPy A @ x (BLAS sgemv reads every
    byte of A once) over a float32 matrix A of `nbytes` (every page written first), all threads; best pass."""
    cols = 4096
    a = np.empty((max(1, nbytes // (4 * cols)), cols), dtype=np.float32)
    a.fill(1.0)
    x = np.ones(cols, dtype=np.float32)
    times = []
    for _ in range(passes + 1):                         # the first pass warms up
        t0 = time.perf_counter()
        a @ x
        times.append(time.perf_counter() - t0)
    best = min(times[1:])
    return {"GBps": a.nbytes / best / 1e9, "bytes": a.nbytes, "passes": passes,
            "method": "NumPy A @ x over a float32 matrix (BLAS sgemv), all threads, best of the passes"}
