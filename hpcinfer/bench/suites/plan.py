"""Which cells a suite runs: every (layout, batch) that fits the model, each as hpcinfer and as the naive path
kept for comparison where the code has one; and the suite's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...checkpoint.format import open_checkpoint
from ...checkpoint.presets import PRESETS
from ...generate.tokenizer import TextTokenizer
from ..common import make_prompts
from .cells import Cell
from .config import BenchConfig, Layout, Suite

DEFAULT_ALL_TO_ALL = "pcc+hierarchical"      # docs/config.md [moe] all_to_all
ROW_OFFLOAD = {"schedule": "row", "cache_gpu": 100.0, "cache_cpu": 0.0, "cpu_attention": False}
ONE_HOT = {"moe": {"dispatch": "one-hot"}}   # GShard / DeepSpeed one-hot einsum gating (backend/moe_onehot.py)
CUDA_GRAPHS = "CUDA graphs"                  # the variant with [runtime] cuda_graphs = true (off by default)
NO_GRAPHS_CPU = "GPU backend only: the NumPy backend has no fused kernels and no CUDA graphs"


def model_arch(suite: Suite):
    """The suite's model architecture (a preset's, or read from the checkpoint's attributes)."""
    if suite.model.preset is not None:
        return PRESETS[suite.model.preset]
    with open_checkpoint(suite.model.checkpoint) as ckpt:
        return ckpt.arch


def is_moe(arch) -> bool:
    return any(arch.moe_experts)


def layout_skip(suite: Suite, lay: Layout, moe: bool) -> str:
    """Why `lay` cannot run `suite` at all ("" = it can)."""
    if not moe and (lay.ep > 1 or lay.expert_tp > 1):
        return "ep / expert_tp > 1 need an MoE model"
    if moe and (lay.ranks // lay.pp) != lay.ep * lay.expert_tp:
        return (f"an MoE layout needs ep * expert_tp = ranks / pp (docs/moe.md): {lay.ep} * {lay.expert_tp} != "
                f"{lay.ranks // lay.pp}")
    if suite.offload and lay.pp > 1:
        return "[offload] streams one pipeline stage's layers: pp = 1 only"
    if suite.offload and moe and lay.dp > 1:
        return "[offload] with an MoE model needs dp = 1"
    return ""


def batch_skip(lay: Layout, batch: int, moe: bool) -> str:
    if moe and batch < lay.dp:
        return f"batch {batch} < dp = {lay.dp}: a replica would get no sequence"
    if not moe and batch % lay.dp:
        return f"batch {batch} is not a multiple of dp = {lay.dp} (each replica runs one batch of batch / dp)"
    return ""


def naive_variants(suite: Suite, lay: Layout, moe: bool) -> dict:
    """{variant name: config sections} of the naive paths that apply to this layout."""
    out = {}
    if moe and not suite.offload:
        out["one-hot MoE dispatch"] = {name: dict(table) for name, table in ONE_HOT.items()}
    if moe and lay.ranks > 1 and lay.ep > 1 and (lay.all_to_all or DEFAULT_ALL_TO_ALL) != "flat":
        out["flat all-to-all"] = {"moe": {"all_to_all": "flat"}}
    if suite.offload and suite.offload.get("schedule") != "row":
        out["row-by-row offload"] = {"offload": dict(ROW_OFFLOAD)}
    return out


def graphs_skip(suite: Suite, moe: bool, backend: str) -> str:
    """Why the CUDA graphs variant does not apply to a suite ("" = it is planned beside every hpcinfer cell).
    The set-up checks it mirrors: config._check_cuda_graphs and generate/graphs.check_model."""
    if backend != "cupy":
        return NO_GRAPHS_CPU
    if suite.offload:
        return "cannot capture layers whose weights or KV are streamed ([offload])"
    if moe:
        return "cannot capture MoE layers: their per-expert row counts go to the host every step"
    return ""


def tuned_variants(suite: Suite, moe: bool, backend: str) -> dict:
    """{variant name: config sections} of the tuned paths hpcinfer runs off by default; each is compared with the
    layout's hpcinfer cell as its baseline (CUDA graphs on against the default, off)."""
    if graphs_skip(suite, moe, backend):
        return {}
    return {CUDA_GRAPHS: {"runtime": {"cuda_graphs": True}}}


def plan_cells(cfg: BenchConfig, suite: Suite, arch, backend: str = "numpy") -> list[Cell]:
    """Every (layout, batch) as hpcinfer, then its naive and tuned variants, on `backend` (resolved)."""
    moe = is_moe(arch)
    chosen = [lay for lay in cfg.layouts if not suite.layouts or lay.name in suite.layouts]
    cells = []
    for lay in chosen:
        why = layout_skip(suite, lay, moe)
        for batch in suite.batches:
            skip = why or batch_skip(lay, batch, moe)
            cells.append(Cell(suite, lay, batch, "hpcinfer", {}, moe, skip, backend))
            if not skip:
                variants = naive_variants(suite, lay, moe) | tuned_variants(suite, moe, backend)
                cells += [Cell(suite, lay, batch, name, extra, moe, backend=backend)
                          for name, extra in variants.items()]
    return cells


def suite_prompts(suite: Suite, arch) -> list[list[int]]:
    """max(batches) prompts of prompt_len tokens: real text when the checkpoint has a tokenizer (as bench/cpu.py),
    else random ids below the vocabulary (fixed seed)."""
    count, length = max(suite.batches), suite.prompt_len
    tokenizer = None
    if suite.model.checkpoint is not None:
        with open_checkpoint(suite.model.checkpoint) as ckpt:
            tokenizer = TextTokenizer.from_checkpoint(ckpt)
    if tokenizer is not None:
        prompts = make_prompts(tokenizer, count, length)
    else:
        prompts = np.random.default_rng(0).integers(0, arch.vocab_size, size=(count, length)).tolist()
    return prompts


def write_prompts(prompts: list, path: Path) -> Path:
    """A prompt file of token ids ({"id", "tokens"} JSON Lines, docs/formats.md)."""
    path.write_text("".join(json.dumps({"id": f"p{i:04d}", "tokens": p}) + "\n" for i, p in enumerate(prompts)))
    return path
