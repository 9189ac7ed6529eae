"""Bytes on one rank: its weight shard, its KV cache, its activations and workspace (the fullest stage's rank).

  weights  = isz (sum over the stage's layers of dense params / tp + experts * expert params / (ep expert_tp)
             + norms) + isz V D / tp on the first stage (embedding; learned positions replicated) and the last
             (LM head: its own or, with pp > 1, the tied table's copy)
  kv       = isz 2 Hkv hd / tp * layers * b (P + G)               every sequence of the replica, full length
  quantized: weights held quantized (`--quantize`) count their q, scale and min bytes (step.quantized_delta), a
             quantized KV cache (`--kv-cache`) its packed rows (step.Workload.kv_token_bytes); the runtime's
             dequantize scratch (one matrix at a time) is not counted
  work     = the largest transient of the prompt step, per micro-batch of mp sequences (t = mp P tokens):
             isz t (4 D + 3 q / tp + 2 F / tp) + 4 mp (H / tp) P^2 (float32 scores) + 4 mp V / tp (logits)
"""

from __future__ import annotations

import math

from .layout import Layout, stages_of
from .step import Workload, dense_layer_params, layer_matrices, quantized_delta


def weight_bytes(arch, layout: Layout, layers: range, first: bool, last: bool, work: Workload) -> float:
    D, params, isz = arch.hidden_size, 0.0, work.itemsize
    quantized = [name for layer in layers for name in layer_matrices(arch, layer)]
    mats = 3 if arch.gated_mlp else 2
    for layer in layers:
        params += dense_layer_params(arch, layer) / layout.tp + 4 * D          # + norm weights and biases
        experts = arch.experts_in(layer)
        if experts:
            params += experts / layout.ep * (D * arch.expert_size * mats / layout.expert_tp + D)
    table = arch.vocab_size * D / layout.tp
    if first:
        params += table + (arch.max_positions * D if arch.position == "learned" else 0)
        quantized.append("embed.tokens")
    if last:
        params += 2 * D + (0 if first and arch.tied_embeddings else table)    # one stage: the tied table serves both
        if not (first and arch.tied_embeddings):
            quantized.append("embed.tokens" if arch.tied_embeddings else "lm_head.weight")
    return isz * params + quantized_delta(arch, tuple(quantized), layout.tp, work)


def kv_bytes(arch, layout: Layout, layers: int, work: Workload) -> float:
    b = work.per_replica(layout.dp)
    return work.kv_token_bytes(arch, layout.tp) * layers * b * (work.prompt_len + work.gen_len)


def work_bytes(arch, layout: Layout, work: Workload) -> float:
    mp = math.ceil(work.per_replica(layout.dp) / layout.prompt_micro_batches)
    t, tp = mp * work.prompt_len, layout.tp
    width = 4 * arch.hidden_size + 3 * arch.q_size / tp + 2 * max(arch.intermediate_size, arch.expert_size) / tp
    scores = 4.0 * mp * arch.num_heads / tp * work.prompt_len ** 2
    return work.itemsize * t * width + scores + 4.0 * mp * arch.vocab_size / tp


def rank_memory(arch, layout: Layout, work: Workload) -> int:
    """Peak bytes on the fullest rank."""
    fullest = 0.0
    for s in stages_of(arch, layout.pp):
        total = weight_bytes(arch, layout, s.layers, s.is_first, s.is_last, work) \
            + kv_bytes(arch, layout, len(s.layers), work)
        fullest = max(fullest, total)
    return int(fullest + work_bytes(arch, layout, work))
