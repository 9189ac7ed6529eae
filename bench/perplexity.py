"""SmolLM2 perplexity on real English prose, float32 against each weight- and KV-quantization mode and top-k
sparse attention (issue 7, "Accuracy"; docs/quantization.md).

Text: the concatenation of a fixed list of entries of the Python standard library's `pydoc_data.topics.topics`
(the reference manual's prose, present on every Python), tokenized with the checkpoint's own tokenizer (no special
tokens), cut into `--windows` non-overlapping windows of `--window` tokens. Each window is one independent sequence
(fresh KV cache): the model predicts tokens 1..W-1 of the window from the tokens before them, so every window gives
W-1 next-token log-likelihoods. Perplexity = exp(mean negative log-likelihood over all of them).

Logits are needed at every position, so the script runs the model's pieces itself (embed_tokens, run_layers with a
KVCache and a one-sequence StepLayout, then final norm + LM head on all positions) instead of `prompt_logits`,
which keeps only the last position. Log-softmax in float64.

Decode modes (names ending in a KV or top-k setting) cannot score a window in one prefill: a quantized KV cache
and top-k attention act on rows READ FROM THE CACHE, and a one-step prefill reads none (each token sees its own
step's keys unquantized, and top-k applies to decode steps only). So they run the window token by token, as
generation does: all windows as one batch of sequences, step t feeds token t of every window (one decode step,
StepLayout counts 1) and scores token t+1 from that step's logits. Every cached key and value a step reads was
stored quantized by an earlier step, and each step's top-k picks among all of them. `float32-decode` runs the same
loop with a float cache: it is the baseline of the decode modes and checks that the loop equals the prefill.

Modes:
  float32          models/smollm2.h5 as stored (float32; itself the dequantized Q4_1 GGUF, the only weights that ship)
  int8             the same file, load_model(..., quantize="int8")  (per-row symmetric int8)
  int4-g64         the same file, load_model(..., quantize="int4", group_size=64)
  int4-g32         the same, group_size=32 (the groups of the Q4_1 weights it re-quantizes)
  asym8-g64        the same file, load_model(..., quantize="asym8", group_size=64)  (group-wise asymmetric 8-bit)
  q4_1-kept        models/SmolLM2-135M-Instruct.Q4_1.gguf converted with `convert --keep-quantized` into a temp file
  int4-default     the GGUF converted with `convert --quantize int4` and no other flag (issue 22's defaults: groups on
                   the source's grid of 32, Q4_1 blocks kept as int4 g32, the Q8_0 embedding / LM head kept at 8 bits)
  int4-embed4      the same with `--quantize-embedding same` (the embedding / LM head int4 g32 too)
  int8-default     the GGUF converted with `convert --quantize int8` (int8 per row; the Q8_0 embedding kept)
  W-layers         weight mode W (int8, int4-g64, int4-g32, asym8-g64) on the decoder layers' matrices only: the
                   tied embedding / LM head stays float32 (where W's loss comes from, attributed by a run)
  W-embed          W on the tied embedding / LM head only: the layers' matrices stay float32
  W-search         W (int4 or asym8) with each group's (scale, min) chosen by a clipping + least-squares search
                   (`search_quantize`, this script only) instead of min-max: lower weight MSE, recorded as
                   `weight_mse_ratio_to_minmax`; kept here to record whether it helps perplexity
                   (-layers / -embed / -search quantize the float32 model after loading, layer by layer, with
                   quant.formats.quantize or search_quantize: at tp = 1 the same arrays as load_model(quantize=...))
  float32-decode   float32 weights and cache, token by token
  kv-int4          float32 weights, int4 KV cache (groups of 64 = head_dim), token by token
  kv-int8          float32 weights, int8 KV cache, token by token
  kv-int4-g32/-g16 float32 weights, int4 KV cache with groups of 32 / 16 values (2 / 4 groups per head row)
  int4-g64+kv-int4 int4 g64 weights and int4 KV cache, token by token
  int4-g32+kv-int4 int4 g32 weights and int4 KV cache, token by token (any `weights+attention` pair works)
  topk-F           float32 weights and cache, top-k sparse decode attention keeping a fraction F of the cached
                   positions (0.1 is FlexGen's setting; 0.25 and 0.5 show how the loss falls with F)

    python -m bench.perplexity [--windows 8] [--window 256] [--modes a,b,...] [--tag b]
                                                [--out bench/results] [--note "..."]

Writes bench/results/perplexity-<YYYY-MM-DD><tag>.json and .md and prints the table.
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

from hpcinfer.api import load_model
from hpcinfer.backend.interface import StepLayout
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.generate.kv_cache import KVCache
from hpcinfer.generate.tokenizer import TextTokenizer
from hpcinfer.quant.formats import QuantizedTensor, dequantize, pack4, quantize, spec

from . import REPO

H5 = REPO / "models" / "smollm2.h5"
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# Fixed, ordered list of pydoc topics: mostly prose (execution model, naming, exceptions, statements, types).
TOPIC_KEYS = ("execmodel", "naming", "exceptions", "assignment", "import", "compound", "class", "function", "try",
              "types", "numbers", "attribute-access")

TARGETS = {"int8": 0.01, "int8-default": 0.01, "int4-default": 0.10, "int4-embed4": 0.10,
           "int4-default+kv-int4": 0.10, "asym8-g64": 0.01, "int4-g64": 0.10, "int4-g32": 0.10, "q4_1-kept": 0.10, "kv-int4": 0.10,
           "int4-g64+kv-int4": 0.10, "int4-g32+kv-int4": 0.10,
           "kv-int4-g32": 0.10, "kv-int4-g16": 0.10, "int4-g32+kv-int4-g16": 0.10}   # allowed relative increase over float32
DEFAULT_MODES = ("float32,int8,asym8-g64,int4-g64,int4-g32,q4_1-kept,float32-decode,kv-int4,kv-int4-g32,"
                 "kv-int4-g16,kv-int8,int4-g64+kv-int4,int4-g32+kv-int4,int4-g32+kv-int4-g16,topk-0.1,topk-0.25,"
                 "topk-0.5")


def log(msg: str) -> None:
    print(f"[bench.perplexity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prose_text() -> str:
    import pydoc_data.topics as topics

    missing = [k for k in TOPIC_KEYS if k not in topics.topics]
    if missing:
        raise SystemExit(f"bench.perplexity: pydoc_data.topics lacks {missing} on this Python")
    return "\n\n".join(topics.topics[k] for k in TOPIC_KEYS)


def make_windows(path: Path, count: int, length: int) -> list[list[int]]:
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
    arch = model.arch
    cache = KVCache(model.ops, arch.num_layers, 1, model.kv_heads_local, len(tokens), arch.head_dim)
    step = StepLayout.build([0], [0], [len(tokens)])
    ids = np.asarray(tokens, dtype=np.int64)
    x = model.run_layers(model.embed_tokens(ids, step), step, cache)
    return model.ops.to_host(model.lm_head.logits(model.final_norm(x)))


def decode_logits(model, windows: list[list[int]]) -> list[np.ndarray]:
    """All windows as one batch, token by token: step t feeds token t of each window at position t and returns
    logits [S, V] for position t. -> per window logits [W, V] (float32) at every position."""
    arch, S, W = model.arch, len(windows), len(windows[0])
    cache = KVCache(model.ops, arch.num_layers, S, model.kv_heads_local, W, arch.head_dim,
                    kv_format=model.kv_format)
    ids = np.asarray(windows, dtype=np.int64)                                       # [S, W]
    out = np.empty((S, W, arch.vocab_size), dtype=np.float32)
    for t in range(W):
        step = StepLayout.build(range(S), [t] * S, [1] * S)
        out[:, t] = model.ops.to_host(model.forward(ids[:, t], step, cache))[:, :arch.vocab_size]
    return list(out)


def window_nll(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    """Negative log-likelihood of tokens[1:] given the logits at positions [:-1]; float64 [T-1]."""
    z = logits[:-1].astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    logz = np.log(np.exp(z).sum(axis=1))
    target = np.asarray(tokens[1:], dtype=np.int64)
    return logz - z[np.arange(len(target)), target]


def measure(model, windows: list[list[int]], decode: bool = False) -> dict:
    nll, per_window, argmax_hits, t0 = [], [], 0, time.perf_counter()
    decoded = decode_logits(model, windows) if decode else None
    for i, w in enumerate(windows):
        logits = decoded[i] if decode else all_position_logits(model, w)
        v = window_nll(logits, w)
        nll.append(v)
        per_window.append(float(math.exp(v.mean())))
        argmax_hits += int((logits[:-1].argmax(axis=1) == np.asarray(w[1:])).sum())
    nll = np.concatenate(nll)
    return {"perplexity": float(math.exp(nll.mean())), "mean_nll": float(nll.mean()), "predictions": int(nll.size),
            "top1_accuracy": argmax_hits / nll.size, "per_window_perplexity": per_window,
            "seconds": time.perf_counter() - t0}


WEIGHTS = {"float32": ("float32 (smollm2.h5)", {}), "int8": ("int8 per-row, quantized at load", {"quantize": "int8"}),
           "int4-g64": ("int4 g64, quantized at load (embedding / LM head: int8, the default)",
                        {"quantize": "int4", "group_size": 64}),
           "int4-g32": ("int4 g32, quantized at load (embedding / LM head: int8, the default)",
                        {"quantize": "int4", "group_size": 32}),
           "asym8-g64": ("asym8 g64, quantized at load", {"quantize": "asym8", "group_size": 64}),
           "q4_1": ("GGUF Q4_1 kept (g32)", None)}
CONVERTED = {"q4_1": ("smollm2-q4_1-kept.h5", ["--keep-quantized"]),           # weight mode -> file, convert flags
             "int4-default": ("smollm2-int4.h5", ["--quantize", "int4"]),
             "int4-embed4": ("smollm2-int4-embed4.h5", ["--quantize", "int4", "--quantize-embedding", "same"]),
             "int8-default": ("smollm2-int8.h5", ["--quantize", "int8"])}
WEIGHTS.update({"int4-default": ("convert --quantize int4 (defaults): int4 g32 on the Q4_1 grid (blocks kept), "
                                 "embedding / LM head Q8_0 kept", None),
                "int4-embed4": ("convert --quantize int4 --quantize-embedding same: int4 g32, embedding int4 g32 "
                                "too", None),
                "int8-default": ("convert --quantize int8 (defaults): int8 per row, embedding Q8_0 kept", None)})
ATTENTION = {"": ("float32", None, 0.0, 64), "decode": ("float32", None, 0.0, 64),
             "kv-int4": ("int4 g64", "int4", 0.0, 64), "kv-int8": ("int8 g64", "int8", 0.0, 64),
             "kv-int4-g32": ("int4 g32", "int4", 0.0, 32), "kv-int4-g16": ("int4 g16", "int4", 0.0, 16)}
ATTENTION.update({f"topk-{f}": (f"float32, top-k {f}", None, f, 64) for f in (0.1, 0.25, 0.5)})


PARTS = {"layers": "the layers only (embedding / LM head float32)",
         "embed": "the embedding / LM head only (layers float32)",
         "search": "clipping + least-squares search per group"}


def split_weights(name: str) -> tuple[str, str]:
    """'int4-g64-layers' -> ('int4-g64', 'layers'); a plain weight mode -> (name, '')."""
    base, _, part = name.rpartition("-")
    if part in PARTS and WEIGHTS.get(base, (None, None))[1]:
        return base, part
    return name, ""


def load_mode(mode: str, tmp: str):
    """mode -> (model, weights description, KV description, token-by-token?, extra result fields). A mode is a
    weight mode, an attention mode on float32 weights, or `weights+attention`."""
    names = {"q4_1-kept": "q4_1", "float32-decode": "float32+decode"}
    weights, _, attention = names.get(mode, mode).partition("+")
    if weights in ATTENTION and weights not in WEIGHTS:
        weights, attention = "float32", weights
    base, part = split_weights(weights)
    if base not in WEIGHTS or attention not in ATTENTION:
        raise SystemExit(f"bench.perplexity: unknown mode {mode!r}")
    label, kwargs = WEIGHTS[base]
    kv_label, kv_mode, topk, group = ATTENTION[attention]
    kv = {"kv_cache": kv_mode or "none", "kv_cache_group": group, "attention_topk": topk}
    extra = {}
    if kwargs is None:
        model = load_model(str(convert_source(tmp, *CONVERTED[base])), **kv)
    elif part:
        model = load_model(str(H5), **kv)
        extra = quantize_after_load(model, kwargs["quantize"], kwargs.get("group_size", 64), part)
        label = f"{label.replace(', quantized at load', '')}, {PARTS[part]}, after load"
    else:
        model = load_model(str(H5), **kwargs, **kv)
    return model, label, kv_label, attention != "", extra


def quantize_after_load(model, mode: str, group: int, part: str) -> dict:
    """Quantize the float32 model's sharded matrices in place: part 'layers' = every block's attention and MLP
    matrices, 'embed' = the tied embedding / LM head table, 'search' = both, with search_quantize. Each layer then
    holds only the QuantizedTensor, as after load_model(quantize=...). Counts the matrices whose dequantized
    values equal the float32 ones exactly (a Q4_1 block re-quantized on its own grid)."""
    targets, exact = [], 0
    if part in ("layers", "search"):
        for block in model.blocks:
            targets += [block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down]
    if part in ("embed", "search"):
        targets.append(model.embed)
        if model.lm_head is not model.embed:
            targets.append(model.lm_head)
    if part == "search" and mode not in ("int4", "asym8"):
        raise SystemExit(f"bench.perplexity: the search quantizes asymmetric group-wise modes, not {mode!r}")
    sse = {"minmax": 0.0, "search": 0.0}
    for layer in targets:
        attr, qattr = ("table", "qtable") if hasattr(layer, "qtable") else ("w", "qw")
        w = np.asarray(getattr(layer, attr), dtype=np.float32)                  # [out, in] at tp = 1
        if part == "search":
            qt, err_minmax, err_search = search_quantize(w, mode, group)
            sse["minmax"] += err_minmax
            sse["search"] += err_search
        else:
            qt = quantize(w, mode, group)
            exact += bool(np.array_equal(dequantize(qt), w))
        setattr(layer, qattr, model.ops.prepare_quantized(qt))
        setattr(layer, attr, None)
    if part != "search":            # layers hold fused parts (q/k/v, gate/up): 4 per block, the table 1
        return {"matrices_round_trip_exact": exact, "matrices_quantized": len(targets)}
    return {"weight_mse_ratio_to_minmax": sse["search"] / sse["minmax"]}


SHRINK = (0.0, 0.03, 0.06, 0.1, 0.15)   # fractions of a group's range clipped off at each end


def search_quantize(w: np.ndarray, mode: str, group: int, chunk_rows: int = 2048):
    """Like quant.formats.quantize (same format, same q grid 0..top), but each group's (scale, min) is the best of
    len(SHRINK)^2 clipped ranges [lo + a (hi - lo), hi - b (hi - lo)], each followed by a least-squares refit of
    (scale, min) to the q it rounds to (the minimum of sum (scale q + min - x)^2 over the group). Best = smallest
    squared error. -> (QuantizedTensor, sum of squared errors of min-max, of the search)."""
    bits, _ = spec(mode)
    top = float((1 << bits) - 1)
    rows, cols = w.shape
    G = cols // group
    q_all = np.empty((rows, cols), np.uint8)
    scale_all = np.empty((rows, G), np.float32)
    min_all = np.empty((rows, G), np.float32)
    err_minmax = err_search = 0.0
    for r0 in range(0, rows, chunk_rows):
        x = w[r0:r0 + chunk_rows].reshape(-1, G, group).astype(np.float64)     # [R, G, g]
        lo, hi = x.min(axis=-1), x.max(axis=-1)                                 # [R, G]
        span = hi - lo
        best_err = np.full(lo.shape, np.inf)
        best = (np.zeros(x.shape, np.uint8), np.zeros(lo.shape), lo.copy())     # q, scale, min
        for a in SHRINK:
            for b in SHRINK:
                low, high = lo + a * span, hi - b * span
                s = (high - low) / top
                safe = np.where(s > 0, s, 1.0)
                q = np.clip(np.rint((x - low[..., None]) / safe[..., None]), 0, top)
                qm, xm = q.mean(axis=-1), x.mean(axis=-1)                       # least squares: x ~ s q + m
                var = ((q - qm[..., None]) ** 2).sum(axis=-1)
                cov = ((q - qm[..., None]) * (x - xm[..., None])).sum(axis=-1)
                fit = (var > 0) & (cov > 0)
                s = np.where(fit, cov / np.where(var > 0, var, 1.0), s).astype(np.float32).astype(np.float64)
                m = np.where(fit, xm - s * qm, low).astype(np.float32).astype(np.float64)
                err = ((s[..., None] * q + m[..., None] - x) ** 2).sum(axis=-1)
                better = err < best_err
                best_err = np.where(better, err, best_err)
                best = (np.where(better[..., None], q, best[0]).astype(np.uint8), np.where(better, s, best[1]),
                        np.where(better, m, best[2]))
        n = x.shape[0]
        q_all[r0:r0 + n] = best[0].reshape(n, cols)
        scale_all[r0:r0 + n], min_all[r0:r0 + n] = best[1], best[2]
        ref = w[r0:r0 + n]
        err_minmax += float(((dequantize(quantize(ref, mode, group)) - ref).astype(np.float64) ** 2).sum())
    qt = QuantizedTensor(mode, pack4(q_all) if bits == 4 else q_all, scale_all, min_all, group)
    err_search = float(((dequantize(qt) - w).astype(np.float64) ** 2).sum())
    return qt, err_minmax, err_search


def convert_source(tmpdir: str, name: str, flags: list) -> Path:
    """The GGUF converted with `flags` into tmpdir/name (once per run)."""
    out = Path(tmpdir) / name
    if out.exists():
        return out
    cmd = [sys.executable, "-m", "hpcinfer", "convert", str(GGUF), str(out), *flags]
    log("converting: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench.perplexity: convert failed:\n{proc.stdout}\n{proc.stderr}")
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# SmolLM2 perplexity by weight and KV quantization mode ({result['date']})", "",
             f"Text: `pydoc_data.topics.topics` entries {', '.join(s['topic_keys'])} (Python {s['python']}), "
             f"checkpoint tokenizer, {s['windows']} non-overlapping windows of {s['window']} tokens, "
             f"{result['modes'][0]['predictions']} next-token predictions. NumPy backend, float32 compute.", "",
             "| mode | weights | KV cache / attention | evaluation | perplexity | ratio to float32 | "
             "ratio to float32-decode | target | top-1 acc | time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    if result.get("note"):
        lines[2:2] = [result["note"], ""]
    for m in result["modes"]:
        target = f"<= {1 + TARGETS[m['mode']]:.2f}" if m["mode"] in TARGETS else "-"
        ok = "" if m["mode"] not in TARGETS else (" (met)" if m["within_target"] else " (**missed**)")
        dec = f"{m['ratio_to_float32_decode']:.4f}" if "ratio_to_float32_decode" in m else "-"
        lines.append(f"| {m['mode']} | {m['weights']} | {m.get('kv_cache', 'float32')} | "
                     f"{m.get('evaluation', 'prefill')} | {m['perplexity']:.4f} | {m['ratio_to_float32']:.4f} | "
                     f"{dec} | {target}{ok} | {m['top1_accuracy']:.3f} | {m['seconds']:.1f} |")
    searched = [m for m in result["modes"] if "weight_mse_ratio_to_minmax" in m]
    if searched:
        lines += [""] + [f"{m['mode']}: weight squared error {m['weight_mse_ratio_to_minmax']:.3f}x min-max's "
                         f"(the same matrices quantized by quant.formats.quantize)." for m in searched]
    counted = [m for m in result["modes"] if "matrices_quantized" in m]
    if counted:
        lines += [""] + [f"{m['mode']}: {m['matrices_round_trip_exact']} of {m['matrices_quantized']} quantized "
                         f"matrices (fused q/k/v and gate/up count as one) dequantize to exactly the float32 values."
                         for m in counted]
    lines += ["", "Load average (1 min) after each mode: " +
              ", ".join(f"{m['mode']} {m['load_average']:.1f}" for m in result["modes"] if "load_average" in m)]
    lines += ["", "float32 is `models/smollm2.h5`, itself the dequantized Q4_1 GGUF (the only SmolLM2 weights that "
              "ship), so Q4_1 kept computes with the same weight values and should match float32 up to float "
              "rounding in the matmul order; int8 and int4 re-quantize those already-4-bit weights.",
              "", "Token-by-token modes score the same predictions through decode steps that read every earlier "
              "position from the KV cache (quantized, or top-k selected); their targets are judged against "
              "float32 (prefill); float32-decode is the same loop with a float cache."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--tag", default="", help="suffix of the result files' names (e.g. b)")
    ap.add_argument("--note", default="", help="a line on how the run was made (e.g. the machine was shared)")
    args = ap.parse_args(argv)

    windows = make_windows(H5, args.windows, args.window)
    log(f"{len(windows)} windows x {args.window} tokens")
    modes = [m for m in args.modes.split(",") if m]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            model, weights, kv, decode, extra = load_mode(mode, tmp)
            r = measure(model, windows, decode)
            del model
            r.update(mode=mode, weights=weights, kv_cache=kv, evaluation="token by token" if decode else "prefill",
                     load_average=os.getloadavg()[0], **extra)
            log(f"{mode}: perplexity {r['perplexity']:.4f} ({r['seconds']:.1f} s)")
            results.append(r)
            md = write_results(results, args, complete=len(results) == len(modes))
    print(md)
    return 0


def write_results(results: list, args, complete: bool) -> str:
    """The table so far (rewritten after every mode, so a long run that is stopped keeps what it measured)."""
    base = next((r["perplexity"] for r in results if r["mode"] == "float32"), None)
    base_decode = next((r["perplexity"] for r in results if r["mode"] == "float32-decode"), None)
    for r in results:
        r["ratio_to_float32"] = r["perplexity"] / base if base else float("nan")
        if r["evaluation"] != "prefill" and base_decode:
            r["ratio_to_float32_decode"] = r["perplexity"] / base_decode
        if r["mode"] in TARGETS and base:
            r["within_target"] = bool(r["ratio_to_float32"] <= 1 + TARGETS[r["mode"]])
    date = _dt.date.today().isoformat()
    result = {"date": date, "checkpoint": str(H5.relative_to(REPO)), "gguf": str(GGUF.relative_to(REPO)),
              "complete": complete, "modes_asked": args.modes, "note": args.note,
              "settings": {"windows": args.windows, "window": args.window, "topic_keys": list(TOPIC_KEYS),
                           "python": sys.version.split()[0], "threads": os.cpu_count(),
                           "targets_relative_increase": TARGETS},
              "modes": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"perplexity-{date}{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / f"perplexity-{date}{args.tag}.md").write_text(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
