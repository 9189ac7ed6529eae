"""From per-token hidden states to one vector per input (host NumPy, float32).

mean: the average over the input's tokens (padding never enters: the batch is packed), as sentence-transformers'
mean pooling; cls: the first token's state; pooler: BERT's tanh(dense(x[CLS])) (the model computes it);
none: every token's state. normalize: divide each vector (each token's, with none) by its L2 norm.
Shape legend: T=tokens of the batch (packed), S=inputs, D=hidden.
"""

from __future__ import annotations

import numpy as np


def pool(hidden: np.ndarray, offsets: np.ndarray, pooling: str, pooled=None) -> list[np.ndarray]:
    """hidden [T, D], offsets [S+1] -> S arrays: [D] each (mean, cls, pooler) or [n_s, D] (none).
    `pooled` [S, D]: the model's pooler output (pooling = "pooler")."""
    starts, stops = offsets[:-1], offsets[1:]
    if pooling == "mean":
        sums = np.add.reduceat(hidden, starts, axis=0)                      # [S, D] (every input has >= 1 token)
        return list(sums / (stops - starts)[:, None].astype(np.float32))
    if pooling == "cls":
        return list(hidden[starts])
    if pooling == "pooler":
        return list(pooled)
    if pooling == "none":
        return [hidden[a:b] for a, b in zip(starts, stops)]
    raise ValueError(f"unknown pooling {pooling!r}")


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x [..., D] / ||x|| over the last axis (a zero vector stays zero)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norm, np.float32(1e-12))).astype(np.float32, copy=False)
