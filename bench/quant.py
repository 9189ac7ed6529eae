"""Quantization benchmark (issue 7, `make bench-quant`): SmolLM2 on the NumPy backend, one process, per mode:
checkpoint size on disk, resident weight bytes, KV-cache bytes, decode time per token at batch 1 and batch 16,
and each figure's ratio to float32 measured in the same run.

Modes:
  float32        models/smollm2.h5 (made by `make model`)
  int8           `hpcinfer convert <gguf> --quantize int8` (per-row symmetric int8, stored quantized)
  int4-g64       `hpcinfer convert <gguf> --quantize int4 --group-size 64`
  q4_1-kept      `hpcinfer convert <gguf> --keep-quantized` (GGUF Q4_1 blocks as they are, groups of 32)
  float32+kv-int4, int4-g64+kv-int4   the same weights with `[model] kv_cache = "int4"` (groups of 64)
The quantized checkpoints are converted into a temporary directory from models/SmolLM2-135M-Instruct.Q4_1.gguf
(the float32 file is that GGUF dequantized, so every mode starts from the same weight values).

Every model is loaded first; then `--rounds` rounds, each running every mode in turn (so a load that drifts
during the run hits all modes alike), each mode one generation per batch size of `--new-tokens` tokens after a
`--prompt`-token prompt (consecutive slices of pydoc_data/topics.py). Decode time per token: the median over
rounds of each generation's median decode step (one token per sequence), divided by the batch. Resident weight
bytes: every array the model object holds (the quantized arrays as stored, norms, rotary tables), not the ops'
reused scratch, which is reported on its own (the largest dequantized tile / KV rows of one layer). KV bytes: the
cache of the batch-16 run (prompt + new tokens per sequence).

    python -m bench.quant [--rounds 3] [--new-tokens 8] [--prompt 32] [--out bench/results]

Writes bench/results/quant-<YYYY-MM-DD>.{json,md} and prints the table. Timings on a shared machine are inflated
(the report says how busy it was); the lead may re-run it on a quiet one.
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

REPO = Path(__file__).resolve().parent.parent
H5 = REPO / "models" / "smollm2.h5"
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT = {"int8": ["--quantize", "int8"], "int4-g64": ["--quantize", "int4", "--group-size", "64"],
           "q4_1-kept": ["--keep-quantized"]}
MODES = ("float32", "int8", "int4-g64", "q4_1-kept", "float32+kv-int4", "int4-g64+kv-int4")
BATCHES = (1, 16)


def log(msg: str) -> None:
    print(f"[bench.quant {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def checkpoint_for(weights: str, tmp: Path) -> Path:
    """The checkpoint file of a weight mode (converted once into tmp)."""
    if weights == "float32":
        return H5
    out = tmp / f"smollm2-{weights}.h5"
    if not out.exists():
        cmd = [sys.executable, "-m", "hpcinfer", "convert", str(GGUF), str(out), *CONVERT[weights]]
        log("converting: " + " ".join(cmd[2:]))
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench.quant: convert failed:\n{proc.stdout}\n{proc.stderr}")
    return out


def resident_bytes(obj, seen=None) -> int:
    """Bytes of every NumPy array reachable from the model's attributes (each counted once), the ops excluded."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes) if obj.base is None or id(obj.base) not in seen else 0
    if isinstance(obj, (list, tuple)):
        return sum(resident_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(resident_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(resident_bytes(v, seen) for k, v in vars(obj).items() if k not in ("ops", "arch", "tp", "groups"))
    return 0


def scratch_bytes(ops) -> int:
    """The ops' reused buffers: dequantized weight tiles (linear_q) and dequantized KV rows (kv_attention)."""
    bufs = list(ops.__dict__.get("_scratch", {}).values()) + list(ops.__dict__.get("_kv_scratch", {}).values())
    return sum(int(b.nbytes) for b in bufs)


def run_batch(model, prompts: list, new_tokens: int):
    """(median decode step s, KV bytes, generated ids) of one generation."""
    from hpcinfer.generate.engine import GenerationParams, StepTimes, generate_batch

    times = StepTimes()
    out = generate_batch(model, [list(p) for p in prompts], list(range(len(prompts))),
                         GenerationParams(new_tokens, ignore_eos=True), times)
    return float(np.median(times.decode_s)), times.kv_peak_device_bytes, [ids for ids, _ in out]


def load_modes(modes: list, tmp: Path) -> tuple[dict, dict]:
    """Every mode's model, loaded once (modes with the same weights share one model): (models, records)."""
    from hpcinfer.api import load_model

    models, records = {}, {}
    for mode in modes:
        weights = mode.partition("+")[0]
        path = checkpoint_for(weights, tmp)
        if weights not in models:
            t0 = time.perf_counter()
            models[weights] = load_model(str(path))
            log(f"{weights}: loaded in {time.perf_counter() - t0:.1f} s")
        records[mode] = {"mode": mode, "checkpoint": path.name, "checkpoint_bytes": path.stat().st_size,
                         "resident_weight_bytes": resident_bytes(models[weights]),
                         "decode_step_s": {str(b): [] for b in BATCHES}}
    return models, records


def measure_round(mode: str, model, record: dict, prompts: list, args) -> None:
    """One round of one mode: a generation at each batch size; appends the median decode step of each."""
    from hpcinfer.quant.kv import kv_format

    kv = mode.partition("+")[2]
    model.set_attention(kv_format("int4" if kv == "kv-int4" else "none", 64, model.arch.head_dim))
    for batch in BATCHES:
        step, kv_bytes, tokens = run_batch(model, prompts[:batch], args.new_tokens)
        record["decode_step_s"][str(batch)].append(step)
        record[f"kv_bytes_b{batch}"], record[f"tokens_b{batch}"] = kv_bytes, tokens
    record["scratch_bytes"] = max(record.get("scratch_bytes", 0), scratch_bytes(model.ops))


def summarize_mode(record: dict) -> dict:
    record["decode_ms_per_token"] = {b: float(np.median(s)) / int(b) * 1e3 for b, s in record["decode_step_s"].items()}
    log(f"{record['mode']}: {record['checkpoint_bytes'] / 1e6:.1f} MB on disk, "
        f"{record['resident_weight_bytes'] / 1e6:.1f} MB resident, KV {record['kv_bytes_b16'] / 1e6:.2f} MB, "
        f"decode {record['decode_ms_per_token']['1']:.1f} / {record['decode_ms_per_token']['16']:.1f} ms per "
        f"token at batch 1 / 16")
    return record


def add_ratios(results: list) -> None:
    base = next(r for r in results if r["mode"] == "float32")
    for r in results:
        r["ratio_to_float32"] = {
            "checkpoint_bytes": r["checkpoint_bytes"] / base["checkpoint_bytes"],
            "resident_weight_bytes": r["resident_weight_bytes"] / base["resident_weight_bytes"],
            "kv_bytes": r["kv_bytes_b16"] / base["kv_bytes_b16"],
            **{f"decode_b{b}": r["decode_ms_per_token"][str(b)] / base["decode_ms_per_token"][str(b)]
               for b in BATCHES}}
        r["same_greedy_tokens_as_float32_b1"] = r["tokens_b1"] == base["tokens_b1"]


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# Quantization benchmark: SmolLM2-135M, NumPy backend ({result['date']})", "",
             f"Prompts of {s['prompt']} tokens, {s['new_tokens']} new tokens, {s['rounds']} rounds alternating the "
             f"modes (median decode step); {s['threads']} CPUs online, load average {result['loadavg_before']} before "
             f"and {result['loadavg_after']} after. Ratios are to float32 in this run.", "",
             "| mode | checkpoint MB (x) | resident weights MB (x) | KV MB, batch 16 (x) | decode b1 ms/token (x) "
             "| decode b16 ms/token (x) | scratch MB | same b1 tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["modes"]:
        x = r["ratio_to_float32"]
        lines.append(f"| {r['mode']} | {r['checkpoint_bytes'] / 1e6:.1f} ({x['checkpoint_bytes']:.3f}) | "
                     f"{r['resident_weight_bytes'] / 1e6:.1f} ({x['resident_weight_bytes']:.3f}) | "
                     f"{r['kv_bytes_b16'] / 1e6:.2f} ({x['kv_bytes']:.3f}) | "
                     f"{r['decode_ms_per_token']['1']:.1f} ({x['decode_b1']:.2f}) | "
                     f"{r['decode_ms_per_token']['16']:.2f} ({x['decode_b16']:.2f}) | "
                     f"{r['scratch_bytes'] / 1e6:.1f} | {'yes' if r['same_greedy_tokens_as_float32_b1'] else 'no'} |")
    lines += ["", "Checkpoint: the HDF5 file (quantized ones converted from the Q4_1 GGUF; float32 keeps the "
              "tokenizer and float norms too). Resident weights: arrays the model holds. Scratch: the reused "
              "dequantize buffers (one weight tile, one layer's KV rows) at their largest. KV: the batch-16 "
              "cache (prompt + new tokens per sequence, all layers). Same b1 tokens: the batch-1 greedy tokens "
              "equal float32's (quantized weights may change them)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args(argv)
    for path, how in ((H5, "make model"), (GGUF, "make model")):
        if not path.exists():
            raise SystemExit(f"bench.quant: {path} is missing; run `{how}`")

    from hpcinfer.bench.common import loadavg, make_prompts
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.generate.tokenizer import TextTokenizer

    with open_checkpoint(str(H5)) as ckpt:
        prompts = make_prompts(TextTokenizer.from_checkpoint(ckpt), max(BATCHES), args.prompt)
    modes = [m for m in args.modes.split(",") if m]
    if "float32" not in modes:
        raise SystemExit("bench.quant: --modes must include float32 (the ratios' base)")
    before, t0 = loadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models, records = load_modes(modes, Path(tmp))
        for r in range(args.rounds):                      # rounds alternate the modes: drifting load hits all alike
            for mode in modes:
                measure_round(mode, models[mode.partition("+")[0]], records[mode], prompts, args)
            log(f"round {r + 1} of {args.rounds} done")
    results = [summarize_mode(records[m]) for m in modes]
    add_ratios(results)
    date = _dt.date.today().isoformat()
    result = {"date": date, "elapsed_s": time.perf_counter() - t0, "loadavg_before": before,
              "loadavg_after": loadavg(),
              "settings": {"rounds": args.rounds, "new_tokens": args.new_tokens, "prompt": args.prompt,
                           "batches": list(BATCHES), "threads": os.cpu_count()}, "modes": results}
    from hpcinfer.bench.common import write_results

    write_results(args.out, "quant", result, markdown(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
