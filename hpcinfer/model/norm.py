"""LayerNorm and RMSNorm, replicated on every rank."""

from __future__ import annotations

from ..backend.interface import NormParams
from ..parallel.layers import Replicated


class Norm:
    def __init__(self, ops, arch, prefix: str):
        self.ops, self.kind, self.eps = ops, arch.norm, arch.norm_eps
        self.weight = Replicated(ops, f"{prefix}.weight")
        self.bias = Replicated(ops, f"{prefix}.bias") if arch.has_norm_bias else None

    def load(self, ckpt):
        self.weight.load(ckpt)
        if self.bias is not None:
            self.bias.load(ckpt)

    @property
    def params(self) -> NormParams:
        """This norm for Ops.fused_linear to apply inside the next matmul."""
        return NormParams(self.kind, self.weight.value, None if self.bias is None else self.bias.value, self.eps)

    def __call__(self, x):                                   # x [T, D] -> [T, D]
        if self.kind == "rmsnorm":
            return self.ops.rms_norm(x, self.weight.value, self.eps)
        return self.ops.layer_norm(x, self.weight.value, self.bias.value, self.eps)
