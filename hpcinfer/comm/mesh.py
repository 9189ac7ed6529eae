"""The device mesh: world -> (pp, dp, tp), tp fastest-varying so that tensor parallelism stays inside a node.

world rank = (pp_index * dp + dp_index) * tp + tp_index. One communicator per axis, from MPI.Comm.Split.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .group import MPIGroup
from .watchdog import Arrivals


@dataclass(frozen=True)
class MeshShape:
    pp: int
    dp: int
    tp: int

    @classmethod
    def for_world(cls, world_size: int, tp: int, pp: int) -> "MeshShape":
        if world_size % (tp * pp):
            raise ConfigError(f"world size {world_size} is not divisible by [parallel] tp * pp = {tp} * {pp}; "
                              f"launch a multiple of {tp * pp} ranks")
        return cls(pp=pp, dp=world_size // (tp * pp), tp=tp)

    def check_nodes(self, ranks_per_node: int, key: str = "[parallel] ranks_per_node") -> None:
        """Every node holds whole tensor-parallel groups, and the nodes divide the world."""
        world = self.pp * self.dp * self.tp
        if world % ranks_per_node:
            raise ConfigError(f"{key} = {ranks_per_node} does not divide the world size {world}")
        if ranks_per_node % self.tp:
            raise ConfigError(f"{key} = {ranks_per_node} would split a tensor-parallel group of tp = {self.tp} "
                              f"across nodes; use a multiple of {self.tp}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """world rank -> (pp_index, dp_index, tp_index)."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp


@dataclass
class Mesh:
    shape: MeshShape
    world: MPIGroup
    tp: MPIGroup
    dp: MPIGroup
    pp: MPIGroup
    ranks_per_node: int
    stage: MPIGroup = None       # every rank of this pipeline stage (dp * tp of them): the expert-parallel world

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.shape.coords(self.world.rank)

    @property
    def node(self) -> int:
        return self.world.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """Rank within its node (ranks are placed on nodes in blocks of ranks_per_node)."""
        return self.world.rank % self.ranks_per_node

    def node_size_in(self, members: list[int]) -> int:
        """How many of `members` (world ranks, ascending) share a node, when every node holds the same number of
        them as consecutive group ranks (what a hierarchical exchange over them needs); else 1 (no hierarchy)."""
        nodes = [m // self.ranks_per_node for m in members]
        per_node = nodes.count(nodes[0])
        blocks = [nodes[i:i + per_node] for i in range(0, len(nodes), per_node)]
        regular = all(len(set(b)) == 1 and len(b) == per_node for b in blocks)
        return per_node if regular else 1

    def stage_members(self) -> list[int]:
        pp_i = self.coords[0]
        n = self.shape.dp * self.shape.tp
        return list(range(pp_i * n, (pp_i + 1) * n))

    def dp_members(self) -> list[int]:
        pp_i, _, tp_i = self.coords
        n = self.shape.dp * self.shape.tp
        return [pp_i * n + d * self.shape.tp + tp_i for d in range(self.shape.dp)]

    def describe(self) -> str:
        pp_i, dp_i, tp_i = self.coords
        return f"rank {self.world.rank} (node {self.node}): stage {pp_i}, dp replica {dp_i}, tp rank {tp_i}"


def shared_memory_ranks(comm) -> int:
    """Ranks on this rank's node, from MPI's shared-memory split (the same on every node of a regular job)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    size = node.Get_size()
    node.Free()
    return size


def build_mesh(comm, tp: int, pp: int, ranks_per_node: int, comm_timeout: float = 600.0) -> Mesh:
    """Split `comm` (the world) into the tp, dp and pp groups of this rank. comm_timeout: each group's watchdog
    deadline in seconds (comm/watchdog.py); the groups share one record of arrivals."""
    shape = MeshShape.for_world(comm.Get_size(), tp, pp)
    shape.check_nodes(ranks_per_node)
    pp_i, dp_i, tp_i = shape.coords(comm.Get_rank())
    arrivals = Arrivals(world=comm)                       # a timeout aborts the whole job

    def group(sub, name):
        world_ranks = sub.Get_group().Translate_ranks(list(range(sub.Get_size())), comm.Get_group())
        return MPIGroup(sub, name, comm_timeout, world_ranks, arrivals)

    tp_comm = comm.Split(color=pp_i * shape.dp + dp_i, key=tp_i)
    dp_comm = comm.Split(color=pp_i * shape.tp + tp_i, key=dp_i)
    pp_comm = comm.Split(color=dp_i * shape.tp + tp_i, key=pp_i)
    stage_comm = comm.Split(color=pp_i, key=dp_i * shape.tp + tp_i)
    return Mesh(shape, group(comm, "world"), group(tp_comm, "tp"), group(dp_comm, "dp"), group(pp_comm, "pp"),
                ranks_per_node, group(stage_comm, "stage"))
