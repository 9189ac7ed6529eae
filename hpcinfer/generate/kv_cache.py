"""The KV cache of one batch: per layer, keys and values for every slot (sequence) up to its capacity."""

from __future__ import annotations

import numpy as np


class KVCache:
    """k[layer], v[layer]: [N slots, Hkv local, Lmax, hd] float32 arrays of the active backend."""

    def __init__(self, ops, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [ops.zeros(shape, np.float32) for _ in range(num_layers)]
        self.v = [ops.zeros(shape, np.float32) for _ in range(num_layers)]
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.k + self.v)
