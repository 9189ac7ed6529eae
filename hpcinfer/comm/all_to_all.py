"""All-to-all(v) of variable row counts among the ranks of a CommGroup: the comm steps of the MoE dispatcher.

Interchangeable implementations, identical results (same rows, same order, same dtypes):
- `FlatAllToAll`: one Alltoallv per array over the whole group, P - 1 messages a rank.
- `HierarchicalAllToAll` (DeepSpeed-MoE 5.3, Fig. 8): intra-node, then inter-node, (G - 1) + (M - 1) messages.
Parallelism-coordinated communication (PCC, DeepSpeed Inference V-B) runs one of these over the ranks that share a
tp rank, then all-gathers inside the tp group; the dispatcher composes it, `message_stats` accounts for it.

P=group size  G=ranks per node  M=nodes (P / G)  N=rows sent  R=rows received  *s=trailing shape of a row
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .watchdog import Watchdog

KINDS = ("flat", "hierarchical")


class AllToAll(Protocol):
    def exchange(self, arrays: list[np.ndarray], send_counts: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """arrays: each [N, *s] with the same N, rows ordered by destination group rank (send_counts int64 [P],
        sum N). Returns the received arrays [R, *s], rows in source rank order (within a source, in its send
        order), and recv_counts int64 [P]. Every rank must pass the same number of arrays, each with the same
        trailing shape and dtype as on the other ranks."""
        ...

    def close(self) -> None: ...


def make_all_to_all(kind: str, group, ranks_per_node: int) -> AllToAll:
    """The all-to-all of `kind` over `group`; ranks_per_node counts the group's ranks on one node."""
    if kind not in KINDS:
        raise ValueError(f"all-to-all kind {kind!r} is not one of {KINDS} (PCC is composed by the dispatcher)")
    if hasattr(group, "make_all_to_all"):                 # device groups (NCCL, host-staged) bring their own
        return group.make_all_to_all(kind, ranks_per_node)
    if group.size == 1 or kind == "flat":
        return FlatAllToAll(group)
    return HierarchicalAllToAll(group, ranks_per_node)


class FlatAllToAll:
    """Every rank sends straight to every other: counts by Alltoall, then one Alltoallv per array
    (P - 1 messages a rank per array). On a group of one it copies."""

    def __init__(self, group):
        self.group = group

    def exchange(self, arrays, send_counts):
        counts = check_counts(arrays, send_counts, self.group.size)                 # [P]
        if self.group.size == 1:
            return [np.array(a, copy=True) for a in arrays], counts.copy()
        watch = getattr(self.group, "watch", None)                              # comm/watchdog.py
        recv = _alltoall_counts(self.group.comm, counts[:, None], watch)[:, 0]       # [P]
        return [_alltoallv(self.group.comm, a, counts, recv, watch) for a in arrays], recv

    def close(self) -> None:
        pass


class HierarchicalAllToAll:
    """Two hops: intra-node among the G ranks of a node, then inter-node among the M ranks with the same local
    index (DeepSpeed-MoE 5.3): (G - 1) + (M - 1) messages a rank instead of P - 1, each row moving at most twice.

    Group rank r = node * G + local. Rank (n, l) first sends to local peer (n, l') every row bound for local
    index l' on any node, blocks ordered by destination node; (n, l') then sends to (n', l') the blocks bound for
    it, ordered by source local index. Per-block counts matrices travel with each hop (Alltoall on the same
    sub-communicator), so every rank knows its block layout. Because the second hop orders its blocks by
    (source node, source local) = source rank, and every reordering is stable, rows arrive in the flat order:
    the final layout transform is the identity. Sub-communicators come from `group.comm.Split` once, each wrapped
    in a hop that moves the rows (MpiHop: host memory; comm/nccl_group.NcclHop: device memory over NCCL);
    `close()` frees them.
    """

    def __init__(self, group, ranks_per_node: int, make_hop=None):
        """make_hop(comm, members, what) -> the hop over one sub-communicator (`members`: its ranks in `group`);
        default MpiHop (host memory). NcclGroup passes one that builds an NCCL communicator per hop."""
        size, g = group.size, int(ranks_per_node)
        if g < 1 or size % g:
            raise ValueError(f"hierarchical all-to-all: ranks_per_node = {ranks_per_node} must divide the "
                             f"group size {size}")
        self.group, self.G, self.M = group, g, size // g
        make_hop = make_hop or (lambda comm, members, what: MpiHop(comm, _sub_watchdog(group, comm, members, what)))
        node, local = divmod(group.rank, g)
        self.intra = make_hop(group.comm.Split(color=node, key=local),          # the G ranks of this node
                              [node * g + q for q in range(g)], "intra-node")
        self.inter = make_hop(group.comm.Split(color=local, key=node),          # the M ranks with this local index
                              [n * g + local for n in range(self.M)], "inter-node")

    def exchange(self, arrays, send_counts):
        counts = check_counts(arrays, send_counts, self.group.size).reshape(self.M, self.G)  # [M dest node, G dest local]
        # step 1 (intra-node): local transform to (dest local, dest node), send the dest-local block to that peer
        arrays = _transpose_blocks(arrays, counts)
        arrays, got1 = self.intra.exchange_blocks(arrays, counts.T)             # got1 [G src local, M dest node]
        # step 2 (inter-node): local transform to (dest node, src local), send the dest-node block to that node
        arrays = _transpose_blocks(arrays, got1)
        arrays, got2 = self.inter.exchange_blocks(arrays, got1.T)               # got2 [M src node, G src local]
        return arrays, got2.reshape(-1)                                          # rows in source rank order

    def close(self) -> None:
        for hop in (self.intra, self.inter):
            if hop is not None:
                hop.free()
        self.intra = self.inter = None


class MpiHop:
    """One direct exchange of row blocks over an mpi4py (sub-)communicator, in host memory: the block counts by
    Alltoall, then one Alltoallv per array. `free()` frees the communicator and its watchdog."""

    def __init__(self, comm, watch=None):
        self.comm, self.watch = comm, watch

    def exchange_blocks(self, arrays, by_peer):
        """arrays: rows grouped by destination peer, then by block; by_peer int [P, K] rows per (peer, block) ->
        (arrays received, grouped by source peer then block; got [P, K], row p from peer p)."""
        got = _alltoall_counts(self.comm, by_peer, self.watch)
        return [_alltoallv(self.comm, a, np.sum(by_peer, 1), got.sum(1), self.watch) for a in arrays], got

    def free(self) -> None:
        if self.watch is not None:
            self.watch.free()
        self.comm.Free()


def _sub_watchdog(group, comm, members: list[int], what: str):
    """A watchdog for a sub-communicator of a watched group (members: their group ranks), or None."""
    parent = getattr(group, "watch", None)
    if parent is None:
        return None
    return Watchdog(comm, f"{group.name} {what}", parent.timeout, [parent.world_ranks[m] for m in members],
                    parent.arrivals)


# ------------------------------------------------------------------------------------------------ local helpers

def check_counts(arrays, send_counts, size: int) -> np.ndarray:
    """send_counts as int64 [P]; every array has sum(send_counts) rows."""
    counts = np.asarray(send_counts, dtype=np.int64).reshape(-1)
    if counts.shape != (size,) or (counts < 0).any():
        raise ValueError(f"send_counts must be {size} non-negative counts (one per group rank), got {send_counts}")
    n = int(counts.sum())
    for a in arrays:
        if a.ndim == 0 or a.shape[0] != n:
            raise ValueError(f"every array needs sum(send_counts) = {n} rows, got shape {a.shape}")
    return counts


def block_starts(counts: np.ndarray) -> np.ndarray:
    """Offsets of consecutive blocks of these lengths (exclusive cumsum)."""
    return np.cumsum(counts) - counts


def _transpose_blocks(arrays, counts: np.ndarray):
    """Rows laid out as blocks [A, B] (lengths counts [A, B], row-major) -> blocks [B, A], stable inside each."""
    if 1 in counts.shape:
        return arrays                                                            # already in [B, A] order
    old = block_starts(counts.reshape(-1)).reshape(counts.shape).T.reshape(-1)       # [B*A] block starts, new order
    lens = counts.T.reshape(-1)                                                  # [B*A]
    index = np.repeat(old - block_starts(lens), lens) + np.arange(lens.sum())         # [N]
    return [a[index] if isinstance(a, np.ndarray) else a[_device_index(a, index)] for a in arrays]


def _device_index(a, index: np.ndarray):
    """A host index array on the device of `a` (a cupy array: the NCCL hierarchical exchange)."""
    import cupy

    return cupy.asarray(index)


def _alltoall_counts(comm, counts: np.ndarray, watch=None) -> np.ndarray:
    """counts int64 [P, K]: row p goes to rank p; returns [P, K], row p from rank p."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    out = np.empty_like(counts)
    if watch is None:
        comm.Alltoall(counts, out)
    else:
        watch.run("all_to_all (counts)", lambda: comm.Ialltoall(counts, out), lambda: comm.Alltoall(counts, out))
    return out


def _alltoallv(comm, a: np.ndarray, send_counts, recv_counts, watch=None) -> np.ndarray:
    """Rows of a [N, *s] -> [R, *s] by one Alltoallv; counts [P] in rows, passed to MPI in elements of a.dtype."""
    a = np.ascontiguousarray(a)
    out = np.empty((int(recv_counts.sum()), *a.shape[1:]), dtype=a.dtype)
    width = int(np.prod(a.shape[1:], dtype=np.int64))                          # elements per row
    if width == 0:
        return out
    send, recv = np.asarray(send_counts) * width, np.asarray(recv_counts) * width
    spec = ([a.reshape(-1), (send.tolist(), block_starts(send).tolist())],
            [out.reshape(-1), (recv.tolist(), block_starts(recv).tolist())])
    if watch is None:
        comm.Alltoallv(*spec)
    else:
        watch.run("all_to_all_v", lambda: comm.Ialltoallv(*spec), lambda: comm.Alltoallv(*spec))
    return out


# --------------------------------------------------------------------------------- message and byte accounting

def message_stats(kind: str, world: int, ranks_per_node: int, tp: int, rows_per_pair: int, row_bytes: int) -> dict:
    """Messages and payload bytes one rank sends per exchange under `kind`, from the schedules (no MPI).

    Model: in a flat exchange every rank sends rows_per_pair rows of row_bytes to every other rank. Only payload
    messages to other ranks are counted, one per non-empty peer (the counts exchanged alongside go to the same
    peers: 8 bytes a peer in flat, 8 * M or 8 * G in the hierarchical hops). PCC: each of the tp ranks holding
    the same (replicated) tokens takes 1/tp of them and exchanges among the world / tp ranks sharing its tp rank
    (rows_per_pair rows a peer again), then all-gathers its share of world / tp * rows_per_pair rows inside the tp
    group: tp - 1 messages of one share, for a ring and for direct sends alike. pcc+hierarchical does the subset
    exchange hierarchically with ranks_per_node // tp subset ranks a node. Returns {"kind", "messages", "bytes",
    "steps": [{"what", "messages", "bytes"}]}.
    """
    _check_stats(kind, world, ranks_per_node, tp)
    rows = rows_per_pair
    if kind == "flat":
        steps = _flat_steps(world, rows)
    elif kind == "hierarchical":
        steps = _hierarchical_steps(world, ranks_per_node, rows)
    else:
        subset = world // tp
        inner = _flat_steps(subset, rows) if kind == "pcc" else _hierarchical_steps(subset, ranks_per_node // tp,
                                                                                  rows)
        steps = inner + [_step(f"all-gather in the tp group of {tp} (ring or direct): {subset * rows} rows a "
                               f"message", tp - 1, subset * rows)]
    steps = [{"what": s["what"], "messages": s["messages"], "bytes": s["rows"] * row_bytes} for s in steps]
    return {"kind": kind, "messages": sum(s["messages"] for s in steps), "bytes": sum(s["bytes"] for s in steps),
            "steps": steps}


def _check_stats(kind: str, world: int, ranks_per_node: int, tp: int) -> None:
    kinds = ("flat", "hierarchical", "pcc", "pcc+hierarchical")
    if kind not in kinds:
        raise ValueError(f"all-to-all kind {kind!r} is not one of {kinds}")
    if min(world, ranks_per_node, tp) < 1 or world % ranks_per_node or world % tp:
        raise ValueError(f"ranks_per_node = {ranks_per_node} and tp = {tp} must divide the world size {world}")
    if kind == "pcc+hierarchical" and ranks_per_node % tp:
        raise ValueError(f"pcc+hierarchical: tp = {tp} must divide ranks_per_node = {ranks_per_node}")


def _step(what: str, peers: int, rows_each: int) -> dict:
    """One step sending rows_each rows to each of `peers` other ranks (no message when it sends no row)."""
    return {"what": what, "messages": peers if rows_each > 0 else 0, "rows": peers * rows_each}


def _flat_steps(size: int, rows: int) -> list[dict]:
    return [_step(f"alltoallv among {size} ranks: {rows} rows to each peer", size - 1, rows)]


def _hierarchical_steps(size: int, g: int, rows: int) -> list[dict]:
    m = size // g
    return [_step(f"intra-node alltoallv among {g} ranks: {m * rows} rows (bound for {m} nodes) to each peer",
                  g - 1, m * rows),
            _step(f"inter-node alltoallv among {m} ranks of one local index: {g * rows} rows (from {g} local "
                  f"sources) to each peer", m - 1, g * rows)]
