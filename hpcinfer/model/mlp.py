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

    def __call__(self, x, norm=None, residual=None):         # x [T, D] -> [T, D]: mlp(norm(x)) (+ residual)
        h = self.up(x, norm, act=self.activation, gated=self.gated)   # [T, Fl]: act(up), or act(gate) * up
        return self.down(h, residual)
