"""A mixture-of-experts MLP: a router picks top-k experts per token; the Dispatcher moves the tokens to the ranks
holding those experts and back; PR-MoE adds a dense residual MLP mixed in by a learned 2-way coefficient
(DeepSpeed's `use_residual`). Gating and dispatch by index tables (backend/moe_ops.py), or by the one-hot einsums
of GShard / DeepSpeed when `[moe] dispatch = "one-hot"` (groups.moe.dispatch; backend/moe_onehot.py, the bench's
naive baseline). Shape legend: T tokens, D hidden, E experts, K top-k."""

from __future__ import annotations

from ..backend.moe_onehot import onehot_moe
from ..backend.moe_ops import capacity_for
from ..parallel.experts import ExpertStack
from ..parallel.layers import Replicated
from ..parallel.moe_dispatch import Dispatcher
from .mlp import MLP


class MoE:
    def __init__(self, ops, groups, arch, layer: int, dtype: str, capacity_factor: float | None = None):
        prefix = f"layers.{layer}"
        self.ops, self.arch = ops, arch
        self.num_experts = arch.experts_in(layer)
        self.capacity_factor = arch.moe_capacity_factor if capacity_factor is None else capacity_factor
        self.router = Replicated(ops, f"{prefix}.moe.router.weight")                    # [E, D]
        self.experts = ExpertStack(ops, arch, f"{prefix}.moe.experts", self.num_experts, groups.moe,
                                   groups.stage.rank, dtype)
        self.dispatch = Dispatcher(ops, groups, self.num_experts)
        self.one_hot = getattr(groups.moe, "dispatch", "indexed") == "one-hot"
        self.residual = MLP(ops, groups.tp, arch, f"{prefix}.mlp", dtype) if arch.moe_residual else None
        self.coef_w = Replicated(ops, f"{prefix}.moe.coef.weight") if arch.moe_residual else None
        self.coef_b = Replicated(ops, f"{prefix}.moe.coef.bias") if arch.moe_residual else None

    def load(self, ckpt):
        for part in (self.router, self.experts, self.residual, self.coef_w, self.coef_b):
            if part is not None:
                part.load(ckpt)

    def __call__(self, x):                                       # x [T, D] -> [T, D]
        logits = self.ops.linear(x, self.router.value)           # [T, E]
        capacity = (capacity_for(x.shape[0], self.num_experts, self.capacity_factor, self.arch.moe_min_capacity)
                    if self.capacity_factor > 0 else None)
        y = self._experts_output(logits, x, capacity)            # [T, D]
        if self.residual is None:
            return y
        coef = self.ops.softmax(self.ops.linear(x, self.coef_w.value, self.coef_b.value))       # [T, 2]
        return y * coef[:, 0:1] + self.residual(x) * coef[:, 1:2]

    def _experts_output(self, logits, x, capacity):             # logits [T, E], x [T, D] -> [T, D]
        k, normalize = self.arch.moe_top_k, self.arch.moe_normalize
        if self.one_hot:                                         # [T, E, C] masks and einsums (the baseline)
            return onehot_moe(self.ops, self.dispatch, self.experts, logits, x, k, normalize, capacity)
        routing, rows = self.ops.gate_dispatch(logits, x, k, normalize, self.num_experts, capacity)  # rows [R, D]
        return self.dispatch(x, routing, self.experts, rows)
