"""Token sampling on the host: greedy, temperature, top-k, top-p. Each sequence owns a generator seeded by
(seed, prompt index), so a prompt draws the same tokens whatever its batch, data-parallel replica or rank count."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0: greedy
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sequence_rng(seed: int, prompt_index: int) -> np.random.Generator:
    return np.random.default_rng([seed, prompt_index])


def sample(logits: np.ndarray, params: SamplingParams, rngs: list) -> np.ndarray:
    """logits [S, V] float32, one generator per row -> token ids [S] int64."""
    if params.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)
    return np.array([_sample_row(row, params, rng) for row, rng in zip(logits, rngs)], dtype=np.int64)


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[V] logits -> [V] probabilities after temperature, top-k and top-p (zeros where filtered out)."""
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]          # mass of the tokens ranked above each one
        probs[order[before >= params.top_p]] = 0.0               # keep the smallest prefix reaching top_p
        probs /= probs.sum()
    return probs


def _sample_row(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    cdf = np.cumsum(filtered_probs(logits, params))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))
