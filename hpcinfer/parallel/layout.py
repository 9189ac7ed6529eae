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
