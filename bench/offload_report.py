"""The offload benchmark's report (offload.py): the markdown tables and the throughput ratios of a record."""

from __future__ import annotations

from . import offload_gpu

MB = 1e6


def _gb(n) -> str:
    return f"{n / 1e9:.2f}"


def markdown(result: dict) -> str:
    s, bw = result["settings"], result["bandwidth"]
    gpu = offload_gpu.describe(result["device"], bw) if s.get("backend") == "cupy" else None
    where = gpu["where"] if gpu else "NumPy backend, one process"
    lines = [f"# Offload benchmark, {result['date']}", "",
             f"SmolLM2-135M {'float32, int8 and int4 (`[model] quantize`, group 64)' if s.get('quant') else 'float32'}"
             f" ({s['model_bytes'] / MB:.0f} MB of float32 weights, {s['layers']} layers of "
             f"{s['layer_bytes'] / MB:.1f} MB), batch {s['batch']} x {s['prompt_len']} prompt tokens, "
             f"{s['new_tokens']} generated tokens each, greedy; device budget {s['device_memory'] / MB:.0f} MB "
             f"(the model is {s['model_bytes'] / s['device_memory']:.1f}x the budget). {where}, "
             f"{result['machine']['cpus_usable']} CPUs ({result['machine']['cpu_model']}).", "",
             f"Measured tier bandwidths: host read {bw['host_read'] / 1e9:.2f} GB/s (memcpy "
             f"{bw['memcpy'] / 1e9:.2f}), disk read warm {bw['disk_read_warm'] / 1e9:.2f} GB/s, cold "
             f"{bw['disk_read_cold'] / 1e9:.2f} GB/s." + (f" {gpu['links']}" if gpu else ""), "",
             "Each row is the fastest of its whole runs (every run's time and the CPUs other processes used "
             "meanwhile are in the JSON: `samples_s`, `samples_other_cpus`)." + _load_note(result["runs"]), "",
             "| run | what | tokens/s | run s (prefill + decode) | weights GB from host / disk | KV GB moved | "
             "transfer floor s | floor / run | peak device weights MB | plan device MB | runs (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        plan = f"{r['plan_device_bytes'] / MB:.0f}" if r["plan_device_bytes"] else "-"
        lines.append(
            f"| {r['name']} | {r['role']} | {r['tokens_per_s']:.2f} | {r['run_s']:.1f} ({r['prefill_s']:.1f} + "
            f"{r['decode_s']:.1f}) | {_gb(r['weights_bytes_from_host'])} / {_gb(r['weights_bytes_from_disk'])} | "
            f"{_gb(r['kv_bytes_to_device'] + r['kv_bytes_to_host'])} | {r['floor_s']:.2f} | "
            f"{r['floor_fraction']:.0%} | {r['weights_peak_device_bytes'] / MB:.0f} | {plan} | "
            f"{', '.join(f'{x:.1f}' for x in r['samples_s'])} |")
    lines += ["", "Ratios (throughput, same run):", ""]
    for key, value in result["ratios"].items():
        lines.append(f"- {key}: {value:.2f}" if isinstance(value, float) else f"- {key}: {value}")
    lines += ["", f"Policy search: {result['policy_search']}", "",
              f"Checks: {result['checks']}", ""]
    lines += [(gpu["note"] if gpu else
               "Notes: on the NumPy backend the device and the host are the same memory, so a host->device "
               "transfer is a memcpy and CPU attention saves only that copy; the disk reads come from the page "
               "cache (the files were just written; the cold figure is the floor if they did not).") +
              " FlexGen reports 7.32 vs 0.60 tokens/s (12x) for its policy against ZeRO-Inference with OPT-30B on "
              "a T4, where PCIe, not compute, bounds the run.", ""]
    if s.get("kv_quant"):
        lines += ["Quantized KV cache (`[model] kv_cache`, group 64): the zig-zag's host cache and its device "
                  "staging cache hold the packed values with a float16 scale and minimum per group, and the loads "
                  "and stores move them as they are, so the KV bytes moved fall by 4 x head_dim / row bytes "
                  "(3.76x int8, 7.11x int4 at head_dim 64); attention dequantizes the rows it reads.", ""]
    if s.get("quant"):
        lines += ["Quantized weights: the tiers move the QuantizedTensors (q, scale, min), so the bytes read from "
                  "host memory or disk fall by the format's ratio" + (
                      "; the throughput gain of moving fewer bytes shows where the link is the bottleneck "
                      "(transfer floor / run)." if gpu else
                      "; on the NumPy backend each int8 / int4 matmul dequantizes its weight first, so compute, "
                      "not the transfer, bounds these runs, and the throughput gain of moving fewer bytes shows "
                      "only where the link is the bottleneck (transfer floor / run)."), ""]
    return "\n".join(lines)


def _load_note(runs: list) -> str:
    """The other processes' CPU use during the runs, when it was large enough to matter."""
    other = [x for r in runs for x in r.get("samples_other_cpus") or [] if x is not None]
    if not other or max(other) < 0.5:
        return ""
    return (f" Other processes used {min(other):.2f} to {max(other):.2f} CPUs during the runs: the times, and "
            "the throughput ratios, carry that noise; the bytes moved do not.")


def ratios(runs: dict) -> dict:
    def r(a, b):
        return runs[a]["tokens_per_s"] / runs[b]["tokens_per_s"] if a in runs and b in runs else None

    out = {
        "host: zig-zag / row (FlexGen vs ZeRO-Inference, same GPU batches)": r("host: zig-zag", "host: row"),
        "disk: zig-zag / row": r("disk: zig-zag", "disk: row"),
        "host: zig-zag / no overlap (prefetch 1 vs 0)": r("host: zig-zag", "host: zig-zag, no overlap"),
        "host: zig-zag, BLAS threads - 1 / no overlap": r("host: zig-zag, BLAS threads - 1",
                                                           "host: zig-zag, no overlap"),
        "disk: zig-zag / no overlap": r("disk: zig-zag", "disk: zig-zag, no overlap"),
        "host: zig-zag / row, whole batch": r("host: zig-zag", "host: row, whole batch"),
        "cache host: cpu_attention on / off": r("cache host: zig-zag, cpu_attention", "cache host: zig-zag"),
        "host: zig-zag / all on device": r("host: zig-zag", "all on device"),
        "plan: search_policy / host: row": r("plan: search_policy", "host: row"),
        "plan: search_policy / host: zig-zag": r("plan: search_policy", "host: zig-zag"),
        "plan: search_policy / plan: no overlap": r("plan: search_policy", "plan: no overlap"),
        "plan: search_policy / plan: prefetch 1": r("plan: search_policy", "plan: prefetch 1"),
        "plan: search_policy / plan: no CPU attention": r("plan: search_policy", "plan: no CPU attention"),
        "plan: search_policy / plan: row schedule": r("plan: search_policy", "plan: row schedule"),
    }
    rows = [runs[n] for n in ("host: row", "host: row, whole batch") if n in runs]
    if rows and "plan: search_policy" in runs:              # the fairest baseline: row's best at the same budget
        best = max(rows, key=lambda run: run["tokens_per_s"])
        out[f"plan: search_policy / best row-by-row ({best['name']})"] = (
            runs["plan: search_policy"]["tokens_per_s"] / best["tokens_per_s"])
    zz, row = runs.get("host: zig-zag"), runs.get("host: row")
    if zz and row:
        out["weight bytes, row / zig-zag"] = row["weights_bytes_from_host"] / zz["weights_bytes_from_host"]
    return {k: v for k, v in out.items() if v is not None}


def quant_ratios(runs: dict) -> dict:
    """--quant: weight bytes moved and throughput of int8 / int4 against float32, per tier."""
    out = {}
    for tier, key in (("host", "weights_bytes_from_host"), ("disk", "weights_bytes_from_disk")):
        base = runs.get(f"float32: {tier} zig-zag")
        for mode in ("int8", "int4"):
            run = runs.get(f"{mode}: {tier} zig-zag")
            if base and run and run[key]:
                out[f"{tier}: float32 / {mode} weight bytes moved"] = base[key] / run[key]
                out[f"{tier}: {mode} / float32 tokens/s"] = run["tokens_per_s"] / base["tokens_per_s"]
    for mode in ("float32", "int8", "int4"):
        ref, run = runs.get(f"{mode}: all on device"), runs.get(f"{mode}: host zig-zag")
        if ref and run:
            out[f"{mode}: host zig-zag / all on device tokens/s"] = run["tokens_per_s"] / ref["tokens_per_s"]
    return out


def kv_ratios(runs: dict) -> dict:
    """--kv-quant: KV bytes moved and throughput of int8 / int4 caches against float32 (zig-zag, cache on host)."""
    out = {}
    base = runs.get("KV float32: cache host zig-zag")
    for mode in ("int8", "int4"):
        run = runs.get(f"KV {mode}: cache host zig-zag")
        if base and run and run["kv_bytes_to_device"]:
            moved = (base["kv_bytes_to_device"] + base["kv_bytes_to_host"]) / (run["kv_bytes_to_device"] +
                                                                                run["kv_bytes_to_host"])
            out[f"float32 / {mode} KV bytes moved"] = moved
            out[f"{mode} / float32 tokens/s"] = run["tokens_per_s"] / base["tokens_per_s"]
    return out
