"""The metrics of one run: config echo, mesh, timings, tokens/s, achieved bandwidth and FLOP rate."""

from __future__ import annotations

import dataclasses

import numpy as np


def matmul_params(arch) -> int:
    """Parameters that take part in a matmul per token (not the position table, nor the embedding lookup when
    the LM head is separate); 2 FLOPs each per token."""
    total = arch.param_count()
    if arch.position == "learned":
        total -= arch.max_positions * arch.hidden_size
    if not arch.tied_embeddings:
        total -= arch.vocab_size * arch.hidden_size
    return total


def summarize(config, model, mesh, replica_times: list, generate_s: float, load_s: float, total_s: float,
              threads: int) -> dict:
    arch = model.arch
    decode = np.concatenate([np.asarray(t.decode_s) for t in replica_times]) if replica_times else np.zeros(0)
    prompt_tokens = sum(t.prompt_tokens for t in replica_times)
    generated = sum(t.generated_tokens for t in replica_times)
    prefill_s = max((t.prefill_s for t in replica_times), default=0.0)
    itemsize = np.dtype(np.float32).itemsize if config.model.dtype == "float32" else 2
    weight_bytes_per_rank = matmul_params(arch) * itemsize / mesh.shape.tp
    median_step = float(np.median(decode)) if decode.size else float("nan")
    flops_per_token = 2 * matmul_params(arch)
    return {
        "config": dataclasses.asdict(config),
        "mesh": {"world": mesh.world.size, "pp": mesh.shape.pp, "dp": mesh.shape.dp, "tp": mesh.shape.tp,
                 "threads_per_rank": threads},
        "model": {"family": arch.family, "parameters": arch.param_count(), "layers": arch.num_layers,
                  "hidden": arch.hidden_size, "vocab": arch.vocab_size},
        "load_s": load_s,
        "generate_s": generate_s,
        "total_s": total_s,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "tokens_per_s": generated / generate_s if generate_s > 0 else 0.0,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_steps": int(decode.size),
        "decode_step_ms": {"median": median_step * 1e3,
                           "p90": float(np.percentile(decode, 90)) * 1e3 if decode.size else float("nan")},
        "decode_weight_bandwidth_GBps_per_rank": weight_bytes_per_rank / median_step / 1e9 if decode.size else 0.0,
        "flop_rate_GFLOPs_per_rank": (flops_per_token * (prompt_tokens + generated) / mesh.world.size
                                      / generate_s / 1e9) if generate_s > 0 else 0.0,
    }
