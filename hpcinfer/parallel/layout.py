"""Which layouts a model admits: checked against the checkpoint before any weight is read."""

from __future__ import annotations

from ..errors import ConfigError


def check_tensor_parallel(arch, tp: int, config_path: str) -> None:
    """tp must divide the query heads, the KV heads and the MLP width (the vocabulary need not divide)."""
    for what, n in (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
                    ("MLP intermediate size", arch.intermediate_size)):
        if n % tp:
            options = [d for d in range(1, n + 1) if arch.num_heads % d == 0 and arch.num_kv_heads % d == 0
                       and arch.intermediate_size % d == 0]
            raise ConfigError(f"{config_path}: [parallel] tp = {tp} does not divide the model's {n} {what}; "
                              f"tp must be one of {options}")


def check_experts(arch, tp: int, pp: int, ep: int, expert_tp: int, world_size: int, config_path: str) -> None:
    """The MoE mesh rule dp * tp = ep * expert_tp inside each pipeline stage; ep divides every MoE layer's experts
    and expert_tp the expert width. A dense model takes ep = expert_tp = 1."""
    if not arch.moe_experts:
        if ep > 1 or expert_tp > 1:
            raise ConfigError(f"{config_path}: [parallel] ep = {ep}, expert_tp = {expert_tp}: the model has no "
                              f"experts; use ep = 1 and expert_tp = 1")
        return
    stage_ranks = world_size // (tp * pp) * tp
    if stage_ranks != ep * expert_tp:
        raise ConfigError(f"{config_path}: each pipeline stage has dp * tp = {stage_ranks} ranks (world "
                          f"{world_size} / pp {pp}), but [parallel] ep * expert_tp = {ep} * {expert_tp} = "
                          f"{ep * expert_tp}; they must be equal (e.g. ep = {stage_ranks // expert_tp})")
    for layer, experts in enumerate(arch.moe_experts):
        if experts and experts % ep:
            raise ConfigError(f"{config_path}: [parallel] ep = {ep} does not divide the {experts} experts of layer "
                              f"{layer}")
    if arch.expert_size % expert_tp:
        raise ConfigError(f"{config_path}: [parallel] expert_tp = {expert_tp} does not divide the expert width "
                          f"{arch.expert_size}")
