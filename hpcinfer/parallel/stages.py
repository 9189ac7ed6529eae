"""Pipeline stages: contiguous runs of decoder layers, balanced by parameter count.

The token embedding (and a learned position table) lives on the first stage; the final norm and the LM head on the
last one (with tied embeddings the last stage holds its own copy of the table as its LM head).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class StageSpec:
    index: int
    count: int                   # P, the number of stages
    first_layer: int             # layers [first_layer, last_layer) run here
    last_layer: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer)


def layer_params(arch, layer: int = 0) -> int:
    """Parameters of one decoder layer's matrices (attention, and the MLP and/or the experts of an MoE layer)."""
    D = arch.hidden_size
    attn = D * (arch.q_size + 2 * arch.kv_size) + arch.q_size * D
    mats = 3 if arch.gated_mlp else 2
    experts = arch.experts_in(layer)
    mlp = D * arch.intermediate_size * mats if not experts or arch.moe_residual else 0
    moe = experts * (D * arch.expert_size * mats + D) if experts else 0
    return attn + mlp + moe


def stage_params(arch) -> tuple[int, int]:
    """(extra parameters of the first stage, of the last stage)."""
    table = arch.vocab_size * arch.hidden_size
    positions = arch.max_positions * arch.hidden_size if arch.position == "learned" else 0
    return table + positions, table                 # the last stage's LM head: tied copy or its own


def partition_layers(arch, pp: int, config_path: str = "config") -> list[StageSpec]:
    """Split the layers into pp contiguous non-empty stages minimizing the largest stage's parameter count."""
    L = arch.num_layers
    if pp > L:
        raise ConfigError(f"{config_path}: [parallel] pp = {pp} is larger than the model's {L} layers")
    first_extra, last_extra = stage_params(arch)
    prefix = [0]
    for i in range(L):
        prefix.append(prefix[-1] + layer_params(arch, i))

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0) + (last_extra if stage == pp - 1 else 0)

    # best[s][b]: smallest max-cost of placing layers [0, b) on stages 0..s; cut[s][b]: where stage s starts
    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(pp)]
    cut = [[0] * (L + 1) for _ in range(pp)]
    for b in range(1, L + 1):
        best[0][b] = cost(0, 0, b)
    for s in range(1, pp):
        for b in range(s + 1, L + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], cost(s, a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds, b = [L], L
    for s in range(pp - 1, 0, -1):
        b = cut[s][b]
        bounds.append(b)
    bounds.append(0)
    bounds.reverse()
    return [StageSpec(s, pp, bounds[s], bounds[s + 1]) for s in range(pp)]
