"""Rotary position embedding tables (the half-split "rotate_half" convention of GPT-NeoX and Llama)."""

from __future__ import annotations

import numpy as np


class RotaryTable:
    """cos/sin of position * inverse frequency, for positions 0..max_positions-1, held by the backend; rows are
    gathered where the table lives, so device positions (a captured decode step) upload nothing."""

    def __init__(self, ops, rotary_dim: int, theta: float, max_positions: int):
        inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))  # [rd/2]
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)                   # [P, rd/2]
        self.ops, self.rotary_dim = ops, rotary_dim
        self.cos = ops.asarray(np.cos(angles).astype(np.float32))
        self.sin = ops.asarray(np.sin(angles).astype(np.float32))

    def __call__(self, positions):                          # positions [T] (host or backend ints) -> 2 x [T, rd/2]
        return self.cos[positions], self.sin[positions]
