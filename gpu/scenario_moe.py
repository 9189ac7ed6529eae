"""The DeepSpeed-MoE scenario of issue 32 (gpu/scenarios.py runs it): sparse models decoded at the cost of their
active parameters, on one GPU (ep = 1).

Models: Mixtral-8x7B's shapes (8 experts, top-2) and the ds-moe-1.3b-128 preset (128 experts every other layer,
top-1), each cut to a few layers (the per-layer cost is what is compared; the layer count is in the results), in
float16, and the dense model of Mixtral's active size (one MLP as wide as its top-2 experts). Cases, at decode
batch 1 .. 64: the median decode step against the roofline of the bytes it must read (every non-expert weight, the
experts the batch's tokens hit: E (1 - (1 - k/E)^B) of each MoE layer's E under uniform routing, and the KV cache)
at the device copy bandwidth measured in the run (fraction_of_roofline = roofline_s / step_s); the same with
one-hot gating (`[moe] dispatch = "one-hot"`, GShard's einsums) against the table gating (onehot_over_table);
the MoE step against the dense model's step at the same batch. The expert GEMMs run through
CupyOps.expert_linear, where issue 29's small-batch GEMM switches in.
"""

from __future__ import annotations

import dataclasses
import math

from hpcinfer.arch import tensor_shapes

from .scenario_common import (build, dense_of_active, generate, guarded, measure, mixtral_8x7b, preset_layers,
                              prompts_for, release, sync_of, tiny_mixtral)

KV_ITEMSIZE = 4                          # the float32 KV cache ([model] kv_cache = "none")


@dataclasses.dataclass(frozen=True)
class MoeScale:
    mixtral_layers: int
    ds_layers: int
    batches: tuple
    prompt: int
    gen: int
    copy_bytes: int
    need_s: float                        # seconds a model's cases need at least (else skipped)


SCALES = {"full": MoeScale(2, 2, (1, 4, 16, 64), 32, 6, 256 * 2**20, 20),
          "tiny": MoeScale(2, 2, (1, 2), 4, 2, 1 << 20, 1)}


def models(scale: str) -> list:
    """(name, arch, one-hot too) of the scenario."""
    s = SCALES[scale]
    mixtral = mixtral_8x7b(s.mixtral_layers) if scale == "full" else tiny_mixtral(s.mixtral_layers)
    ds = preset_layers("ds-moe-1.3b-128" if scale == "full" else "tiny-moe", s.ds_layers)
    return [("mixtral-8x7b", mixtral, True), ("ds-moe-1.3b-128" if scale == "full" else "tiny-moe", ds, True),
            ("dense-of-mixtral-active", dense_of_active(mixtral), False)]


def step_bytes(arch, batch: int, context: float, itemsize: int = 2) -> dict:
    """Bytes one decode step of `batch` sequences reads: the non-expert weights, each MoE layer's experts that the
    batch hits (expected under uniform routing), the K and V of `context` positions per sequence."""
    dense = experts = 0.0
    for name, shape in tensor_shapes(arch).items():
        n = math.prod(shape) * itemsize
        if ".moe.experts." in name:
            layer = int(name.split(".")[1])
            E, k = arch.moe_experts[layer], arch.moe_top_k
            experts += n * (1 - (1 - k / E) ** batch)                       # E (1 - (1 - k/E)^B) of E experts
        elif name == "embed.positions" or (name == "embed.tokens" and not arch.tied_embeddings):
            continue                                                        # a row per token
        else:
            dense += n
    kv = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * context * KV_ITEMSIZE * batch
    return {"dense": dense, "experts": experts, "kv": kv, "total": dense + experts + kv}


def decode_case(model, arch, batch: int, s: MoeScale, ops, links: dict) -> dict:
    figures = generate(model, prompts_for(arch, batch, s.prompt), s.gen, None, sync_of(ops))
    read = step_bytes(arch, batch, s.prompt + s.gen / 2)
    roofline = read["total"] / links["device_copy"]
    figures.update(batch=batch, step_bytes=read, roofline_s=roofline,
                   fraction_of_roofline=roofline / figures["decode_median_s"])
    return figures


def moe(ops, results, scale: str) -> None:
    s = SCALES[scale]
    links = measure(ops.xp, s.copy_bytes)
    results.set(links=links, batches=list(s.batches))
    steps: dict = {}
    for name, arch, one_hot_too in models(scale):
        for one_hot in (False, True) if one_hot_too else (False,):
            gating = "one-hot" if one_hot else "table"
            if results.left() < s.need_s:
                results.skip(f"{name}-{gating}", f"{results.left():.0f} s left")
                continue
            model = build(ops, arch, "float16", one_hot=one_hot)
            try:
                for batch in s.batches:
                    steps[name, gating, batch] = guarded(
                        results, f"{name}-{gating}-batch-{batch}", s.need_s / 4,
                        lambda b=batch: decode_case(model, arch, b, s, ops, links))
            finally:
                release(model, ops)
    compare(results, steps, s.batches)


def compare(results, steps: dict, batches) -> None:
    """The ratios: one-hot over table gating per MoE model and batch, and each MoE model over the dense one."""
    ok = lambda r: r is not None and "error" not in r                                  # noqa: E731
    for (name, gating, batch), table in list(steps.items()):
        if gating != "table" or not ok(table):
            continue
        one_hot, dense = steps.get((name, "one-hot", batch)), steps.get(("dense-of-mixtral-active", "table", batch))
        ratios = {"batch": batch}
        if ok(one_hot):
            ratios["onehot_over_table"] = one_hot["decode_median_s"] / table["decode_median_s"]
        if ok(dense) and name != "dense-of-mixtral-active":
            ratios["moe_over_dense"] = table["decode_median_s"] / dense["decode_median_s"]
        if len(ratios) > 1:
            results.add(f"{name}-ratios-batch-{batch}", ratios)
