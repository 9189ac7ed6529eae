"""Quantization benchmark (issue 7, `make bench-quant`): SmolLM2 in one process, per mode: checkpoint size on
disk, resident weight bytes (on the GPU: device bytes and cupy's memory pool), KV-cache bytes, decode time per
token at batch 1 and batch 16, and each figure's ratio to the float baseline measured in the same run.

Backends (`--backend`):
  numpy   the float baseline is float32; writes bench/results/quant-<YYYY-MM-DD>.{json,md}
  cupy    one GPU; the float baseline is float16 (norms and unquantized weights stored float16 in every mode);
          each decode step measured eagerly and, with `--cuda-graphs` (default on), replayed as a CUDA graph;
          writes bench/results/quant-gpu-<YYYY-MM-DD>.{json,md}

Modes (the float mode is float32 or float16 by backend):
  float          models/smollm2.h5 (made by `make model`), loaded in the backend's float dtype
  int8           `hpcinfer convert <gguf> --quantize int8` (per-row symmetric int8, stored quantized)
  int4-g64       `hpcinfer convert <gguf> --quantize int4 --group-size 64`
  asym8-g64      `hpcinfer convert <gguf> --quantize asym8 --group-size 64` (group-wise asymmetric 8-bit)
  q4_1-kept      `hpcinfer convert <gguf> --keep-quantized` (GGUF Q4_1 blocks as they are, groups of 32)
  float+kv-int4, int4-g64+kv-int4   the same weights with `[model] kv_cache = "int4"` (groups of 64)
  float+kv-int8  `[model] kv_cache = "int8"` (groups of 64)
  float+topk-0.1, int4-g64+kv-int4+topk-0.1   `[generate] attention_topk = 0.1` (top-k sparse decode attention;
                 on cupy its graphed steps are refused, as `[runtime] cuda_graphs` refuses top-k: eager figures only)
A mode is its weights, then "+"-joined attention options: kv-int4 | kv-int8, topk-<fraction>.
The quantized checkpoints are converted into a temporary directory from models/SmolLM2-135M-Instruct.Q4_1.gguf
(the float32 file is that GGUF dequantized, so every mode starts from the same weight values).

Every model is loaded first; then `--rounds` rounds, each running every mode in turn (so a load that drifts
during the run hits all modes alike), each mode one generation per batch size of `--new-tokens` tokens after a
`--prompt`-token prompt (consecutive slices of pydoc_data/topics.py). Decode time per token: the median over
rounds of each generation's median decode step (one token per sequence), divided by the batch; a step ends when
its tokens are on the host (which waits for the GPU), and the device is synchronized before each generation.
Resident weight bytes: every array the model object holds (the quantized arrays as stored, norms, rotary tables),
not the ops' reused scratch, which is reported on its own (the largest dequantized tile / KV rows of one layer).
KV bytes: the cache of the batch-16 run (prompt + new tokens per sequence).

    python -m bench.quant [--backend numpy|cupy] [--rounds 3] [--new-tokens 8] [--prompt 32]
                                           [--out bench/results] [--checkpoint models/smollm2.h5]
                                           [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf]

Prints the table. Timings on a shared machine are inflated (the report says how busy it was); the lead may re-run
it on a quiet one.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcinfer.api import generate, load_model
from hpcinfer.bench.common import git_commit, loadavg, machine_info, make_prompts
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.generate.engine import StepTimes
from hpcinfer.generate.tokenizer import TextTokenizer

from . import REPO
from .device import device_info, pool_used_bytes, sync_device
from .results import write_results

H5 = REPO / "models" / "smollm2.h5"
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT = {"int8": ["--quantize", "int8"], "int4-g64": ["--quantize", "int4", "--group-size", "64"],
           "asym8-g64": ["--quantize", "asym8", "--group-size", "64"], "q4_1-kept": ["--keep-quantized"]}
FLOAT = {"numpy": "float32", "cupy": "float16"}          # the float baseline (and the storage dtype) per backend
BATCHES = (1, 16)
KV_GROUP = 64


def modes_for(backend: str) -> tuple:
    """Every mode of a backend; the first is the float baseline the ratios divide by."""
    f = FLOAT[backend]
    return (f, "int8", "int4-g64", "asym8-g64", "q4_1-kept", f"{f}+kv-int4", "int4-g64+kv-int4", f"{f}+kv-int8",
            f"{f}+topk-0.1", "int4-g64+kv-int4+topk-0.1")


def weights_of(mode: str) -> str:
    return mode.partition("+")[0]


def attention_of(mode: str) -> tuple[str, float]:
    """(KV cache format, top-k fraction) of a mode's "+" options: kv-int4 | kv-int8, topk-<fraction in (0, 1]>."""
    kv, topk = "none", 0.0
    for part in mode.split("+")[1:]:
        name, _, value = part.partition("-")
        if name == "kv" and value in ("int4", "int8"):
            kv = value
        elif name == "topk" and _fraction(value) is not None:
            topk = _fraction(value)
        else:
            raise SystemExit(f"bench.quant: mode {mode!r}: unknown option {part!r}; options are kv-int4, kv-int8 "
                             f"and topk-<fraction in (0, 1]>")
    return kv, topk


def _fraction(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= 1 else None


def log(msg: str) -> None:
    print(f"[bench.quant {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def checkpoint_for(weights: str, tmp: Path, h5: Path = H5, gguf: Path = GGUF) -> Path:
    """The checkpoint file of a weight mode (converted once into tmp from the GGUF)."""
    if weights in FLOAT.values():
        return h5
    out = tmp / f"smollm2-{weights}.h5"
    if not out.exists():
        cmd = [sys.executable, "-m", "hpcinfer", "convert", str(gguf), str(out), *CONVERT[weights]]
        log("converting: " + " ".join(cmd[2:]))
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench.quant: convert failed:\n{proc.stdout}\n{proc.stderr}")
    return out


def _is_array(obj, device_type) -> bool:
    return isinstance(obj, np.ndarray) or (device_type is not None and isinstance(obj, device_type))


def resident_bytes(obj, seen=None, device_only: bool = False, device_type=None) -> int:
    """Bytes of every array (NumPy, or the ops' device arrays) reachable from the model's attributes, each counted
    once, the ops excluded. device_only: only the device arrays (what the weights hold on the GPU)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if _is_array(obj, device_type):
        if device_only and isinstance(obj, np.ndarray):
            return 0
        base = getattr(obj, "base", None)
        return int(obj.nbytes) if base is None or id(base) not in seen else 0
    if isinstance(obj, (list, tuple)):
        return sum(resident_bytes(x, seen, device_only, device_type) for x in obj)
    if isinstance(obj, dict):
        return sum(resident_bytes(x, seen, device_only, device_type) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(resident_bytes(v, seen, device_only, device_type) for k, v in vars(obj).items()
                   if k not in ("ops", "arch", "tp", "groups"))
    return 0


def scratch_bytes(ops) -> int:
    """The ops' reused buffers: dequantized weight tiles (linear_q) and dequantized KV rows (kv_attention)."""
    bufs = list(ops.__dict__.get("_scratch", {}).values()) + list(ops.__dict__.get("_kv_scratch", {}).values())
    return sum(int(b.nbytes) for b in bufs)


def run_batch(model, prompts: list, new_tokens: int, cuda_graphs: bool = False):
    """(median decode step s, KV bytes, generated ids) of one generation as `hpcinfer run` generates by default
    (continuous batching, every prompt running; the device synchronized first)."""
    times = StepTimes()
    sync_device(model.ops)
    out = generate(model, prompts, new_tokens, cuda_graphs=cuda_graphs, times=times)
    sync_device(model.ops)
    return float(np.median(times.decode_s)), times.kv_peak_device_bytes, out


def load_mode_model(mode: str, path: Path, backend: str):
    """A mode's SmolLM2 model on the backend: the checkpoint of its weights in the backend's float dtype (quantized
    ones as stored), with its KV format and top-k attention (`[model] kv_cache`, `[generate] attention_topk`)."""
    kv, topk = attention_of(mode)
    return load_model(str(path), dtype=FLOAT[backend], backend=backend, kv_cache=kv, kv_cache_group=KV_GROUP,
                      attention_topk=topk)


def new_record(mode: str, model, checkpoint: Path | None, pool_load_bytes: int | None) -> dict:
    """A mode's record before the rounds: what it stores, on disk, on the host and on the device."""
    dev = getattr(model.ops.xp, "ndarray", None) if model.ops.name == "cupy" else None
    return {"mode": mode, "backend": model.ops.name, "ops": type(model.ops).__name__,
            "checkpoint": checkpoint.name if checkpoint else None,
            "checkpoint_bytes": checkpoint.stat().st_size if checkpoint else None,
            "resident_weight_bytes": resident_bytes(model, device_type=dev),
            "device_weight_bytes": resident_bytes(model, device_only=True, device_type=dev) if dev else None,
            "device_pool_load_bytes": pool_load_bytes,
            "decode_step_s": {str(b): [] for b in BATCHES}}


def load_modes(modes: list, tmp: Path, backend: str, h5: Path = H5, gguf: Path = GGUF) -> tuple[dict, dict]:
    """Every mode's model, each loaded once: (models, records), both by mode."""
    models, records, used = {}, {}, 0
    for mode in modes:
        path = checkpoint_for(weights_of(mode), tmp, h5, gguf)
        t0 = time.perf_counter()
        models[mode] = load_mode_model(mode, path, backend)
        now = pool_used_bytes(models[mode].ops)                  # None on NumPy
        pool_load = None if now is None else now - used
        used = now or 0
        log(f"{mode}: loaded in {time.perf_counter() - t0:.1f} s")
        records[mode] = new_record(mode, models[mode], path, pool_load)
    return models, records


def measure_round(mode: str, model, record: dict, prompts: list, new_tokens: int, cuda_graphs: bool) -> None:
    """One round of one mode: a generation at each batch size (eager, then graphed when asked); appends the median
    decode step of each. A mode whose graphed decode fails keeps its eager figures and the error."""
    for batch in BATCHES:
        step, kv_bytes, tokens = run_batch(model, prompts[:batch], new_tokens)
        record["decode_step_s"][str(batch)].append(step)
        record[f"kv_bytes_b{batch}"], record[f"tokens_b{batch}"] = kv_bytes, tokens
        if cuda_graphs and "graphs_error" not in record:
            try:
                step, _, graph_tokens = run_batch(model, prompts[:batch], new_tokens, cuda_graphs=True)
            except Exception as e:  # noqa: BLE001 - one mode's capture failure must not lose the whole run
                record["graphs_error"] = f"{type(e).__name__}: {e}"
                log(f"{mode}: CUDA graphs failed at batch {batch}: {record['graphs_error']}")
                continue
            record.setdefault("decode_graph_step_s", {str(b): [] for b in BATCHES})[str(batch)].append(step)
            record[f"graph_tokens_equal_b{batch}"] = graph_tokens == tokens
    record["scratch_bytes"] = max(record.get("scratch_bytes", 0), scratch_bytes(model.ops))


def run_modes(models: dict, records: dict, modes: list, prompts: list, rounds: int, new_tokens: int,
              cuda_graphs: bool = False) -> list:
    """The rounds (each runs every mode in turn: drifting load hits all alike) over each mode's model (`models`, by
    mode) -> the summarized records, ratios to modes[0] (the float baseline) added."""
    for r in range(rounds):
        for mode in modes:
            measure_round(mode, models[mode], records[mode], prompts, new_tokens, cuda_graphs)
        log(f"round {r + 1} of {rounds} done")
    results = [summarize_mode(records[m]) for m in modes]
    add_ratios(results)
    return results


def _per_token_ms(steps: dict) -> dict:
    return {b: float(np.median(s)) / int(b) * 1e3 for b, s in steps.items() if s}


def summarize_mode(record: dict) -> dict:
    record["decode_ms_per_token"] = _per_token_ms(record["decode_step_s"])
    if "decode_graph_step_s" in record:
        record["decode_graph_ms_per_token"] = _per_token_ms(record["decode_graph_step_s"])
    mb = (lambda n: "-" if n is None else f"{n / 1e6:.1f}")
    log(f"{record['mode']}: {mb(record['checkpoint_bytes'])} MB on disk, {mb(record['resident_weight_bytes'])} MB "
        f"resident, KV {record['kv_bytes_b16'] / 1e6:.2f} MB, decode {record['decode_ms_per_token']['1']:.2f} / "
        f"{record['decode_ms_per_token']['16']:.3f} ms per token at batch 1 / 16"
        + (f" (graphs {record['decode_graph_ms_per_token'].get('1', float('nan')):.2f} / "
           f"{record['decode_graph_ms_per_token'].get('16', float('nan')):.3f})"
           if "decode_graph_ms_per_token" in record else ""))
    return record


def _ratio(a, b):
    return a / b if a is not None and b else None


def add_ratios(results: list) -> None:
    """ratio_to_base: each figure over the first record's (the float baseline of this run)."""
    base = results[0]
    for r in results:
        r["ratio_to_base"] = {
            "base": base["mode"],
            "checkpoint_bytes": _ratio(r["checkpoint_bytes"], base["checkpoint_bytes"]),
            "resident_weight_bytes": _ratio(r["resident_weight_bytes"], base["resident_weight_bytes"]),
            "device_weight_bytes": _ratio(r["device_weight_bytes"], base["device_weight_bytes"]),
            "kv_bytes": _ratio(r["kv_bytes_b16"], base["kv_bytes_b16"]),
            **{f"decode_b{b}": _ratio(r["decode_ms_per_token"][str(b)], base["decode_ms_per_token"][str(b)])
               for b in BATCHES},
            **{f"decode_graph_b{b}": _ratio(r.get("decode_graph_ms_per_token", {}).get(str(b)),
                                            base.get("decode_graph_ms_per_token", {}).get(str(b)))
               for b in BATCHES}}
        r["same_greedy_tokens_as_base_b1"] = r["tokens_b1"] == base["tokens_b1"]


def _f(value, fmt: str, ratio=None) -> str:
    if value is None:
        return "-"
    return f"{value:{fmt}}" + (f" ({ratio:.3f})" if ratio is not None else "")


def markdown(result: dict) -> str:
    s, dev, base = result["settings"], result["device"], result["modes"][0]["mode"]
    gpu = dev["backend"] == "cupy"
    where = (f"CuPy backend on {dev.get('device_name')} (cupy {dev.get('cupy')}, CUDA runtime "
             f"{dev.get('cuda_runtime')})" if gpu else "NumPy backend")
    graphs = any("decode_graph_ms_per_token" in r for r in result["modes"])
    lines = [f"# Quantization benchmark: {result['model']}, {where} ({result['date']})", "",
             f"Prompts of {s['prompt']} tokens, {s['new_tokens']} new tokens, {s['rounds']} rounds alternating the "
             f"modes (median decode step); {s['threads']} CPUs online, load average {result['loadavg_before']} before "
             f"and {result['loadavg_after']} after. Ratios (x) are to {base} in this run.", "",
             "| mode | checkpoint MB (x) | resident weights MB (x) |" + (" device weights MB (x) |" if gpu else "")
             + " KV MB, batch 16 (x) | decode b1 ms/token (x) | decode b16 ms/token (x) |"
             + (" graphs b1 ms/token (x) | graphs b16 ms/token (x) |" if graphs else "")
             + " scratch MB | same b1 tokens |",
             "|---|---|---|" + ("---|" if gpu else "") + "---|---|---|" + ("---|---|" if graphs else "") + "---|---|"]
    mb = (lambda n: None if n is None else n / 1e6)
    for r in result["modes"]:
        x, gm = r["ratio_to_base"], r.get("decode_graph_ms_per_token", {})
        row = (f"| {r['mode']} | {_f(mb(r['checkpoint_bytes']), '.1f', x['checkpoint_bytes'])} | "
               f"{_f(mb(r['resident_weight_bytes']), '.1f', x['resident_weight_bytes'])} | "
               + (f"{_f(mb(r['device_weight_bytes']), '.1f', x['device_weight_bytes'])} | " if gpu else "")
               + f"{_f(mb(r['kv_bytes_b16']), '.2f', x['kv_bytes'])} | "
               f"{_f(r['decode_ms_per_token']['1'], '.2f', x['decode_b1'])} | "
               f"{_f(r['decode_ms_per_token']['16'], '.3f', x['decode_b16'])} |")
        if graphs:
            row += (f" {_f(gm.get('1'), '.2f', x['decode_graph_b1'])} | "
                    f"{_f(gm.get('16'), '.3f', x['decode_graph_b16'])} |")
        lines.append(row + f" {_f(mb(r['scratch_bytes']), '.1f')} | "
                     f"{'yes' if r['same_greedy_tokens_as_base_b1'] else 'no'} |")
    lines += ["", "Checkpoint: the HDF5 file (quantized ones converted from the Q4_1 GGUF; the float file keeps the "
              "tokenizer and float norms too). Resident weights: arrays the model holds (host and device). Device "
              "weights: the device arrays alone (GPU only). Scratch: the reused dequantize buffers (one weight tile, "
              "one layer's KV rows) at their largest. KV: the batch-16 cache (prompt + new tokens per sequence, "
              f"all layers). Same b1 tokens: the batch-1 greedy tokens equal {base}'s (quantized weights may "
              "change them)."]
    if gpu:
        lines += ["", f"Device memory pool (cupy): {_f(mb(result.get('device_pool_used_bytes')), '.1f')} MB in use, "
                  f"{_f(mb(result.get('device_pool_total_bytes')), '.1f')} MB held after the run; per mode, the "
                  "pool's growth while its weights loaded is `device_pool_load_bytes` in the JSON. Graphs: decode "
                  "steps replayed as CUDA graphs (`[runtime] cuda_graphs`), captured once per generation."]
        errors = [f"{r['mode']}: {r['graphs_error']}" for r in result["modes"] if "graphs_error" in r]
        if errors:
            lines += ["", "CUDA graphs failed for: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def build_result(results: list, ops, settings: dict, model_name: str, before, t0: float) -> dict:
    pool = ops.xp.get_default_memory_pool() if ops.name == "cupy" else None
    return {"date": _dt.date.today().isoformat(), "elapsed_s": time.perf_counter() - t0, "model": model_name,
            "loadavg_before": before, "loadavg_after": loadavg(), "settings": settings,
            "machine": machine_info(), "device": device_info(ops), "git_commit": git_commit(),
            "device_pool_used_bytes": pool_used_bytes(ops),
            "device_pool_total_bytes": int(pool.total_bytes()) if pool is not None else None,
            "modes": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=sorted(FLOAT), default="numpy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--modes", default=None, help="comma-separated; default: every mode of the backend")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="also time graphed decode steps (cupy only; default: on with cupy)")
    ap.add_argument("--checkpoint", type=Path, default=H5, help="the float32 SmolLM2 checkpoint")
    ap.add_argument("--gguf", type=Path, default=GGUF, help="the Q4_1 GGUF the quantized modes are converted from")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args(argv)
    for path in (args.checkpoint, args.gguf):
        if not path.exists():
            raise SystemExit(f"bench.quant: {path} is missing; run `make model` (docs/gpu.md on a GPU machine)")
    graphs = args.backend == "cupy" if args.cuda_graphs is None else args.cuda_graphs
    if graphs and args.backend != "cupy":
        raise SystemExit("bench.quant: --cuda-graphs needs --backend cupy")

    with open_checkpoint(str(args.checkpoint)) as ckpt:
        prompts = make_prompts(TextTokenizer.from_checkpoint(ckpt), max(BATCHES), args.prompt)
    modes = [m for m in (args.modes or ",".join(modes_for(args.backend))).split(",") if m]
    if modes[0] != FLOAT[args.backend]:
        if FLOAT[args.backend] not in modes:
            raise SystemExit(f"bench.quant: --modes must include {FLOAT[args.backend]} (the ratios' base)")
        modes.remove(FLOAT[args.backend])
        modes.insert(0, FLOAT[args.backend])
    before, t0 = loadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models, records = load_modes(modes, Path(tmp), args.backend, args.checkpoint, args.gguf)
        results = run_modes(models, records, modes, prompts, args.rounds, args.new_tokens, graphs)
    settings = {"backend": args.backend, "rounds": args.rounds, "new_tokens": args.new_tokens, "prompt": args.prompt,
                "batches": list(BATCHES), "threads": os.cpu_count(), "cuda_graphs": graphs}
    result = build_result(results, models[modes[0]].ops, settings, "SmolLM2-135M", before, t0)
    write_results(args.out, "quant-gpu" if args.backend == "cupy" else "quant", result, markdown(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
