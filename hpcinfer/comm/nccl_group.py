"""CommGroups for device (CuPy) arrays: NCCL communicators built from MPI groups, and MPI through host memory.

- `NcclGroup(mpi_group)`: rank 0 makes an NCCL unique id, the MPI group broadcasts it, every rank joins one
  communicator (`NcclCommunicator(size, uid, rank)`). Device arrays move over NCCL on the current stream (so a
  CUDA graph captures them); host (NumPy) arrays and Python objects still go over MPI (the sampled tokens, the
  lockstep counters and the pipeline headers are small host values). Point-to-point arrays always travel over
  NCCL, whatever memory they come from, and arrive on the device: NCCL has no tags, so the k-th array sent from
  a to b is the k-th received by b from a, and callers pair each array with a header sent over MPI first (as
  comm/pipeline.py's StageLink does).
- `StagedMPIGroup(mpi_group)`: `[runtime] comm = "mpi"` with the CuPy backend. Device arrays go to the host, over
  the MPIGroup, and back. Slower, but it lets several ranks share one GPU (NCCL refuses two ranks of one
  communicator on the same device) and needs no NCCL.
- `NcclAllToAll` / `StagedAllToAll`: the `exchange(arrays, send_counts)` of comm/all_to_all.py over those groups.
  Both groups offer `make_all_to_all(kind, ranks_per_node)`, which comm/all_to_all.make_all_to_all hands
  over to (the MPI versions index host memory). `NcclHop`: a hop of the two-hop hierarchical exchange over an
  NCCL communicator of a sub-communicator.

Everything here imports without cupy and without a GPU; building a group that needs one says what is missing.
Shape legend: P=group size, N=rows sent, R=rows received, *s=trailing shape of a row.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import ConfigError
from .all_to_all import HierarchicalAllToAll, block_starts, check_counts, make_all_to_all

COMMS = ("auto", "nccl", "mpi")


# ------------------------------------------------------------------------------------------ availability checks

def _import_nccl():
    """(cupy, cupy.cuda.nccl), or a ConfigError naming what is missing (cupy, a GPU, the NCCL library)."""
    try:
        import cupy
    except ImportError:
        raise ConfigError("NCCL communicators need cupy and a CUDA GPU: pip install -e '.[gpu]' "
                          "(see docs/gpu.md)") from None
    try:
        available = bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU"
        available = False
    if not available:
        raise ConfigError("NCCL communicators need a CUDA GPU, and cupy sees none here (cupy.is_available() is "
                          "False); use [runtime] comm = \"mpi\" or the numpy backend")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from cupy.cuda import nccl
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        reason = "; ".join(str(w.message).strip().splitlines()[0] for w in caught) or "import failed"
        raise ConfigError(f"the NCCL library cannot be loaded ({reason}): pip install nvidia-nccl-cu12 "
                          f"(nvidia-nccl-cu13 with cupy-cuda13x), or use [runtime] comm = \"mpi\"")
    return cupy, nccl


def nccl_available() -> bool:
    try:
        _import_nccl()
    except ConfigError:
        return False
    return True


def resolve_comm(comm: str, ops, world) -> str:
    """`[runtime] comm` -> "nccl" or "mpi" for this job, the same on every rank; every rank of `world` (an mpi4py
    communicator) must call it (one allgather).

    auto: nccl with the cupy backend when NCCL loads on every rank and no two ranks share a GPU, else mpi.
    nccl: required, so a ConfigError when the backend is numpy, NCCL is missing or ranks share a GPU.
    """
    if comm not in COMMS:
        raise ConfigError(f"[runtime] comm = {comm!r} is not one of {', '.join(COMMS)}")
    mine = (ops.name, _gpu_of(ops), ops.name == "cupy" and comm != "mpi" and nccl_available())
    everyone = world.allgather(mine)                 # collective: every rank takes part, whatever it decides
    backends = sorted({name for name, _, _ in everyone})
    if len(backends) > 1:
        raise ConfigError(f"the ranks resolved [runtime] backend to different backends ({', '.join(backends)}); "
                          f"set it explicitly")
    if ops.name != "cupy":
        if comm == "nccl":
            raise ConfigError(f"[runtime] comm = \"nccl\" needs the cupy backend (device arrays); this run uses "
                              f"the {ops.name} backend")
        return "mpi"
    if comm == "mpi":
        return "mpi"
    shared = _shared_gpu([gpu for _, gpu, _ in everyone])
    if comm == "auto":
        return "nccl" if not shared and all(ok for _, _, ok in everyone) else "mpi"
    if shared:
        raise ConfigError(f"[runtime] comm = \"nccl\": {shared}; NCCL refuses two ranks of one communicator on "
                          f"one GPU. Give each rank its own GPU, or use comm = \"mpi\"")
    _import_nccl()                                   # the reason, where NCCL does not load
    if not all(ok for _, _, ok in everyone):
        raise ConfigError("[runtime] comm = \"nccl\": the NCCL library does not load on every rank")
    return "nccl"


def _gpu_of(ops):
    """(host name, PCI bus id) of this rank's GPU, or None for a CPU backend."""
    if ops.name != "cupy":
        return None
    import socket

    cp = ops.xp
    return socket.gethostname(), cp.cuda.Device(cp.cuda.runtime.getDevice()).pci_bus_id


def _shared_gpu(gpus: list) -> str:
    """'' when no two ranks use one GPU, else which ones do."""
    seen: dict = {}
    for rank, gpu in enumerate(gpus):
        if gpu in seen:
            return f"ranks {seen[gpu]} and {rank} share GPU {gpu[1]} on {gpu[0]}"
        seen[gpu] = rank
    return ""


def device_group_factory(comm: str, ops):
    """What the runtime wraps each MPIGroup of the mesh in: NcclGroup (comm nccl), StagedMPIGroup (cupy backend
    over mpi), or nothing (numpy backend). `comm` is resolve_comm's answer."""
    if comm == "nccl":
        return NcclGroup
    if ops.name == "cupy":
        return StagedMPIGroup
    return lambda group: group


# ------------------------------------------------------------------------------------------------------- NCCL

class NcclGroup:
    """A CommGroup whose device arrays move over NCCL (on the current stream), built from an MPIGroup.
    A group of one rank makes no communicator: its collectives are the identity (as SoloGroup's)."""

    def __init__(self, mpi_group):
        cp, nccl = _import_nccl()
        self.cp, self.nccl_lib = cp, nccl
        self.mpi, self.name = mpi_group, getattr(mpi_group, "name", "group")
        self.size, self.rank = mpi_group.size, mpi_group.rank
        self.comm = mpi_group.comm                     # the MPI communicator (objects, counts, host arrays)
        self.nccl = None
        if self.size > 1:
            uid, error = None, None
            if self.rank == 0:
                try:
                    uid = nccl.get_unique_id()
                except Exception as exc:  # noqa: BLE001 - sent to every rank, so none waits forever
                    error = f"{type(exc).__name__}: {exc}"
            uid, error = self.comm.bcast((uid, error), root=0)
            if error is not None:
                raise RuntimeError(f"NCCL unique id for group {self.name} failed on its rank 0: {error}")
            self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)

    # ---- collectives ------------------------------------------------------------------------------------------
    def all_reduce(self, x):
        """Sum over the group, in place on a contiguous device array (host arrays: over MPI)."""
        if not self._on_device(x):
            return self.mpi.all_reduce(x)
        x = self.cp.ascontiguousarray(x)
        if self.nccl is not None and x.size:
            self.nccl.allReduce(x.data.ptr, x.data.ptr, x.size, self._reduce_type(x.dtype), self.nccl_lib.NCCL_SUM,
                                self._stream())
        return x

    def all_gather(self, x):
        """x [*s] -> [P, *s] in rank order."""
        if not self._on_device(x):
            return self.mpi.all_gather(x)
        x = self.cp.ascontiguousarray(x)
        out = self.cp.empty((self.size, *x.shape), dtype=x.dtype)
        if self.nccl is None:
            out[0] = x
        elif x.size:
            self.nccl.allGather(x.data.ptr, out.data.ptr, x.nbytes, self.nccl_lib.NCCL_UINT8, self._stream())
        return out

    def broadcast(self, x, root: int = 0):
        if not self._on_device(x):
            return self.mpi.broadcast(x, root)
        x = self.cp.ascontiguousarray(x)
        if self.nccl is not None and x.size:
            self.nccl.broadcast(x.data.ptr, x.data.ptr, x.nbytes, self.nccl_lib.NCCL_UINT8, root, self._stream())
        return x

    def all_gather_v(self, x):
        """x [n_r, *s] (n_r may differ by rank) -> every rank's rows in rank order: a padded all_gather (the row
        counts travel over MPI first, so every rank knows the padding)."""
        if not self._on_device(x):
            return self.mpi.all_gather_v(x)
        if self.nccl is None:
            return self.cp.ascontiguousarray(x)
        counts = self.comm.allgather(int(x.shape[0]))
        padded = self.cp.zeros((max(counts), *x.shape[1:]), dtype=x.dtype)
        padded[:x.shape[0]] = x
        gathered = self.all_gather(padded)                                           # [P, max n, *s]
        return self.cp.concatenate([gathered[r, :n] for r, n in enumerate(counts)])

    def barrier(self) -> None:
        """Every rank's queued device work is done, then an MPI barrier."""
        self.cp.cuda.get_current_stream().synchronize()
        self.comm.Barrier()

    # ---- point to point (pipeline stages) -------------------------------------------------------------------
    def isend_object(self, obj, dest: int, tag: int):
        return self.mpi.isend_object(obj, dest, tag)

    def recv_object(self, source: int, tag: int):
        return self.mpi.recv_object(source, tag)

    def isend_array(self, x, dest: int, tag: int):
        """Send x (host arrays are copied to the device first) over NCCL; `tag` is unused (NCCL keeps per-peer
        order). Returns a request with Test() and wait() that keeps the device buffer alive."""
        buffer = self.cp.ascontiguousarray(self.cp.asarray(x))
        self._grouped([("send", buffer, dest)])
        return _EventRequest(self.cp, buffer)

    def recv_array(self, shape, dtype, source: int, tag: int):
        """The next array from `source`, as a device array (ordered on the current stream)."""
        out = self.cp.empty(shape, dtype=np.uint16 if np.dtype(dtype).name == "bfloat16" else dtype)
        self._grouped([("recv", out, source)])
        return out

    def make_all_to_all(self, kind: str, ranks_per_node: int):
        """The all-to-all(v) over this group: "flat" is one NCCL group of direct sends and receives (P - 1
        messages); "hierarchical" is comm/all_to_all.HierarchicalAllToAll with each hop over an NCCL communicator
        of its own (the node's G ranks, then the M ranks of one local index: (G - 1) + (M - 1) messages)."""
        if kind == "flat" or self.size == 1 or ranks_per_node in (1, self.size):
            return NcclAllToAll(self)
        return HierarchicalAllToAll(self, ranks_per_node, make_hop=lambda comm, _members, what: NcclHop(
            NcclGroup(_SubGroup(comm, f"{self.name} {what}"))))

    # ---- helpers -------------------------------------------------------------------------------------------
    def _on_device(self, x) -> bool:
        return isinstance(x, self.cp.ndarray)

    def _stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def _reduce_type(self, dtype):
        nccl = self.nccl_lib
        types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
                 np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int64): nccl.NCCL_INT64,
                 np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint16): nccl.NCCL_BFLOAT16}  # uint16 = bf16 bits
        if np.dtype(dtype) not in types:
            raise TypeError(f"{self.name}: NCCL cannot sum {np.dtype(dtype)} arrays")
        return types[np.dtype(dtype)]

    def _grouped(self, transfers) -> None:
        """[(send | recv, contiguous device array, peer)] as one NCCL group (bytes; any dtype). A transfer with
        this rank itself is a device copy."""
        to_self = [buf for op, buf, peer in transfers if peer == self.rank and op == "send"]
        from_self = [buf for op, buf, peer in transfers if peer == self.rank and op == "recv"]
        for src, dst in zip(to_self, from_self):
            dst[...] = src.reshape(dst.shape)
        others = [(op, buf, peer) for op, buf, peer in transfers if peer != self.rank and buf.nbytes]
        if not others:
            return
        stream = self._stream()
        self.nccl_lib.groupStart()
        try:
            for op, buf, peer in others:
                if op == "send":
                    self.nccl.send(buf.data.ptr, buf.nbytes, self.nccl_lib.NCCL_UINT8, peer, stream)
                else:
                    self.nccl.recv(buf.data.ptr, buf.nbytes, self.nccl_lib.NCCL_UINT8, peer, stream)
        finally:
            self.nccl_lib.groupEnd()

    def close(self) -> None:
        """Destroy the NCCL communicator (a hop's, when its all-to-all closes); the MPI side is the caller's."""
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None

    def __repr__(self):
        return f"NcclGroup({self.name}, rank {self.rank} of {self.size})"


class _EventRequest:
    """A send in flight on the current stream: Test() polls an event recorded after it, wait() blocks on it.
    Holds the buffer until then (mpi4py's Request spelling, as comm/pipeline.py uses)."""

    def __init__(self, cp, buffer):
        self.buffer = buffer
        self.event = cp.cuda.get_current_stream().record()

    def Test(self) -> bool:
        done = self.event.done
        if done:
            self.buffer = None
        return done

    def wait(self) -> None:
        self.event.synchronize()
        self.buffer = None

    test, Wait = Test, wait


class NcclAllToAll:
    """exchange(arrays, send_counts) of comm/all_to_all.py over an NcclGroup: row counts by MPI Alltoall, then
    per array one NCCL group of sends and receives. Arrays come back in the memory they came from (host arrays
    are staged through the device: the dispatcher sends expert ids from the host)."""

    def __init__(self, group: NcclGroup):
        self.group = group

    def exchange(self, arrays, send_counts):
        counts = check_counts(arrays, send_counts, self.group.size)                # [P]
        arrays, got = NcclHop(self.group).exchange_blocks(arrays, counts[:, None])   # one block per peer
        return arrays, got[:, 0]

    def close(self) -> None:
        pass


class NcclHop:
    """One hop of the hierarchical all-to-all (comm/all_to_all.HierarchicalAllToAll) over an NcclGroup of a
    sub-communicator: block counts [P, K] by MPI Alltoall, rows by one NCCL group of sends and receives."""

    def __init__(self, group: NcclGroup):
        self.group, self.comm = group, group.comm

    def exchange_blocks(self, arrays, by_peer):
        by_peer = np.ascontiguousarray(by_peer, dtype=np.int64)                   # [P, K]
        got = np.empty_like(by_peer)
        self.comm.Alltoall(by_peer, got)                                            # [P, K], row p from peer p
        rows, recv_rows = by_peer.sum(1), got.sum(1)
        return [_exchange_rows(self.group, a, rows, recv_rows) for a in arrays], got

    def free(self) -> None:
        self.group.close()
        self.comm.Free()


class _SubGroup:
    """The MPI side of an NCCL hop: what NcclGroup reads from an MPIGroup (comm, size, rank, name)."""

    def __init__(self, comm, name: str):
        self.comm, self.name = comm, name
        self.size, self.rank = comm.Get_size(), comm.Get_rank()


def _exchange_rows(group: NcclGroup, a, counts, recv_counts):
    """Rows of a [N, *s] (host or device), counts[p] of them to peer p, -> [R, *s] received in peer order, in
    the memory `a` came from (host arrays are staged through the device)."""
    cp = group.cp
    send_at, recv_at = block_starts(counts), block_starts(recv_counts)
    send = cp.ascontiguousarray(cp.asarray(a))                                      # [N, *s]
    recv = cp.empty((int(recv_counts.sum()), *send.shape[1:]), dtype=send.dtype)   # [R, *s]
    transfers = []
    for peer in range(group.size):
        transfers.append(("send", send[send_at[peer]:send_at[peer] + counts[peer]], peer))
        transfers.append(("recv", recv[recv_at[peer]:recv_at[peer] + recv_counts[peer]], peer))
    group._grouped(transfers)
    return recv if isinstance(a, cp.ndarray) else recv.get()


# ------------------------------------------------------------------------------------ MPI through host memory

class StagedMPIGroup:
    """A CommGroup for the CuPy backend over an MPIGroup: device arrays are copied to the host, moved by MPI and
    copied back (a device array in, a device array out); host arrays and objects pass straight through."""

    def __init__(self, mpi_group):
        import cupy

        self.cp, self.mpi = cupy, mpi_group
        self.name, self.size, self.rank = getattr(mpi_group, "name", "group"), mpi_group.size, mpi_group.rank
        self.comm = mpi_group.comm

    def _staged(self, method, x, *args):
        if not isinstance(x, self.cp.ndarray):
            return method(x, *args)
        return self.cp.asarray(method(self._host(x), *args))

    @staticmethod
    def _host(x):
        return np.ascontiguousarray(x.get())

    def all_reduce(self, x):
        return self._staged(self.mpi.all_reduce, x)

    def all_gather(self, x):
        return self._staged(self.mpi.all_gather, x)

    def broadcast(self, x, root: int = 0):
        return self._staged(self.mpi.broadcast, x, root)

    def all_gather_v(self, x):
        return self._staged(self.mpi.all_gather_v, x)

    def barrier(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()
        self.mpi.barrier()

    def isend_object(self, obj, dest: int, tag: int):
        return self.mpi.isend_object(obj, dest, tag)

    def recv_object(self, source: int, tag: int):
        return self.mpi.recv_object(source, tag)

    def isend_array(self, x, dest: int, tag: int):
        host = self._host(x) if isinstance(x, self.cp.ndarray) else np.ascontiguousarray(x)
        return _HeldRequest(self.mpi.isend_array(host, dest, tag), host)

    def recv_array(self, shape, dtype, source: int, tag: int):
        """A host array (the caller moves it to the device with ops.asarray)."""
        return self.mpi.recv_array(shape, dtype, source, tag)

    def make_all_to_all(self, kind: str, ranks_per_node: int):
        return StagedAllToAll(self.cp, make_all_to_all(kind, self.mpi, ranks_per_node))

    def __repr__(self):
        return f"StagedMPIGroup({self.name}, rank {self.rank} of {self.size})"


class _HeldRequest:
    """An MPI request that keeps its host send buffer alive until it completes."""

    def __init__(self, request, buffer):
        self.request, self.buffer = request, buffer

    def Test(self) -> bool:
        return self.request.Test()

    def wait(self) -> None:
        self.request.wait()

    test, Wait = Test, wait


class StagedAllToAll:
    """An MPI all-to-all (flat or hierarchical) for device arrays: to the host, exchange, back."""

    def __init__(self, cp, inner):
        self.cp, self.inner = cp, inner

    def exchange(self, arrays, send_counts):
        on_device = [isinstance(a, self.cp.ndarray) for a in arrays]
        host = [a.get() if d else a for a, d in zip(arrays, on_device)]
        received, recv_counts = self.inner.exchange(host, send_counts)
        return [self.cp.asarray(r) if d else r for r, d in zip(received, on_device)], recv_counts

    def close(self) -> None:
        self.inner.close()


# ------------------------------------------------------------------------------------------------ local helpers

