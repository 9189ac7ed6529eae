"""Generation of one batch: a packed prefill of all prompts, then batched decode steps until every sequence stops.

Shape legend: S=sequences still running, T=tokens of a step, V=vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..backend.ops import StepLayout
from ..comm.mappings import broadcast_from_tp_root
from .kv_cache import KVCache
from .sampling import SamplingParams, sample, sequence_rng


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class Sequence:
    index: int                   # position of the prompt in the input (seeds its generator)
    prompt: list
    capacity: int                # prompt + tokens it may generate (bounded by the model's positions)
    rng: np.random.Generator
    slot: int
    generated: list = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


@dataclass
class StepTimes:
    prefill_s: float = 0.0
    decode_s: list = field(default_factory=list)   # one entry per decode step
    prompt_tokens: int = 0
    generated_tokens: int = 0


def generate_batch(model, prompts: list, indices: list, params: GenerationParams, times: StepTimes) -> list:
    """Run prompts (lists of token ids) to completion. Returns [(generated ids, finish_reason)] in prompt order."""
    arch = model.arch
    seqs = [Sequence(i, list(p), min(len(p) + params.max_new_tokens, arch.max_positions),
                     sequence_rng(params.seed, i), slot) for slot, (i, p) in enumerate(zip(indices, prompts))]
    cache = KVCache(model.ops, arch.num_layers, len(seqs), model.kv_heads_local, max(s.capacity for s in seqs),
                    arch.head_dim)
    eos = set() if params.ignore_eos else set(arch.eos_token_ids)

    t0 = time.perf_counter()
    step = StepLayout.build([s.slot for s in seqs], [0] * len(seqs), [len(s.prompt) for s in seqs])
    _advance(model, cache, seqs, np.concatenate([s.prompt for s in seqs]), step, params, eos)
    times.prefill_s += time.perf_counter() - t0
    times.prompt_tokens += step.num_tokens

    while running := [s for s in seqs if s.finish_reason is None]:
        t0 = time.perf_counter()
        step = StepLayout.build([s.slot for s in running], [s.length - 1 for s in running], [1] * len(running))
        _advance(model, cache, running, np.array([s.generated[-1] for s in running]), step, params, eos)
        times.decode_s.append(time.perf_counter() - t0)
    times.generated_tokens += sum(len(s.generated) for s in seqs)
    return [(s.generated, s.finish_reason) for s in seqs]


def _advance(model, cache, seqs, tokens, step, params: GenerationParams, eos: set) -> None:
    """One forward step, then sample one token per sequence (identical on every tp rank) and check stops."""
    logits = model.ops.to_host(model.forward(np.asarray(tokens, dtype=np.int64), step, cache))
    chosen = sample(logits, params.sampling, [s.rng for s in seqs])                  # [S]
    chosen = broadcast_from_tp_root(chosen, model.tp)
    for seq, token in zip(seqs, chosen.tolist()):
        seq.generated.append(token)
        if token in eos:
            seq.finish_reason = "stop"
        elif len(seq.generated) >= params.max_new_tokens or seq.length >= seq.capacity:
            seq.finish_reason = "length"

