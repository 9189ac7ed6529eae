"""A candidate layout for N ranks, its validity (the runtime's own checks, not a copy of them) and its TOML.

Valid means what `hpcinfer run` would accept on world = N ranks with ranks_per_node = min(gpus per node, N):
MeshShape.for_world / check_nodes (tp inside a node), check_tensor_parallel, partition_layers (pp <= layers),
check_experts (dp * tp = ep * expert_tp, ep divides the experts, expert_tp the expert width), micro-batch counts
within the per-replica batch, and an all-to-all variant whose message schedule exists for the stage's node shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

from ..comm.all_to_all import message_stats
from ..comm.mesh import Mesh, MeshShape
from ..errors import ConfigError
from ..parallel.layout import check_experts, check_tensor_parallel
from ..parallel.stages import partition_layers

ALL_TO_ALL = ("flat", "hierarchical", "pcc", "pcc+hierarchical")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    expert_tp: int = 1
    prompt_micro_batches: int = 1
    gen_micro_batches: int = 1
    all_to_all: str = "flat"     # MoE models only
    ranks_per_node: int = 1      # ranks of one node taking part (min(gpus per node, world))

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (dp * tp): the expert-parallel world."""
        return self.dp * self.tp

    @property
    def stage_ranks_per_node(self) -> int:
        """How many ranks of a stage share a node when they spread regularly over nodes, else 1 (Mesh's rule)."""
        return Mesh.node_size_in(SimpleNamespace(ranks_per_node=self.ranks_per_node),
                                 list(range(self.stage_ranks)))

    def label(self, moe: bool) -> str:
        text = f"tp{self.tp} pp{self.pp} dp{self.dp}"
        if moe:
            text += f" ep{self.ep} etp{self.expert_tp} {self.all_to_all}"
        return text + f" mb{self.prompt_micro_batches}/{self.gen_micro_batches}"

    def batch_size(self, moe: bool, batch: int) -> int:
        """The `[generate] batch_size` that puts `batch` sequences in flight on this layout, as hpcinfer/job.py
        (generate_share) reads it: a dense model's dp replicas each take their own batches of batch_size, so
        ceil(batch / dp); an MoE model's replicas exchange tokens in every MoE layer and step together through
        ONE batch of batch_size, each taking its slice (np.array_split), so the whole batch."""
        return batch if moe and self.dp > 1 else -(-batch // self.dp)

    def to_toml(self, moe: bool, batch: int) -> str:
        """The [parallel] / [schedule] / [moe] sections, and (commented: a [generate] section needs prompts and an
        output) the batch_size that runs `batch` sequences over the whole job on this layout."""
        lines = ["[parallel]", f"tp = {self.tp}", f"pp = {self.pp}"]
        if moe:
            lines += [f"ep = {self.ep}", f"expert_tp = {self.expert_tp}"]
        lines += ["", "[schedule]", f"prompt_micro_batches = {self.prompt_micro_batches}",
                  f"gen_micro_batches = {self.gen_micro_batches}"]
        if moe:
            lines += ["", "[moe]", f'all_to_all = "{self.all_to_all}"']
        size = self.batch_size(moe, batch)
        if moe and self.dp > 1:
            why = (f"the whole batch: the dp = {self.dp} MoE replicas split each batch in lockstep, "
                   f"{-(-batch // self.dp)} sequences each")
        else:
            why = f"per data-parallel replica; dp = {self.dp}"
        lines += ["", f"# [generate] batch_size = {size}   ({why})"]
        return "\n".join(lines) + "\n"


def layout_problem(arch, layout: Layout, batch_per_replica: int) -> str | None:
    """Why `hpcinfer run` would refuse this layout on layout.world ranks, or None when it is valid."""
    where = "plan"
    try:
        shape = MeshShape.for_world(layout.world, layout.tp, layout.pp)
        shape.check_nodes(layout.ranks_per_node)
        check_tensor_parallel(arch, layout.tp, where)
        stages_of(arch, layout.pp)
        check_experts(arch, layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.world, where)
    except ConfigError as exc:
        return str(exc)
    for key in ("prompt_micro_batches", "gen_micro_batches"):
        if not 1 <= getattr(layout, key) <= batch_per_replica:
            return f"{key} = {getattr(layout, key)} is not in [1, batch_size = {batch_per_replica}]"
    if arch.moe_experts:
        if layout.all_to_all not in ALL_TO_ALL:
            return f"all_to_all = {layout.all_to_all!r} is not one of {ALL_TO_ALL}"
        tp = layout.tp if layout.all_to_all.startswith("pcc") else 1
        try:
            message_stats(layout.all_to_all, layout.stage_ranks, layout.stage_ranks_per_node, tp, 1, 1)
        except ValueError as exc:
            return str(exc)
    return None


@functools.lru_cache(maxsize=256)
def stages_of(arch, pp: int) -> tuple:
    """The runtime's stage split (parallel/stages.partition_layers), cached: the search asks for it often."""
    return tuple(partition_layers(arch, pp))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
