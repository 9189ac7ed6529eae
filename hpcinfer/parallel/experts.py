"""The experts of one MoE layer that this rank holds: expert parallelism splits the experts, expert-slicing splits
each expert's FFN width. Stored layouts (arch.tensor_shapes): up/gate [E, F, D] = [expert, out, in], down
[E, F, D] = [expert, in, out], so this rank's experts and its F slice are one hyperslab of each.

Shape legend: E experts of the layer, El local experts, F expert width, Fs = F / expert_tp, D hidden, M rows.
"""

from __future__ import annotations

import numpy as np

from .layers import even_shard, weight_dtype


class ExpertStack:
    def __init__(self, ops, arch, prefix: str, num_experts: int, layout, stage_rank: int, dtype: str):
        self.ops, self.arch, self.prefix = ops, arch, prefix
        self.activation, self.gated, self.dtype = arch.activation, arch.gated_mlp, weight_dtype(dtype)
        self.ep_index, self.slice_index = divmod(stage_rank, layout.expert_tp)
        self.experts = even_shard(num_experts, layout.ep, self.ep_index)              # local expert range
        self.width = even_shard(arch.expert_size, layout.expert_tp, self.slice_index)  # local F slice
        self.up = self.down = self.up_bias = self.down_bias = None

    @property
    def first_expert(self) -> int:
        return self.experts.start

    def load(self, ckpt):
        e, f = self.experts, self.width
        parts = ("gate", "up") if self.gated else ("up",)
        up = np.concatenate([ckpt.read_slab(f"{self.prefix}.{p}.weight", (e, f)) for p in parts], axis=1)
        self.up = [self.ops.asarray(w.astype(self.dtype, copy=False)) for w in up]     # El x [2Fs | Fs, D]
        down = ckpt.read_slab(f"{self.prefix}.down.weight", (e, f))                     # [El, Fs, D]
        self.down = [self.ops.asarray(w.T.astype(self.dtype, copy=False)) for w in down]   # El x [D, Fs]
        if self.arch.mlp_bias:
            bias = np.concatenate([ckpt.read_slab(f"{self.prefix}.{p}.bias", (e, f)) for p in parts], axis=1)
            self.up_bias = [self.ops.asarray(b.astype(np.float32, copy=False)) for b in bias]
            if self.slice_index == 0:                   # the down bias is added once, by the first slice
                down_bias = ckpt.read_slab(f"{self.prefix}.down.bias", (e,))
                self.down_bias = [self.ops.asarray(b.astype(np.float32, copy=False)) for b in down_bias]

    def __call__(self, rows, local_expert, counts=None):
        """rows [M, D] and each row's local expert index [M] -> this rank's output rows [M, D] (a partial sum over
        F slices when expert_tp > 1). counts: host [El] rows per local expert when the rows are already grouped by
        expert (the routing's order): no sort. Otherwise the rows are sorted by expert in `ops.xp` and the
        [El + 1] segment bounds copied to the host (the one copy; the indices stay where the rows are)."""
        out = self.ops.zeros((rows.shape[0], rows.shape[1]), np.float32)
        if counts is not None:
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for e in range(len(self.up)):
                if bounds[e + 1] > bounds[e]:
                    out[bounds[e]:bounds[e + 1]] = self._ffn(e, rows[bounds[e]:bounds[e + 1]])
            return out
        xp = self.ops.xp
        local_expert = xp.asarray(local_expert)
        order = xp.argsort(local_expert, kind="stable")                                 # [M]
        bounds = self.ops.to_host(xp.searchsorted(local_expert[order], xp.arange(len(self.up) + 1)))   # [El + 1]
        for e in range(len(self.up)):
            if bounds[e + 1] > bounds[e]:
                idx = order[bounds[e]:bounds[e + 1]]
                out[idx] = self._ffn(e, rows[idx])
        return out

    def _ffn(self, e: int, x):                          # x [m, D] -> [m, D]
        bias = self.up_bias[e] if self.up_bias is not None else None
        h = self.ops.expert_linear(x, self.up[e], bias)                                 # [m, 2Fs | Fs]
        h = self.ops.gated_activation(h, self.activation) if self.gated else self.ops.activation(h, self.activation)
        return self.ops.expert_linear(h, self.down[e], self.down_bias[e] if self.down_bias is not None else None)
