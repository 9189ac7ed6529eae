"""Measure this machine as N MPI ranks see it: per-rank rates under the runtime's thread split, and the links.

Run under mpiexec (bench/planner_check.py does): every rank measures at once (offload/profile.measure with the BLAS
threads the runtime would give it: the node's cores divided among its ranks), so the rates (matmul, streaming read,
decode-shaped matmuls' weight reads: the slowest rank's) are what one rank gets while the others work; then ranks
0 and 1 play ping-pong: the latency is half the round trip of an 8-byte message, the bandwidth a 16 MiB message's
size over half its round trip. Ranks 0 and 1 share a node here; with one node
the inter-node link is set equal to the intra-node one. `hpcinfer profile` notes in the profile how it was
measured: under mpiexec (with_mpiexec_noted), or by one process, whose links stay the defaults
(with_link_defaults_noted).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

from ..comm.mesh import shared_memory_ranks
from ..offload.profile import measure

LINK_DEFAULTS_NOTE = ("gpus_per_node = {gpus} ({how}); intra_node_* and inter_node_* link figures are defaults, "
                      "not measured: run `mpiexec -n R hpcinfer profile` with the ranks of one node to measure them")


def ping_pong(comm, nbytes: int, repeats: int) -> float:
    """Half the best round trip of an nbytes message between ranks 0 and 1 (seconds; other ranks return 0)."""
    buf = np.zeros(max(nbytes, 1), np.uint8)
    best = float("inf")
    for _ in range(repeats + 1):                                     # the first round warms the path
        comm.Barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif comm.rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        best = min(best, time.perf_counter() - t0)
    return best / 2 if comm.rank < 2 else 0.0


def measure_ranks(comm, tmp_dir: str, size: int = 64 * 2**20):
    """A HardwareProfile of one rank of this node (on rank 0; None elsewhere). Needs >= 2 ranks."""
    local = shared_memory_ranks(comm)
    threads = max(1, len(os.sched_getaffinity(0)) // local)
    with threadpool_limits(threads):
        comm.Barrier()
        profile = measure(tmp_dir, size=size)
    latency = ping_pong(comm, 8, 200)
    round_trip = ping_pong(comm, 16 * 2**20, 10)                        # 0 on ranks >= 2, which do not play
    bandwidth = 16 * 2**20 / round_trip if round_trip > 0 else 0.0
    flops = comm.allreduce(profile.device_flops, op=_min())
    memory_bw = comm.allreduce(profile.device_bandwidth, op=_min())
    gemv_bw = comm.allreduce(profile.gemv_bandwidth, op=_min())         # decode-shaped matmuls (profile.measure)
    if comm.rank != 0:
        return None
    return dataclasses.replace(
        profile, name=f"{profile.name}, {comm.size} ranks x {threads} threads", device_flops=flops,
        host_flops=flops, device_bandwidth=memory_bw, host_bandwidth=memory_bw, gemv_bandwidth=gemv_bw,
        gpus_per_node=local,
        intra_node_latency=latency, intra_node_bandwidth=bandwidth, inter_node_latency=latency,
        inter_node_bandwidth=bandwidth,
        notes=profile.notes + f"; rates per rank with {threads} BLAS threads while all {comm.size} ranks measure; "
                              f"links by MPI ping-pong (one node: inter = intra)")


def with_mpiexec_noted(profile, ranks: int, budgets: dict):
    """measure_ranks' profile with the tier budgets given (`hpcinfer profile --device-memory ...`) and a note of
    how it was measured."""
    note = (f"measured under mpiexec -n {ranks}: gpus_per_node = {profile.gpus_per_node} (the ranks sharing "
            "this node's memory)")
    return dataclasses.replace(profile.with_budgets(**budgets), notes=f"{profile.notes}; {note}")


def with_link_defaults_noted(profile, ops):
    """A 1-process profile (measured with `ops`): the links stay the defaults, and its notes say so. On cupy,
    gpus_per_node is the number of GPUs this process sees (counted); on numpy it stays 1 (one process is one
    rank)."""
    how = "default: one process is one rank"
    gpus = profile.gpus_per_node
    if profile.notes.startswith("cupy backend"):
        gpus, how = max(1, int(ops.xp.cuda.runtime.getDeviceCount())), "GPUs this process sees, counted"
    note = LINK_DEFAULTS_NOTE.format(gpus=gpus, how=how)
    notes = f"{profile.notes}; {note}" if profile.notes else note
    return dataclasses.replace(profile, gpus_per_node=gpus, notes=notes)


def _min():
    from mpi4py import MPI

    return MPI.MIN
