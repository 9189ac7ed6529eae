"""The MLP: column-parallel up (and gate) projection, activation, row-parallel down projection.
Shape legend: T=tokens, D=hidden, F=intermediate (Fl = F / tp local)."""

from __future__ import annotations

from ..parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP:
    def __init__(self, ops, tp, arch, prefix: str, dtype: str):
        self.ops, self.activation, self.gated = ops, arch.activation, arch.gated_mlp
        F = arch.intermediate_size
        parts = ["gate", "up"] if arch.gated_mlp else ["up"]
        self.up = ColumnParallelLinear(ops, tp, [f"{prefix}.{p}" for p in parts], [F] * len(parts),
                                       arch.mlp_bias, dtype)
        self.down = RowParallelLinear(ops, tp, f"{prefix}.down", F, arch.mlp_bias, dtype)

    def load(self, ckpt):
        self.up.load(ckpt)
        self.down.load(ckpt)

    def __call__(self, x):                                   # x [T, D] -> [T, D]
        h = self.up(x)                                       # [T, Fl] or [T, 2 Fl] (gate half first)
        h = self.ops.gated_activation(h, self.activation) if self.gated else self.ops.activation(h, self.activation)
        return self.down(h)
