"""What the paper scenarios of gpu/scenarios.py share (issue 32): the model shapes (OPT-30B, Mixtral-8x7B, a dense
model of Mixtral's active size, and tiny ones of the same kinds for the rehearsal on the cupy stand-in), a fast
random weight source, building a model as `hpcinfer run` builds it (its offload tiers placed block by block), one
generation run with its figures, the links and device rates measured in the run, and the results file that is
rewritten after every case (a step cut by its timeout keeps the cases that ended).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time
import types
import zlib
from pathlib import Path

import numpy as np

from hpcinfer.arch import ModelArch
from hpcinfer.checkpoint.presets import PRESETS, PresetSource, init_of
from hpcinfer.comm.group import Groups, MoELayout
from hpcinfer.config import OffloadSection
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules import run_block
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.model.transformer import Decoder
from hpcinfer.offload import profile_gpu
from hpcinfer.quant.kv import kv_format
from hpcinfer.quant.storage import load_quant
from hpcinfer.runtime import _weight_tiers

GB = 1e9
QUANT_GROUP = 64                  # int4 weights and KV: groups of 64 (the config defaults)


# ---- shapes ------------------------------------------------------------------------------------------------------

def opt_30b(layers: int = 48) -> ModelArch:
    """OPT-30B's shapes (FlexGen's headline model): D 7168, 56 heads, F 28672, vocabulary 50272, ReLU, LayerNorm,
    learned positions, biases, tied embeddings: ~30 B parameters, ~60 GB in float16 at 48 layers."""
    return ModelArch(family="opt", vocab_size=50272, hidden_size=7168, num_layers=layers, num_heads=56,
                     num_kv_heads=56, head_dim=128, intermediate_size=28672, max_positions=2048, activation="relu",
                     qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=True)


def mixtral_8x7b(layers: int = 32, experts: int = 8) -> ModelArch:
    """Mixtral-8x7B's shapes: D 4096, 32 heads over 8 KV heads, 8 experts of F 14336 (SwiGLU), top-2, RMSNorm,
    rotary (theta 1e6): 46.7 B parameters at 32 layers, 12.9 B active per token."""
    return ModelArch(family="mixtral", vocab_size=32000, hidden_size=4096, num_layers=layers, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=14336, max_positions=4096, norm="rmsnorm",
                     position="rotary", rotary_dim=128, rope_theta=1e6, activation="silu", gated_mlp=True,
                     moe_experts=(experts,) * layers, moe_top_k=2, moe_intermediate_size=14336)


def dense_of_active(arch: ModelArch) -> ModelArch:
    """The dense model with an MoE model's active parameters per token: one MLP of top_k experts' width."""
    width = (arch.moe_intermediate_size or arch.intermediate_size) * arch.moe_top_k
    return dataclasses.replace(arch, family="llama", intermediate_size=width, moe_experts=(), moe_top_k=1,
                               moe_intermediate_size=0)


def preset_layers(name: str, layers: int) -> ModelArch:
    """A preset cut to its first `layers` layers (an MoE preset keeps its every-other-layer experts)."""
    arch = PRESETS[name]
    experts = tuple(arch.moe_experts[:layers]) if arch.moe_experts else ()
    return dataclasses.replace(arch, num_layers=layers, moe_experts=experts)


def tiny_opt(layers: int = 4) -> ModelArch:
    """The rehearsal's OPT: tiny-dense's sizes with OPT's features."""
    return dataclasses.replace(opt_30b(layers), vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=4,
                               head_dim=16, intermediate_size=256, max_positions=128)


def tiny_mixtral(layers: int = 2) -> ModelArch:
    return dataclasses.replace(mixtral_8x7b(layers), vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2,
                               head_dim=16, rotary_dim=16, intermediate_size=128, moe_intermediate_size=128,
                               max_positions=128)


# ---- weights -----------------------------------------------------------------------------------------------------

class FastRandomSource(PresetSource):
    """Random weights at memory speed: every tensor is a window of one pool of 2^22 uniform values (std 1) at an
    offset of its own, scaled to the tensor's init std (presets.init_of), in `dtype`. The preset's own draw
    (a PCG stream per tensor, float32) takes minutes for 30 B parameters; the scenarios measure transfers and
    kernels, for which distinct random-looking values per layer are enough."""

    POOL = 1 << 22

    def __init__(self, name: str, arch: ModelArch, dtype: str = "float16", seed: int = 0):
        super().__init__(name, arch, seed)
        pool = np.random.default_rng(seed).uniform(-np.sqrt(3.0), np.sqrt(3.0), 2 * self.POOL)
        self._pool = pool.astype(np.float32)
        self.out_dtype = np.dtype(dtype)

    def _make(self, name: str, index: tuple) -> np.ndarray:
        shape = self.shape(name)
        init = init_of(self.arch, name)
        sub = tuple(range(*s.indices(n)) for s, n in zip(index, shape))
        out_shape = tuple(len(r) for r in sub) + shape[len(index):]
        if init in ("zeros", "ones"):
            return np.full(out_shape, 0.0 if init == "zeros" else 1.0, np.float32)
        out = np.empty(out_shape, self.out_dtype)
        flat, start = out.reshape(-1), zlib.crc32(name.encode()) % self.POOL
        std = np.float32(init)
        for at in range(0, flat.size, self.POOL):
            n = min(self.POOL, flat.size - at)
            np.multiply(self._pool[start:start + n], std, out=flat[at:at + n], casting="unsafe")
        return out


# ---- building and running ----------------------------------------------------------------------------------------

def build(ops, arch: ModelArch, dtype: str, off: OffloadSection | None = None, one_hot: bool = False,
          quantize: str = "none", kv_cache: str = "none") -> Decoder:
    """The model as `hpcinfer run` builds it: tiers from [offload] placed block by block as they load; quantize
    and kv_cache as `[model] quantize` / `kv_cache` (int4: groups of 64)."""
    groups = Groups(moe=MoELayout(dispatch="one-hot")) if one_hot else Groups()
    model = Decoder(ops, groups, arch, dtype)
    if off is not None and off.active:
        model.weights = _weight_tiers(types.SimpleNamespace(offload=off), model, ops, 0)
    source = FastRandomSource("scenario", arch, "float16" if dtype == "float16" else "float32")
    quant = load_quant(source, quantize, QUANT_GROUP) if quantize != "none" else None
    model.load(source, after_block=model.weights.place if model.weights is not None else None, quantize=quant)
    return model.set_attention(kv_format(kv_cache, QUANT_GROUP, arch.head_dim))


def prompts_for(arch: ModelArch, batch: int, length: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, arch.vocab_size, size=length).tolist() for _ in range(batch)]


def generate(model: Decoder, prompts: list, new_tokens: int, off: OffloadSection | None, sync) -> dict:
    """One whole generation of the batch (offloaded when [offload] is active): its figures."""
    times = StepTimes()
    params = GenerationParams(new_tokens, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    if off is not None and off.active:
        run_block(Runner(model, params), prompts, list(range(len(prompts))), times, ScheduleParams(), off)
    else:
        generate_batch(model, prompts, list(range(len(prompts))), params, times)
    sync()
    run_s = time.perf_counter() - t0
    tiers = model.weights
    return {"run_s": run_s, "prefill_s": times.prefill_s, "decode_step_s": [float(s) for s in times.decode_s],
            "decode_median_s": statistics.median(times.decode_s) if times.decode_s else None,
            "generated": len(prompts) * new_tokens, "tokens_per_s": len(prompts) * new_tokens / run_s,
            "weights_bytes_from_host": tiers.bytes_from_host if tiers is not None else 0,
            "kv_bytes_to_device": times.kv_bytes_to_device, "kv_bytes_to_host": times.kv_bytes_to_host}


def measure(cp, copy_bytes: int) -> dict:
    """The links and rates of this run: pinned host <-> device (as the copy engine copies), pageable host ->
    device, device -> device copy, the device's float32 matmul."""
    return {**profile_gpu.measure_links(cp, copy_bytes), **profile_gpu.measure_device(cp, 1024)}


def sync_of(ops):
    return lambda: ops.xp.cuda.Device().synchronize()


def release(model, ops) -> None:
    """Drop a model's device memory before the next one is built."""
    if getattr(model, "weights", None) is not None:
        model.weights.close()
    del model
    gc.collect()
    ops.xp.get_default_memory_pool().free_all_blocks()
    ops.xp.get_default_pinned_memory_pool().free_all_blocks()     # the host tier's pinned layers go back too


# ---- results -----------------------------------------------------------------------------------------------------

class Results:
    """One scenario's results: {"scenario", "scale", "cases": {name: figures}, ...}, rewritten (atomically) after
    every case, and each case's line printed as it ends (gpu/check.py keeps the child's output in log.txt)."""

    def __init__(self, path: Path, scenario: str, scale: str, budget_s: float):
        self.path, self.deadline = Path(path), time.monotonic() + budget_s
        self.data = {"scenario": scenario, "scale": scale, "budget_s": budget_s, "cases": {}, "skipped": {}}
        self.write()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, case: str, figures: dict) -> None:
        self.data["cases"][case] = figures
        self.write()
        brief = {k: v for k, v in figures.items() if not isinstance(v, (list, dict))}
        print(f"[{self.data['scenario']}] {case}: {json.dumps(brief, default=_num)}", flush=True)

    def skip(self, case: str, why: str) -> None:
        self.data["skipped"][case] = why
        self.write()
        print(f"[{self.data['scenario']}] {case}: skipped ({why})", flush=True)

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_num) + "\n")
        os.replace(tmp, self.path)


def _num(v):
    return float(v) if isinstance(v, np.generic) else str(v)


def guarded(results: Results, case: str, need_s: float, fn) -> dict | None:
    """Run fn() as `case` when at least need_s seconds are left (else skip it); its figures are recorded, and an
    error is recorded as the case's result instead of ending the scenario."""
    if results.left() < need_s:
        results.skip(case, f"{results.left():.0f} s left, the case needs about {need_s:.0f}")
        return None
    t0 = time.monotonic()
    try:
        figures = fn()
    except Exception as exc:  # noqa: BLE001 - one case failing leaves the others
        figures = {"error": f"{type(exc).__name__}: {exc}"}
    figures["case_s"] = round(time.monotonic() - t0, 2)
    results.add(case, figures)
    return figures
