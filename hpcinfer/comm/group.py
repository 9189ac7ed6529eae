"""CommGroup: the collectives one parallel axis needs, over arrays of the active backend.

`MPIGroup` wraps an mpi4py communicator and moves host (NumPy) arrays. The NCCL implementation (device arrays)
arrives with the CUDA backend and keeps these names and semantics.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .watchdog import Watchdog


class CommGroup(Protocol):
    size: int
    rank: int

    def all_reduce(self, x): ...          # sum over the group, result on every rank (x may be updated in place)
    def all_gather(self, x): ...          # x [*s] -> [size, *s], rank order
    def broadcast(self, x, root: int = 0): ...
    def barrier(self) -> None: ...


class MPIGroup:
    """A CommGroup over an mpi4py communicator (host memory). Every operation runs under the group's Watchdog
    (the blocking MPI call, watched by a monitor thread; or its non-blocking form, polled, where MPI has no
    THREAD_MULTIPLE), so a peer that never arrives ends the job after `timeout` seconds with a diagnostic
    (comm/watchdog.py) instead of hanging it. world_ranks: the members' ranks in the world (for
    messages); arrivals: shared by the groups of one process (built by comm/mesh.py)."""

    def __init__(self, comm, name: str = "group", timeout: float = 600.0, world_ranks=None, arrivals=None):
        self.comm, self.name = comm, name
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.watch = Watchdog(comm, name, timeout, world_ranks, arrivals)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        x = np.ascontiguousarray(x)
        self.watch.run("all_reduce", lambda: self.comm.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                       lambda: self.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM))
        return x

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty((self.size, *x.shape), dtype=x.dtype)
        self.watch.run("all_gather", lambda: self.comm.Iallgather(x, out), lambda: self.comm.Allgather(x, out))
        return out

    def broadcast(self, x: np.ndarray, root: int = 0) -> np.ndarray:
        x = np.ascontiguousarray(x)
        self.watch.run("broadcast", lambda: self.comm.Ibcast(x, root=root), lambda: self.comm.Bcast(x, root=root))
        return x

    def all_gather_v(self, x: np.ndarray) -> np.ndarray:
        """x [n_r, ...] (n_r may differ by rank) -> every rank's rows concatenated in rank order."""
        x = np.ascontiguousarray(x)
        counts = self.all_gather(np.array([x.shape[0]], dtype=np.int64))[:, 0]         # [size]
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        out = np.empty((int(counts.sum()), *x.shape[1:]), dtype=x.dtype)
        spec = [out, counts * row, np.concatenate([[0], np.cumsum(counts * row)[:-1]]), _mpi_type(x.dtype)]
        self.watch.run("all_gather_v", lambda: self.comm.Iallgatherv(x, spec), lambda: self.comm.Allgatherv(x, spec))
        return out

    def barrier(self) -> None:
        self.watch.run("barrier", self.comm.Ibarrier, self.comm.Barrier)

    # pickled objects (small, rare: results per batch round, stop flags)
    def gather_object(self, obj, root: int = 0):
        return self._objects("gather (objects)", lambda: self.comm.gather(obj, root=root))

    def bcast_object(self, obj, root: int = 0):
        return self._objects("broadcast (objects)", lambda: self.comm.bcast(obj, root=root))

    def _objects(self, op: str, call):
        """A blocking object collective: watched by the monitor thread, or (polling mode) after a watched barrier
        that proves every rank has arrived, so that it cannot hang."""
        if self.watch.arrivals.threaded:
            self.watch.enter(op)
            return self.watch.blocking(call, op)
        self.watch.run(op, self.comm.Ibarrier, self.comm.Barrier)
        return call()

    # point-to-point (pipeline stages): a small picklable header, then an optional array payload
    def isend_object(self, obj, dest: int, tag: int):
        return self.comm.isend(obj, dest=dest, tag=tag)

    def recv_object(self, source: int, tag: int):
        op = f"receive (tag {tag})"
        if self.watch.arrivals.threaded:
            return self.watch.blocking(lambda: self.comm.recv(source=source, tag=tag), op, peer=source)
        self.watch.until(lambda: self.comm.Iprobe(source=source, tag=tag), op, peer=source)
        return self.comm.recv(source=source, tag=tag)

    def isend_array(self, x: np.ndarray, dest: int, tag: int):
        return self.comm.Isend(np.ascontiguousarray(x), dest=dest, tag=tag)

    def recv_array(self, shape, dtype, source: int, tag: int) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        op = f"receive (tag {tag})"
        if self.watch.arrivals.threaded:
            self.watch.blocking(lambda: self.comm.Recv(out, source=source, tag=tag), op, peer=source)
        else:
            self.watch.wait(self.comm.Irecv(out, source=source, tag=tag), op, peer=source)
        return out

    def wait_send(self, request, dest: int) -> None:
        """Complete a send started by isend_object / isend_array."""
        self.watch.wait(request, "send", peer=dest)

    def __repr__(self):
        return f"MPIGroup({self.name}, rank {self.rank} of {self.size})"


def _mpi_type(dtype):
    from mpi4py import MPI

    return MPI._typedict[np.dtype(dtype).char]


class SoloGroup:
    """A group of one rank: every collective is the identity. Lets single-process code (tests, converters,
    the Python API) run the model without MPI."""

    size, rank, name = 1, 0, "solo"

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x[None]

    def broadcast(self, x, root: int = 0):
        return x

    def all_gather_v(self, x):
        return x

    def barrier(self) -> None:
        pass


class Groups:
    """The groups a model and its schedule need, passed in by the runtime (never found).

    tp: tensor parallelism of the dense part; pp: the pipeline; stage: every rank of this pipeline stage (the
    expert-parallel world, ep * expert_tp = dp * tp ranks); dp: the ranks of this stage with the same tp rank
    (the parallelism-coordinated all-to-all runs among them). `moe` says how experts are laid out.
    """

    def __init__(self, tp=None, pp=None, stage=None, dp=None, moe=None):
        self.tp = tp if tp is not None else SoloGroup()
        self.pp = pp if pp is not None else SoloGroup()
        self.stage = stage if stage is not None else SoloGroup()
        self.dp = dp if dp is not None else SoloGroup()
        self.moe = moe if moe is not None else MoELayout()


class MoELayout:
    """Expert placement over the stage's ranks: stage rank q holds expert-parallel index q // expert_tp and
    expert slice q % expert_tp. all_to_all: flat | hierarchical | pcc | pcc+hierarchical. dispatch: indexed (index
    tables, backend/moe_ops.py) | one-hot (the GShard einsum baseline, backend/moe_onehot.py)."""

    def __init__(self, ep: int = 1, expert_tp: int = 1, all_to_all: str = "flat", stage_ranks_per_node: int = 1,
                 dp_ranks_per_node: int = 1, dispatch: str = "indexed"):
        self.ep, self.expert_tp, self.all_to_all, self.dispatch = ep, expert_tp, all_to_all, dispatch
        self.stage_ranks_per_node = stage_ranks_per_node      # node size in stage-group ranks (hierarchical)
        self.dp_ranks_per_node = dp_ranks_per_node            # node size in dp-group ranks (pcc+hierarchical)
