"""SmolLM2 perplexity on real English prose, float32 against each weight-quantization mode (issue 7, "Accuracy";
docs/quantization.md).

Text: the concatenation of a fixed list of entries of the Python standard library's `pydoc_data.topics.topics`
(the reference manual's prose, present on every Python), tokenized with the checkpoint's own tokenizer (no special
tokens), cut into `--windows` non-overlapping windows of `--window` tokens. Each window is one independent sequence
(fresh KV cache): the model predicts tokens 1..W-1 of the window from the tokens before them, so every window gives
W-1 next-token log-likelihoods. Perplexity = exp(mean negative log-likelihood over all of them).

Logits are needed at every position, so the script runs the model's pieces itself (embed_tokens, run_layers with a
KVCache and a one-sequence StepLayout, then final norm + LM head on all positions) instead of `prompt_logits`,
which keeps only the last position. Log-softmax in float64.

Modes:
  float32      models/smollm2.h5 as stored (float32; itself the dequantized Q4_1 GGUF, the only weights that ship)
  int8         the same file, load_model(..., quantize="int8")  (per-row symmetric int8)
  int4-g64     the same file, load_model(..., quantize="int4", group_size=64)
  q4_1-kept    models/SmolLM2-135M-Instruct.Q4_1.gguf converted with `convert --keep-quantized` into a temp file

    python -m bench.perplexity [--windows 8] [--window 256] [--out bench/results]

Writes bench/results/perplexity-<YYYY-MM-DD>.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
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

# Fixed, ordered list of pydoc topics: mostly prose (execution model, naming, exceptions, statements, types).
TOPIC_KEYS = ("execmodel", "naming", "exceptions", "assignment", "import", "compound", "class", "function", "try",
              "types", "numbers", "attribute-access")

TARGETS = {"int8": 0.01, "int4-g64": 0.10, "q4_1-kept": 0.10}   # allowed relative perplexity increase over float32


def log(msg: str) -> None:
    print(f"[bench.perplexity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prose_text() -> str:
    import pydoc_data.topics as topics

    missing = [k for k in TOPIC_KEYS if k not in topics.topics]
    if missing:
        raise SystemExit(f"bench.perplexity: pydoc_data.topics lacks {missing} on this Python")
    return "\n\n".join(topics.topics[k] for k in TOPIC_KEYS)


def make_windows(path: Path, count: int, length: int) -> list[list[int]]:
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.generate.tokenizer import TextTokenizer

    with open_checkpoint(str(path)) as ckpt:
        tok = TextTokenizer.from_checkpoint(ckpt)
    if tok is None:
        raise SystemExit(f"bench.perplexity: {path} holds no tokenizer")
    ids = tok.encode(prose_text(), add_special_tokens=False)
    need = count * length
    if len(ids) < need:
        raise SystemExit(f"bench.perplexity: the text gives only {len(ids)} tokens, {need} needed")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def all_position_logits(model, tokens: list[int]) -> np.ndarray:
    """One sequence, one prefill step: logits [T, V] float32 at every position."""
    from hpcinfer.backend.ops import StepLayout
    from hpcinfer.generate.kv_cache import KVCache

    arch = model.arch
    cache = KVCache(model.ops, arch.num_layers, 1, model.kv_heads_local, len(tokens), arch.head_dim)
    step = StepLayout.build([0], [0], [len(tokens)])
    ids = np.asarray(tokens, dtype=np.int64)
    x = model.run_layers(model.embed_tokens(ids, step), step, cache)
    return model.ops.to_host(model.lm_head.logits(model.final_norm(x)))


def window_nll(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    """Negative log-likelihood of tokens[1:] given the logits at positions [:-1]; float64 [T-1]."""
    z = logits[:-1].astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    logz = np.log(np.exp(z).sum(axis=1))
    target = np.asarray(tokens[1:], dtype=np.int64)
    return logz - z[np.arange(len(target)), target]


def measure(model, windows: list[list[int]]) -> dict:
    nll, per_window, argmax_hits, t0 = [], [], 0, time.perf_counter()
    for w in windows:
        logits = all_position_logits(model, w)
        v = window_nll(logits, w)
        nll.append(v)
        per_window.append(float(math.exp(v.mean())))
        argmax_hits += int((logits[:-1].argmax(axis=1) == np.asarray(w[1:])).sum())
    nll = np.concatenate(nll)
    return {"perplexity": float(math.exp(nll.mean())), "mean_nll": float(nll.mean()), "predictions": int(nll.size),
            "top1_accuracy": argmax_hits / nll.size, "per_window_perplexity": per_window,
            "seconds": time.perf_counter() - t0}


def convert_keep_quantized(tmpdir: str) -> Path:
    out = Path(tmpdir) / "smollm2-q4_1-kept.h5"
    cmd = [sys.executable, "-m", "hpcinfer", "convert", str(GGUF), str(out), "--keep-quantized"]
    log("converting: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench.perplexity: convert failed:\n{proc.stdout}\n{proc.stderr}")
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# SmolLM2 perplexity by weight-quantization mode ({result['date']})", "",
             f"Text: `pydoc_data.topics.topics` entries {', '.join(s['topic_keys'])} (Python {s['python']}), "
             f"checkpoint tokenizer, {s['windows']} non-overlapping windows of {s['window']} tokens, "
             f"{result['modes'][0]['predictions']} next-token predictions. NumPy backend, float32 compute.", "",
             "| mode | weights | perplexity | ratio to float32 | target | top-1 acc | time (s) |",
             "|---|---|---|---|---|---|---|"]
    for m in result["modes"]:
        target = f"<= {1 + TARGETS[m['mode']]:.2f}" if m["mode"] in TARGETS else "-"
        ok = "" if m["mode"] not in TARGETS else (" (met)" if m["within_target"] else " (**missed**)")
        lines.append(f"| {m['mode']} | {m['weights']} | {m['perplexity']:.4f} | {m['ratio_to_float32']:.4f} | "
                     f"{target}{ok} | {m['top1_accuracy']:.3f} | {m['seconds']:.1f} |")
    lines += ["", "float32 is `models/smollm2.h5`, itself the dequantized Q4_1 GGUF (the only SmolLM2 weights that "
              "ship), so Q4_1 kept computes with the same weight values and should match float32 up to float "
              "rounding in the matmul order; int8 and int4 re-quantize those already-4-bit weights."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--modes", default="float32,int8,int4-g64,q4_1-kept")
    args = ap.parse_args(argv)

    from hpcinfer.api import load_model

    windows = make_windows(H5, args.windows, args.window)
    log(f"{len(windows)} windows x {args.window} tokens")
    modes = [m for m in args.modes.split(",") if m]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            if mode == "float32":
                model, weights = load_model(str(H5)), "float32 (smollm2.h5)"
            elif mode == "int8":
                model, weights = load_model(str(H5), quantize="int8"), "int8 per-row, quantized at load"
            elif mode == "int4-g64":
                model, weights = load_model(str(H5), quantize="int4", group_size=64), "int4 g64, quantized at load"
            elif mode == "q4_1-kept":
                model, weights = load_model(str(convert_keep_quantized(tmp))), "GGUF Q4_1 kept (g32)"
            else:
                raise SystemExit(f"bench.perplexity: unknown mode {mode!r}")
            r = measure(model, windows)
            del model
            r.update(mode=mode, weights=weights)
            log(f"{mode}: perplexity {r['perplexity']:.4f} ({r['seconds']:.1f} s)")
            results.append(r)
    base = next((r["perplexity"] for r in results if r["mode"] == "float32"), None)
    for r in results:
        r["ratio_to_float32"] = r["perplexity"] / base if base else float("nan")
        if r["mode"] in TARGETS and base:
            r["within_target"] = bool(r["ratio_to_float32"] <= 1 + TARGETS[r["mode"]])

    date = _dt.date.today().isoformat()
    result = {"date": date, "checkpoint": str(H5.relative_to(REPO)), "gguf": str(GGUF.relative_to(REPO)),
              "settings": {"windows": args.windows, "window": args.window, "topic_keys": list(TOPIC_KEYS),
                           "python": sys.version.split()[0], "threads": os.cpu_count(),
                           "targets_relative_increase": TARGETS},
              "modes": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"perplexity-{date}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / f"perplexity-{date}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
