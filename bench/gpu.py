"""GPU benchmark, in one run on the CuPy backend (issue 5, Performance; docs/gpu.md, docs/bench-scripts.md):

  copy     device-to-device copy bandwidth of a large buffer: the reference for decode
  decode   decode of dense presets with float16 dummy weights at batch 1 (and the `--decode-batch` sizes): time
           per step, and achieved bandwidth = (weight bytes + KV bytes read per step) / time, as a fraction of the
           copy bandwidth (target >= 0.8 at batch 1)
  graphs   the same decode with `[runtime] cuda_graphs` off and on (and the steps that ran eagerly)
  hf       Hugging Face transformers eager (torch, float16, random weights of the same config) on the same GPU:
           time per step at the same batch sizes, and its ratio to hpcinfer's (target >= 3x)
  prefill  the prompt phase at batch 8 x 128 and x 512 tokens: achieved TFLOP/s (FLOPs of the forward counted
           by `prefill_flops`) against a cuBLAS GEMM (cupy.matmul) of the MLP's shape measured in the same run
  moe      gating + dispatch + combine on the device: CupyOps top_k_gating -> route -> permute -> unpermute
           against the one-hot einsum formulation (GShard / DeepSpeed) in CuPy, at decode and prefill token counts

    python -m bench.gpu [--out bench/results] [--only decode,moe] [--quick]

Writes bench/results/gpu-<YYYY-MM-DD>.json (device, driver and runtime versions, date, commit, every timing,
medians, ratios, checks; a section not run, or not runnable, holds {"skipped": reason}) and gpu-<date>.md.

Timing: CUDA events around the timed region when cupy has them (`cupy.cuda.get_elapsed_time`); otherwise (the CPU
stand-in of cupy, tests/helpers/emu_cupy/) time.perf_counter between stream synchronizations, and the JSON says which.
Decode and prefill are timed as hpcinfer's schedule times them (StepTimes: host wall clock per step, which ends
when the sampled tokens are on the host, so each step is synchronized), on the path `hpcinfer run` takes by default
(api.generate: continuous batching over the paged KV pool, every prompt running; prompt steps of up to 512 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from hpcinfer import api
from hpcinfer.arch import tensor_shapes
from hpcinfer.backend.cupy_ops import CupyOps, gpu_available
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.generate.engine import StepTimes
from hpcinfer.model.transformer import Decoder
from hpcinfer.quant.storage import DEFAULT_GROUP, LoadQuant
from hpcinfer.bench.common import git_commit, logger, machine_info, median
from .results import write_results

F32 = np.float32
SECTIONS = ("copy", "decode", "graphs", "hf", "prefill", "moe")
KV_ITEMSIZE = 4                 # the KV cache is float32 (generate/kv_cache.py)
log = logger("bench.gpu")


@dataclasses.dataclass(frozen=True)
class Settings:
    presets: tuple = ("gpt2-1.5b", "gpt-j-6b")
    dtype: str = "float16"
    copy_bytes: int = 1 << 30
    prompt_len: int = 128           # decode: the prompt before the timed steps
    new_tokens: int = 64            # decode: tokens generated (new_tokens - 1 timed decode steps)
    prefill_batch: int = 8
    prefill_lens: tuple = (128, 512)
    moe_tokens: tuple = (8, 2048)   # decode (8 sequences x 1 token) and prefill (8 x 256) token counts
    moe_experts: int = 128          # ds-moe-1.3b-128: E = 128, D = 2048, top-1, capacity factor 1.0, min 4
    moe_hidden: int = 2048
    moe_top_k: int = 1
    repeats: int = 5
    kernels: bool = True
    decode_batches: tuple = (1,)    # decode, graphs, hf: sequences per step (results keyed "<preset> x<B>" past 1)
    quantize: tuple = ("none",)     # decode, graphs, prefill: [model] quantize modes (keyed "<preset> <mode>")


QUICK = Settings(presets=("tiny-dense",), copy_bytes=8 << 20, prompt_len=12, new_tokens=4, prefill_batch=2,
                 prefill_lens=(8, 16), moe_tokens=(4, 32), moe_experts=8, moe_hidden=64, repeats=2)


# ---- what is counted ---------------------------------------------------------------------------------------------

def matrix_params(arch) -> tuple[int, int]:
    """(parameters of the per-token projection matrices of the layers, parameters of the LM head): the 2-D
    weights a token multiplies, without the embedding lookup and the position table."""
    head = arch.vocab_size * arch.hidden_size
    layers = sum(math.prod(shape) for name, shape in tensor_shapes(arch).items()
                 if len(shape) == 2 and name.startswith("layers."))
    return layers, head


def decode_bytes(arch, weight_itemsize: int, context: float, kv_itemsize: int = KV_ITEMSIZE, batch: int = 1,
                 layer_matrix_bytes: float | None = None) -> dict:
    """Bytes one decode step of `batch` sequences must read: every weight once (the matrices, the LM head, the 1-D
    norm and bias vectors, one embedding row and one position row) and the K and V of `context` cached positions
    per layer and sequence. layer_matrix_bytes: bytes per parameter of the layers' matrices when quantized (int8:
    1 + a float32 scale per output row, about 1.0), else weight_itemsize."""
    shapes = tensor_shapes(arch)
    vectors = sum(math.prod(s) for s in shapes.values() if len(s) == 1)
    layers, head = matrix_params(arch)
    rows = arch.hidden_size * (2 if arch.position == "learned" else 1)     # token (+ position) embedding row
    per_param = weight_itemsize if layer_matrix_bytes is None else layer_matrix_bytes
    weights = layers * per_param + (head + vectors + rows) * weight_itemsize
    kv = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * context * kv_itemsize * batch
    return {"weights": int(weights), "kv": float(kv), "total": float(weights + kv)}


def prefill_flops(arch, batch: int, length: int) -> int:
    """FLOPs of the prompt step of `batch` sequences of `length` tokens: 2 per multiply-add of the layers'
    projections for every token, the LM head at each sequence's last position only (as hpcinfer computes it), and
    causal attention (Q K^T and P V over the L (L + 1) / 2 query-key pairs of each head); norms, activations and
    softmax are left out."""
    layers, head = matrix_params(arch)
    tokens = batch * length
    pairs = length * (length + 1) // 2
    attention = arch.num_layers * batch * arch.num_heads * 2 * (2 * arch.head_dim * pairs)
    return 2 * layers * tokens + 2 * head * batch + attention


# ---- timing ------------------------------------------------------------------------------------------------------

class Timer:
    """Milliseconds of `fn()` on the device: CUDA events where cupy has them, else perf_counter between syncs."""

    def __init__(self, cp):
        self.cp = cp
        self.events = hasattr(cp.cuda, "get_elapsed_time") and not getattr(cp, "_emulated", False)
        self.method = "cuda-events" if self.events else "perf_counter+stream.synchronize"

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def __call__(self, fn) -> float:
        cp = self.cp
        if self.events:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(cp.cuda.get_elapsed_time(start, end))
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def repeat(self, fn, repeats: int, warmup: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        return [self(fn) for _ in range(repeats)]


# ---- sections ----------------------------------------------------------------------------------------------------

def bench_copy(cp, timer: Timer, s: Settings) -> dict:
    """dst[...] = src over `copy_bytes`; bandwidth counts the bytes read plus the bytes written (2 N / t), as
    CUDA's bandwidthTest reports a device-to-device copy."""
    n = s.copy_bytes // 4
    src = cp.arange(n, dtype=F32)
    dst = cp.empty_like(src)
    ms = timer.repeat(lambda dst=dst, src=src: cp.copyto(dst, src), max(s.repeats, 5))
    if not bool((dst[-1:] == src[-1:]).all()):
        raise RuntimeError("copy: the destination does not hold the source")
    t = median(ms) / 1e3
    del src, dst
    return {"bytes": n * 4, "ms": ms, "median_ms": median(ms), "GBps": 2 * n * 4 / t / 1e9}


QUANT_BYTES = {"none": None, "int8": 1.0, "asym8": 1.0, "int4": 0.5}   # per layer-matrix parameter, scales aside


def load_model(name: str, s: Settings, quantize: str = "none"):
    arch = PRESETS[name]
    t0 = time.perf_counter()
    model = Decoder(CupyOps(device=0, kernels=s.kernels), Groups(), arch, dtype=s.dtype).load(
        PresetSource(name, arch), quantize=None if quantize == "none" else LoadQuant(quantize, DEFAULT_GROUP))
    return model, arch, time.perf_counter() - t0


def generate(model, prompts, new_tokens: int, cuda_graphs: bool = False):
    """The run's StepTimes on the default path (api.generate: continuous batching, every prompt running)."""
    times = StepTimes()
    api.generate(model, prompts, new_tokens, cuda_graphs=cuda_graphs, times=times)
    return times


def prompts_of(arch, batch: int, length: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, arch.vocab_size, size=length).tolist() for _ in range(batch)]


def bench_decode(model, arch, s: Settings, cuda_graphs: bool, copy_GBps: float | None, batch: int = 1,
                 quantize: str = "none") -> dict:
    """Median step time of decode at `batch` sequences after `prompt_len` prompts, `new_tokens - 1` steps per
    generation, `repeats` generations after a warm-up one (which also compiles the kernels and, with graphs,
    captures)."""
    prompts = prompts_of(arch, batch, s.prompt_len)
    generate(model, prompts, s.new_tokens, cuda_graphs)                        # warm-up
    steps, captures, replays, eager = [], 0, 0, 0
    for _ in range(s.repeats):
        times = generate(model, prompts, s.new_tokens, cuda_graphs)
        steps += times.decode_s
        captures, replays = captures + times.graph_captures, replays + times.graph_replays
        eager += times.graph_eager_steps
    t = median(steps)
    # decode step j (1 .. new_tokens - 1) attends over prompt_len + j positions: the mean context
    context = s.prompt_len + s.new_tokens / 2
    nbytes = decode_bytes(arch, np.dtype(s.dtype).itemsize, context, batch=batch,
                          layer_matrix_bytes=QUANT_BYTES[quantize])
    res = {"cuda_graphs": cuda_graphs, "batch": batch, "tokens_per_s": batch / t, "steps": len(steps), "ms_per_token": t * 1e3,
           "step_ms": [x * 1e3 for x in steps], "mean_context": context, "bytes_per_token": nbytes,
           "GBps": nbytes["total"] / t / 1e9, "graph_captures": captures, "graph_replays": replays,
           "graph_eager_steps": eager}
    if copy_GBps:
        res["fraction_of_copy"] = res["GBps"] / copy_GBps
    return res


def bench_prefill(model, arch, s: Settings, cp, timer: Timer) -> dict:
    """Prompt phase of `prefill_batch` sequences at each length (StepTimes.prefill_s: the packed prompt step up to
    the first tokens on the host), against cupy.matmul of [B L, D] x [D, F] in float16 and float32."""
    out = {}
    for length in s.prefill_lens:
        if length + 1 > arch.max_positions:
            out[str(length)] = {"skipped": f"{length} tokens do not fit {arch.max_positions} positions"}
            continue
        prompts = prompts_of(arch, s.prefill_batch, length, seed=length)
        generate(model, prompts, 1)                                                # warm-up
        ts = [generate(model, prompts, 1).prefill_s for _ in range(s.repeats)]
        flops = prefill_flops(arch, s.prefill_batch, length)
        res = {"batch": s.prefill_batch, "length": length, "ms": [t * 1e3 for t in ts], "median_ms": median(ts) * 1e3,
               "flops": flops, "TFLOPs": flops / median(ts) / 1e12, "gemm": {}}
        m, k, n = s.prefill_batch * length, arch.hidden_size, arch.intermediate_size
        for dtype in ("float16", "float32"):
            a = cp.asarray(np.random.default_rng(0).standard_normal((m, k)).astype(dtype))
            b = cp.asarray(np.random.default_rng(1).standard_normal((k, n)).astype(dtype))
            ms = timer.repeat(lambda a=a, b=b: cp.matmul(a, b), s.repeats)
            tf = 2 * m * k * n / (median(ms) / 1e3) / 1e12
            res["gemm"][dtype] = {"shape": [m, k, n], "ms": ms, "TFLOPs": tf}
            res[f"fraction_of_gemm_{dtype}"] = res["TFLOPs"] / tf
            del a, b
        out[str(length)] = res
    return out


def hf_config(arch):
    """A transformers config of the same architecture and shapes, or (None, why not)."""
    import transformers

    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}.get(arch.activation)
    if act is None:
        return None, f"activation {arch.activation} has no transformers GPT-2/GPT-J equivalent here"
    common = dict(vocab_size=arch.vocab_size, n_positions=arch.max_positions, n_embd=arch.hidden_size,
                  n_layer=arch.num_layers, n_head=arch.num_heads, n_inner=arch.intermediate_size,
                  activation_function=act, tie_word_embeddings=arch.tied_embeddings)
    if arch.position == "learned" and arch.norm == "layernorm" and not arch.parallel_residual:
        return transformers.GPT2Config(**common), None
    if arch.position == "rotary" and arch.parallel_residual and arch.norm == "layernorm":
        return transformers.GPTJConfig(rotary_dim=arch.rotary_dim, **common), None
    return None, f"no transformers class mapped for family {arch.family}"


def bench_hf(arch, s: Settings, batch: int = 1) -> dict:
    """transformers eager, float16, random weights (timing only), `batch` sequences: median decode step time after
    `prompt_len` prompts, each step = forward of one token per sequence with the cache + argmax, synchronized."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"torch/transformers not importable: {exc}"}
    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA device here"}
    config, why = hf_config(arch)
    if config is None:
        return {"skipped": why}
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
        except TypeError:                                   # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float16)
    model.eval()
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, arch.vocab_size, (batch, s.prompt_len), device="cuda")
    steps = []
    with torch.inference_mode():
        for rnd in range(s.repeats + 1):                   # round 0: warm-up
            out = model(ids, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(s.new_tokens - 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                if rnd:
                    steps.append(time.perf_counter() - t)
    res = {"weights": "random (same config, timing only)", "class": type(model).__name__,
           "attn_implementation": getattr(model.config, "_attn_implementation", None), "load_s": load_s,
           "params": sum(p.numel() for p in model.parameters()), "hpcinfer_params": arch.param_count(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "batch": batch, "step_ms": [x * 1e3 for x in steps], "ms_per_token": median(steps) * 1e3}
    del model, past, out
    torch.cuda.empty_cache()
    return res


# ---- MoE: table/scan ops against the one-hot einsum path -----------------------------------------------------------

def einsum_moe(xp, x, logits, scale, k: int, normalize: str, capacity: int):
    """GShard / DeepSpeed's one-hot formulation in array code (xp = cupy or numpy; tests/helpers/moe_reference.py's
    einsum_gating + dispatch + combine): masks and combine weights [T, E, C], dispatched [E, C, D] =
    einsum("tec,td->ecd"), the per-expert op (x * scale[e]), combine einsum("tec,ecd->td") -> [T, D]."""
    T, E = logits.shape
    C = capacity
    z = logits - logits.max(axis=1, keepdims=True)
    gates = xp.exp(z)
    gates = gates / gates.sum(axis=1, keepdims=True)                              # [T, E]
    eye_e = xp.eye(E, dtype=F32)
    masks, remaining = [], gates.copy()
    for _ in range(k):
        mask = eye_e[xp.argmax(remaining, axis=1)]                                # [T, E] one-hot
        masks.append(mask)
        remaining = xp.where(mask > 0, F32(-np.inf), remaining)
    mask = xp.stack(masks, axis=1)                                                # [T, K, E]
    gate = xp.einsum("te,tke->tk", gates, mask)                                   # [T, K]
    if normalize == "topk":
        gate = gate / gate.sum(axis=1, keepdims=True)
    locations = xp.cumsum(mask.reshape(T * k, E), axis=0).reshape(T, k, E) - 1   # [T, K, E]
    mask = mask * (locations < C)
    location = xp.einsum("tke,tke->tk", locations, mask).astype(np.int64)        # [T, K]
    eye_c = xp.eye(C, dtype=F32)
    combine = xp.zeros((T, E, C), dtype=F32)
    dispatch = xp.zeros((T, E, C), dtype=F32)
    for choice in range(k):
        slot = eye_c[location[:, choice]]                                         # [T, C]
        kept = mask[:, choice]                                                    # [T, E]
        combine += xp.einsum("te,tc->tec", gate[:, choice, None] * kept, slot)
        dispatch += xp.einsum("te,tc->tec", kept, slot)
    dispatched = xp.einsum("tec,td->ecd", dispatch, x)                            # [E, C, D]
    return xp.einsum("tec,ecd->td", combine, dispatched * scale[:, None, None])   # [T, D]


def table_moe(ops, x, logits, scale, k: int, normalize: str, capacity: int):
    """The model's path: top-k gating -> routing tables (device scan) -> permute -> x * scale[e] -> unpermute."""
    experts, weights = ops.top_k_gating(logits, k, normalize)                     # [T, K]
    routing = ops.route(experts, weights, logits.shape[1], capacity)
    rows = ops.permute(x, routing)                                                # [R, D]
    rows = rows * scale[routing.expert_of_row][:, None]
    return ops.unpermute(rows, routing, x.shape[0])                               # [T, D]


def moe_capacity(tokens: int, k: int, experts: int, factor: float = 1.0, minimum: int = 4) -> int:
    """DeepSpeed's: ceil(T k / E * factor), at least `minimum` (and at most T)."""
    return min(tokens, max(math.ceil(tokens * k / experts * factor), minimum))


def bench_moe(cp, timer: Timer, s: Settings) -> dict:
    ops = CupyOps(device=0, kernels=s.kernels)
    E, D, k = s.moe_experts, s.moe_hidden, s.moe_top_k
    out = {"experts": E, "hidden": D, "top_k": k, "normalize": "none", "capacity_factor": 1.0, "cells": {}}
    for T in s.moe_tokens:
        rng = np.random.default_rng(T)
        x = cp.asarray(rng.standard_normal((T, D)).astype(F32))
        logits = cp.asarray(rng.standard_normal((T, E)).astype(F32))
        scale = cp.asarray(rng.uniform(0.5, 1.5, E).astype(F32))
        C = moe_capacity(T, k, E)
        a = table_moe(ops, x, logits, scale, k, "none", C)
        b = einsum_moe(cp, x, logits, scale, k, "none", C)
        err = float(cp.abs(a - b).max()) if T else 0.0
        table_ms = timer.repeat(lambda x=x, g=logits, w=scale: table_moe(ops, x, g, w, k, "none", C), s.repeats)
        einsum_ms = timer.repeat(lambda x=x, g=logits, w=scale: einsum_moe(cp, x, g, w, k, "none", C),
                                 s.repeats)
        out["cells"][str(T)] = {"tokens": T, "capacity": C, "table_ms": table_ms, "einsum_ms": einsum_ms,
                                "table_median_ms": median(table_ms), "einsum_median_ms": median(einsum_ms),
                                "speedup": median(einsum_ms) / median(table_ms), "max_abs_diff": err}
        del x, logits, scale, a, b
    return out


# ---- the run -----------------------------------------------------------------------------------------------------

def device_info(cp) -> dict:
    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props.get("name", b"?")
    return {"name": name.decode() if isinstance(name, bytes) else str(name), "driver": rt.driverGetVersion(),
            "runtime": rt.runtimeGetVersion(), "cupy": cp.__version__, "emulated": bool(getattr(cp, "_emulated", 0)),
            "memory_GiB": round(props.get("totalGlobalMem", 0) / 2**30, 1)}


def free(cp) -> None:
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


def guarded(what: str, fn, *args):
    """fn(*args), or {"error": ...} when it raises: one failing section (a capture refused, out of memory) must not
    cost the rest of a one-shot GPU run."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded in the results and logged with its traceback
        log(f"{what} failed:\n{traceback.format_exc()}")
        return {"error": f"{type(exc).__name__}: {exc}"}


def decode_key(name: str, batch: int) -> str:
    """A decode cell's name: the preset at batch 1, "<preset> x<B>" at batch B."""
    return name if batch == 1 else f"{name} x{batch}"


def model_label(name: str, quantize: str) -> str:
    """A loaded model's name in the results: the preset, "<preset> <mode>" when quantized while loading."""
    return name if quantize == "none" else f"{name} {quantize}"


def decode_and_graphs(res: dict, only: set, model, arch, s: Settings, copy_GBps, name: str, batch: int, save,
                      quantize: str = "none"):
    """The decode and graphs cells of one preset at one batch size (graphs reuse decode's eager timing)."""
    key = decode_key(model_label(name, quantize), batch)
    if "decode" in only:
        log(f"{key}: decode")
        res["decode"][key] = guarded(f"{key}: decode", bench_decode, model, arch, s, False, copy_GBps, batch, quantize)
        save(res)
    if "graphs" in only:
        log(f"{key}: decode, cuda_graphs off and on")
        off = res["decode"].get(key, {}) if "decode" in only else {}
        if "ms_per_token" not in off:
            off = guarded(f"{key}: decode", bench_decode, model, arch, s, False, copy_GBps, batch, quantize)
        on = guarded(f"{key}: decode with cuda_graphs", bench_decode, model, arch, s, True, copy_GBps, batch, quantize)
        both = "ms_per_token" in off and "ms_per_token" in on
        res["graphs"][key] = {"off_ms_per_token": off.get("ms_per_token"), "on_ms_per_token": on.get("ms_per_token"),
                              "speedup": off["ms_per_token"] / on["ms_per_token"] if both else None,
                              "off": off, "on": on}
        save(res)


def run(s: Settings, only: set, save=lambda sections: None) -> dict:
    """Every selected section; `save(sections)` after each one, so that a run cut short keeps what it measured."""
    import cupy as cp

    timer = Timer(cp)
    res = {name: {"skipped": "not selected (--only)"} for name in SECTIONS}
    res["timer"] = timer.method
    copy_GBps = None
    if only & {"copy", "decode", "graphs"}:
        log(f"copy: {s.copy_bytes >> 20} MiB")
        res["copy"] = guarded("copy", bench_copy, cp, timer, s)
        copy_GBps = res["copy"].get("GBps")
        free(cp)
        save(res)
    if "moe" in only:                                   # cheap and independent of the presets: early
        log("moe: table/scan vs one-hot einsum")
        res["moe"] = guarded("moe", bench_moe, cp, timer, s)
        free(cp)
        save(res)
    for section in ("decode", "graphs", "hf", "prefill"):
        if section in only:
            res[section] = {}
    for name in s.presets:
        model_sections = [x for x in ("decode", "graphs", "prefill") if x in only]
        for quantize in s.quantize if model_sections else ():
            label = model_label(name, quantize)
            log(f"{label}: loading {s.dtype} dummy weights")
            loaded = guarded(f"{label}: load", load_model, name, s, quantize)
            if isinstance(loaded, dict):
                for section in model_sections:
                    res[section][label] = loaded
                continue
            model, arch, load_s = loaded
            device_bytes = cp.get_default_memory_pool().used_bytes()
            for batch in s.decode_batches:
                decode_and_graphs(res, only, model, arch, s, copy_GBps, name, batch, save, quantize)
            if "decode" in only:
                first = decode_key(label, s.decode_batches[0])
                res["decode"][first].update(load_s=load_s, device_bytes_after_load=device_bytes)
            if "prefill" in only:
                log(f"{label}: prefill")
                res["prefill"][label] = guarded(f"{label}: prefill", bench_prefill, model, arch, s, cp, timer)
                save(res)
            del model
            free(cp)
        if "hf" in only:
            for batch in s.decode_batches:
                key = decode_key(name, batch)
                log(f"{key}: transformers eager")
                hf = guarded(f"{key}: transformers", bench_hf, PRESETS[name], s, batch)
                ours = res["decode"].get(key, {}) if "decode" in only else {}
                if "ms_per_token" in hf:
                    hf["hpcinfer_speedup"] = (hf["ms_per_token"] / ours["ms_per_token"] if "ms_per_token" in ours
                                              else None)
                res["hf"][key] = hf
                save(res)
    return res


def _f(v, fmt=".3g"):
    return "-" if v is None else format(v, fmt)


def _why(r: dict) -> str | None:
    """'skipped: ...' or 'error: ...' for a result that holds no numbers, else None."""
    for key in ("skipped", "error"):
        if key in r:
            return f"{key}: {r[key]}"
    return None


def _prefill_rows(part: dict):
    for name, cells in part.items():
        if _why(cells):
            yield name, cells
            continue
        for length, r in cells.items():
            yield f"{name}, {r.get('batch', '')} x {length}", r


def report(result: dict) -> str:
    d, sec = result["device"], result["sections"]
    lines = [f"# GPU benchmark {result['date']}", "",
             f"{d['name']} (driver {d['driver']}, runtime {d['runtime']}, cupy {d['cupy']}"
             f"{', EMULATED: the times mean nothing' if d['emulated'] else ''}), commit {result['commit']}, "
             f"weights {result['settings']['dtype']} (random), timer: {sec['timer']}.", ""]

    def table(title: str, name: str, header: list, rows) -> None:
        lines.extend([f"## {title}", ""])
        if _why(sec[name]):
            lines.extend([_why(sec[name]), ""])
            return
        lines.extend(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)])
        for key, r in rows(sec[name]):
            cells = [_why(r)] + [""] * (len(header) - 2) if _why(r) else row_of[name](r)
            lines.append("| " + " | ".join([str(key), *cells]) + " |")
        lines.append("")

    row_of = {
        "decode": lambda r: [_f(r["ms_per_token"]), _f(r["GBps"]), _f(r.get("fraction_of_copy"))],
        "graphs": lambda r: [_f(r["off_ms_per_token"]), _f(r["on_ms_per_token"]), _f(r["speedup"])],
        "hf": lambda r: [_f(r["ms_per_token"]), _f(r.get("hpcinfer_speedup"))],
        "prefill": lambda r: [_f(r["median_ms"]), _f(r["TFLOPs"]), _f(r["gemm"]["float16"]["TFLOPs"]),
                              _f(r["fraction_of_gemm_float16"]), _f(r["gemm"]["float32"]["TFLOPs"]),
                              _f(r["fraction_of_gemm_float32"])],
        "moe": lambda r: [str(r["capacity"]), _f(r["table_median_ms"]), _f(r["einsum_median_ms"]),
                          _f(r["speedup"]), _f(r["max_abs_diff"], ".1e")],
    }
    lines.extend(["## Device-to-device copy", ""])
    c = sec["copy"]
    lines.extend([_why(c) or f"{c['bytes'] >> 20} MiB: {c['median_ms']:.3g} ms, {c['GBps']:.4g} GB/s (bytes read + "
                  f"written)", ""])
    per_preset = lambda part: part.items()
    table("Decode (preset x B: B sequences a step)", "decode",
          ["preset", "ms/step", "GB/s (weights + KV read)", "of copy (target 0.8)"], per_preset)
    table("CUDA graphs, decode", "graphs", ["preset", "off ms/step", "on ms/step", "speedup"], per_preset)
    table("transformers eager (float16, random weights of the same config)", "hf",
          ["preset", "ms/step", "hpcinfer speedup (target 3)"], per_preset)
    table("Prompt phase", "prefill", ["preset, tokens", "ms", "TFLOP/s", "cuBLAS fp16 TFLOP/s", "of fp16",
                                      "cuBLAS fp32 TFLOP/s", "of fp32"],
          _prefill_rows)
    m = sec["moe"]
    title = "MoE gating + dispatch + combine, table/scan vs one-hot einsum (paper: > 6x)"
    if not _why(m):
        title += f" (E = {m['experts']}, D = {m['hidden']}, top-{m['top_k']}, capacity factor 1.0)"
    table(title, "moe", ["tokens", "capacity", "table/scan ms", "one-hot einsum ms", "speedup", "max abs diff"],
          lambda part: [(r["tokens"], r) for r in part["cells"].values()])
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench/results", help="folder for gpu-<date>.json and .md")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--quick", action="store_true", help="small shapes (tiny-dense, 8 MiB copy, ...): a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    p.add_argument("--decode-batch", default=None, help="comma-separated sequences per decode step for the decode, "
                                                         "graphs and hf sections (default 1)")
    p.add_argument("--quantize", default="none", help="comma-separated [model] quantize modes for the decode, graphs "
                   "and prefill sections, each loaded in turn (e.g. none,int8: float16 and int8 weights)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, where .git is)")
    p.add_argument("--preset", action="append", help=argparse.SUPPRESS)          # tests: other presets
    p.add_argument("--no-kernels", action="store_true", help=argparse.SUPPRESS)   # plain-CuPy ops (faster fake)
    p.add_argument("--name", default="gpu", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if only - set(SECTIONS):
        raise SystemExit(f"bench.gpu: unknown sections {sorted(only - set(SECTIONS))}; choose from {SECTIONS}")
    s = QUICK if args.quick else Settings()
    s = dataclasses.replace(s, presets=tuple(args.preset) if args.preset else s.presets,
                            repeats=args.repeats or s.repeats, kernels=not args.no_kernels,
                            decode_batches=_batches(args.decode_batch) if args.decode_batch else s.decode_batches,
                            quantize=_modes(args.quantize))
    if not gpu_available():
        raise SystemExit("bench.gpu: cupy sees no CUDA GPU here (pip install -e '.[gpu]'; docs/gpu.md)")
    import cupy as cp

    started = _dt.datetime.now().astimezone()
    t0 = time.perf_counter()
    result = {"schema": "hpcinfer-bench-gpu/1", "date": started.date().isoformat(), "started": started.isoformat(),
              "commit": args.commit or git_commit(), "argv": sys.argv if argv is None else list(argv),
              "quick": args.quick, "device": device_info(cp), "machine": machine_info(),
              "settings": dataclasses.asdict(s), "partial": True, "warnings": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{args.name}-{result['date']}.json"

    def save(sections):
        """The results so far ("partial": true), overwritten by the final write."""
        partial.write_text(json.dumps({**result, "sections": sections, "elapsed_s": time.perf_counter() - t0},
                                      indent=1, default=str) + "\n")

    sections = run(s, only, save)
    result.update(sections=sections, elapsed_s=time.perf_counter() - t0, partial=False)
    for name, r in (sections.get("decode") or {}).items():
        if isinstance(r, dict) and r.get("fraction_of_copy") is not None and r["fraction_of_copy"] < 0.8:
            result["warnings"].append(f"decode {name}: {r['fraction_of_copy']:.2f} of the copy bandwidth (< 0.8)")
    for name in SECTIONS:
        for where, r in _errors(sections[name], name):
            result["warnings"].append(f"{where} failed: {r}")
    write_results(args.out, args.name, result, report(result), log)
    return 0


def _modes(text: str) -> tuple:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or set(modes) - set(QUANT_BYTES):
        raise SystemExit(f"bench.gpu: --quantize {text!r}: choose from {', '.join(QUANT_BYTES)}")
    return modes


def _batches(text: str) -> tuple:
    try:
        batches = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise SystemExit(f"bench.gpu: --decode-batch {text!r}: give sequence counts >= 1, such as 1,16")
    return batches


def _errors(part, where: str):
    """(where, message) of every {"error": ...} inside a section's results."""
    if isinstance(part, dict):
        if "error" in part:
            yield where, part["error"]
        else:
            for key, value in part.items():
                yield from _errors(value, f"{where}.{key}")


if __name__ == "__main__":
    sys.exit(main())
