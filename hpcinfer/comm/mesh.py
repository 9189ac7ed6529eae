"""The device mesh: world -> (pp, dp, tp), tp fastest-varying so that tensor parallelism stays inside a node.

world rank = (pp_index * dp + dp_index) * tp + tp_index. One communicator per axis, from MPI.Comm.Split.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .group import MPIGroup


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

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.shape.coords(self.world.rank)

    def describe(self) -> str:
        pp_i, dp_i, tp_i = self.coords
        return f"rank {self.world.rank}: stage {pp_i}, dp replica {dp_i}, tp rank {tp_i}"


def build_mesh(comm, tp: int, pp: int) -> Mesh:
    """Split `comm` (the world) into the tp, dp and pp groups of this rank."""
    shape = MeshShape.for_world(comm.Get_size(), tp, pp)
    pp_i, dp_i, tp_i = shape.coords(comm.Get_rank())
    tp_comm = comm.Split(color=pp_i * shape.dp + dp_i, key=tp_i)
    dp_comm = comm.Split(color=pp_i * shape.tp + tp_i, key=dp_i)
    pp_comm = comm.Split(color=dp_i * shape.tp + tp_i, key=pp_i)
    return Mesh(shape, MPIGroup(comm, "world"), MPIGroup(tp_comm, "tp"), MPIGroup(dp_comm, "dp"),
                MPIGroup(pp_comm, "pp"))
