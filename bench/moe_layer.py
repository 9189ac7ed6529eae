"""One MPI job of the MoE benchmark (moe.py, part b): the MoE layer (router, top-k gating, routing tables,
Dispatcher with an ExpertStack of random SiLU-gated experts) under every all-to-all variant on this mesh, checked
against each other and against the single-rank path, then timed in alternating rounds. Rank 0 prints one JSON line.

    .venv/bin/mpiexec -n 4 .venv/bin/python -m bench.moe_layer --tp 2 --ranks-per-node 2

Each rank runs 1 BLAS thread. Nodes are simulated: `--ranks-per-node` says how many consecutive world ranks share
a node, which decides the two levels of the hierarchical exchanges (hpcinfer.comm.mesh.Mesh.node_size_in).

Shape legend: T tokens per rank (shared by its tp group), D hidden, E experts, F expert width, K top-k.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from hpcinfer.backend.moe_ops import capacity_for
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.comm.all_to_all import FlatAllToAll, HierarchicalAllToAll
from hpcinfer.comm.group import Groups, MPIGroup, MoELayout
from hpcinfer.comm.mesh import build_mesh
from hpcinfer.parallel.experts import ExpertStack
from hpcinfer.parallel.moe_dispatch import Dispatcher

VARIANTS = ("flat", "hierarchical", "pcc", "pcc+hierarchical")
LOCAL = "local"                # every expert on every rank, no exchange: the single-rank path, for reference


# ---- random weights behind the checkpoint interface ExpertStack.load reads -----------------------------------------

class RandomExperts:
    """Full [E, F, D] gate / up / down stacks, identical on every rank (one seed); read_slab as a checkpoint."""

    def __init__(self, seed: int, experts: int, ffn: int, hidden: int):
        rng = np.random.default_rng(seed)
        self.arrays = {
            "bench.gate.weight": (rng.standard_normal((experts, ffn, hidden)) / hidden ** 0.5).astype(np.float32),
            "bench.up.weight": (rng.standard_normal((experts, ffn, hidden)) / hidden ** 0.5).astype(np.float32),
            "bench.down.weight": (rng.standard_normal((experts, ffn, hidden)) / ffn ** 0.5).astype(np.float32),
        }
        self.router = (rng.standard_normal((experts, hidden)) * 2 / hidden ** 0.5).astype(np.float32)   # [E, D]

    def read_slab(self, name: str, index: tuple) -> np.ndarray:
        return self.arrays[name][tuple(index)]


def expert_arch(ffn: int):
    """The ModelArch fields ExpertStack reads: Mixtral-style SiLU-gated experts without biases."""
    return SimpleNamespace(activation="silu", gated_mlp=True, expert_size=ffn, mlp_bias=False)


# ---- timing and message counting around the Dispatcher's comm steps -------------------------------------------------

class Clock:
    def __init__(self):
        self.seconds = 0.0


class TimedExchange:
    """Wraps an AllToAll: adds the time spent inside exchange() to clock (waiting for peers included)."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock = inner, clock

    def exchange(self, arrays, send_counts):
        t0 = time.perf_counter()
        try:
            return self.inner.exchange(arrays, send_counts)
        finally:
            self.clock.seconds += time.perf_counter() - t0

    def close(self):
        self.inner.close()


class TimedGroup:
    """Wraps the tp group the Dispatcher all-gathers over (PCC): all_gather_v timed, the rest passed through."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock = inner, clock
        self.size, self.rank = inner.size, inner.rank

    def all_gather_v(self, x):
        t0 = time.perf_counter()
        try:
            return self.inner.all_gather_v(x)
        finally:
            self.clock.seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.inner, name)


class CountingComm:
    """Wraps an mpi4py communicator: counts the payload messages and bytes this rank sends to other ranks in
    Alltoallv (one message per peer with a non-empty block) and Allgatherv (direct sends: size - 1 messages of
    the local block when it is non-empty), split into float32 rows and int64 index arrays. The count exchanges
    (Alltoall, allgather of sizes) are not counted, as in message_stats."""

    def __init__(self, comm, tally: dict):
        self._comm, self._tally = comm, tally

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _add(self, dtype, messages: int, nbytes: int):
        key = "rows" if np.dtype(dtype) == np.float32 else "ids"
        self._tally[key]["messages"] += messages
        self._tally[key]["bytes"] += nbytes

    def Alltoallv(self, send, recv):
        buf, (counts, _displs) = send
        me = self._comm.Get_rank()
        peers = [c for p, c in enumerate(counts) if p != me and c > 0]
        self._add(buf.dtype, len(peers), int(sum(peers)) * buf.itemsize)
        return self._comm.Alltoallv(send, recv)

    def Allgatherv(self, x, recv):
        others = self._comm.Get_size() - 1
        if x.size:
            self._add(x.dtype, others, others * x.nbytes)
        return self._comm.Allgatherv(x, recv)


@contextmanager
def counting(disp, tally: dict):
    """Route the Dispatcher's MPI calls through CountingComm for the duration (restored afterwards)."""
    ex = disp.exchange.inner if isinstance(disp.exchange, TimedExchange) else disp.exchange
    saved_tp = disp.tp
    if isinstance(ex, FlatAllToAll):
        saved = ex.group
        ex.group = SimpleNamespace(size=saved.size, rank=saved.rank, comm=CountingComm(saved.comm, tally))
    else:
        saved = (ex.intra.comm, ex.inter.comm)
        ex.intra.comm, ex.inter.comm = CountingComm(ex.intra.comm, tally), CountingComm(ex.inter.comm, tally)
    tp = saved_tp.inner if isinstance(saved_tp, TimedGroup) else saved_tp
    if isinstance(tp, MPIGroup):
        disp.tp = MPIGroup(CountingComm(tp.comm, tally), "tp")
    try:
        yield
    finally:
        if isinstance(ex, FlatAllToAll):
            ex.group = saved
        else:
            ex.intra.comm, ex.inter.comm = saved
        disp.tp = saved_tp


def levels(disp) -> dict:
    """What the Dispatcher's exchange actually is here: its group and, when hierarchical, G x M."""
    ex = disp.exchange.inner if isinstance(disp.exchange, TimedExchange) else disp.exchange
    out = {"group": "dp" if disp.pcc else "stage", "group_size": disp.group.size, "pcc_all_gather": disp.pcc}
    if isinstance(ex, HierarchicalAllToAll):
        out.update(hierarchical=True, ranks_per_node_G=ex.G, nodes_M=ex.M)
    else:
        out.update(hierarchical=False)
    return out


# ---- the layer ---------------------------------------------------------------------------------------------------

class Layer:
    """router -> top-k gating -> routing tables -> Dispatcher(ExpertStack): MoE.__call__ without the PR-MoE
    residual, with no capacity limit (top-k Mixtral style) unless --capacity-factor > 0."""

    def __init__(self, ops, disp, experts, router, args):
        self.ops, self.disp, self.experts, self.router, self.args = ops, disp, experts, router, args

    def __call__(self, x):
        a = self.args
        logits = self.ops.linear(x, self.router)                                       # [T, E]
        chosen, weights = self.ops.top_k_gating(logits, a.top_k, a.normalize)           # [T, K]
        capacity = capacity_for(x.shape[0], a.experts, a.capacity_factor, a.min_capacity) \
            if a.capacity_factor > 0 else None
        routing = self.ops.route(chosen, weights, a.experts, capacity)
        return self.disp(x, routing, self.experts)                                      # [T, D]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.moe_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, default=2, help="simulated node size in world ranks")
    p.add_argument("--expert-tp", type=int, default=1, help="expert-slicing degree (ep = world / expert_tp)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (replicated over its tp group)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ffn", type=int, default=512, help="expert FFN width F")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--normalize", default="topk", choices=("topk", "none"))
    p.add_argument("--capacity-factor", type=float, default=0.0, help="> 0: DeepSpeed capacity; 0: no limit")
    p.add_argument("--min-capacity", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (each runs every variant, rotated)")
    p.add_argument("--inner", type=int, default=3, help="layer calls per timed sample")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    t_start = time.perf_counter()
    mesh = build_mesh(comm, args.tp, 1, args.ranks_per_node)
    stage_rpn, dp_rpn = mesh.node_size_in(mesh.stage_members()), mesh.node_size_in(mesh.dp_members())
    ep = mesh.stage.size // args.expert_tp
    if mesh.stage.size % args.expert_tp or args.experts % ep:
        raise SystemExit(f"bench.moe_layer: expert_tp = {args.expert_tp} must divide {mesh.stage.size} ranks and "
                         f"ep = {ep} the {args.experts} experts")
    ops = NumpyOps()
    weights = RandomExperts(args.seed, args.experts, args.ffn, args.hidden)
    arch = expert_arch(args.ffn)
    variants = [v for v in args.variants.split(",") if v]

    layers, clocks, info = {}, {}, {}
    for v in variants:
        layout = MoELayout(ep, args.expert_tp, v, stage_rpn, dp_rpn)
        groups = Groups(tp=mesh.tp, pp=mesh.pp, stage=mesh.stage, dp=mesh.dp, moe=layout)
        stack = ExpertStack(ops, arch, "bench", args.experts, layout, mesh.stage.rank, "float32")
        stack.load(weights)
        disp = Dispatcher(ops, groups, args.experts)
        clocks[v] = Clock()
        disp.exchange = TimedExchange(disp.exchange, clocks[v])
        disp.tp = TimedGroup(disp.tp, clocks[v])
        layers[v] = Layer(ops, disp, stack, weights.router, args)
        info[v] = levels(disp)
    local_stack = ExpertStack(ops, arch, "bench", args.experts, MoELayout(), 0, "float32")
    local_stack.load(weights)
    layers[LOCAL] = Layer(ops, Dispatcher(ops, Groups(), args.experts), local_stack, weights.router, args)
    clocks[LOCAL] = Clock()

    # Tokens: one set per data-parallel replica, the same on the ranks of a tp group (replicated activations).
    dp_index = mesh.coords[1]
    x = np.random.default_rng(10_000 + args.seed * 1000 + dp_index).standard_normal(
        (args.tokens, args.hidden)).astype(np.float32)

    # Check: every variant against the single-rank path and against each other, on every rank; count messages.
    ref = layers[LOCAL](x)
    outs, tallies = {}, {}
    for v in variants:
        tallies[v] = {"rows": {"messages": 0, "bytes": 0}, "ids": {"messages": 0, "bytes": 0}}
        with counting(layers[v].disp, tallies[v]):
            outs[v] = layers[v](x)
    diff_local = max(float(np.max(np.abs(outs[v] - ref))) for v in variants)
    diff_between = max(float(np.max(np.abs(outs[v] - outs[variants[0]]))) for v in variants)
    ok = all(np.allclose(outs[v], ref, rtol=1e-5, atol=1e-5) and np.allclose(outs[v], outs[variants[0]],
                                                                              rtol=1e-6, atol=1e-6)
             for v in variants)
    identical = all(np.array_equal(outs[v], outs[variants[0]]) for v in variants)
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    all_identical = comm.allreduce(identical, op=MPI.LAND)
    diff_local, diff_between = comm.allreduce(diff_local, op=MPI.MAX), comm.allreduce(diff_between, op=MPI.MAX)
    gathered_tallies = comm.gather(tallies, root=0)
    if not all_ok:
        if rank == 0:
            print(json.dumps({"error": "variants disagree", "max_abs_diff_vs_local": diff_local,
                              "max_abs_diff_between_variants": diff_between}), flush=True)
        return 1

    # Warm-up, then rounds: every variant once per round (rotated start), `inner` calls per sample; a sample is
    # the slowest rank's time from a common barrier.
    names = variants + [LOCAL]
    for v in names:
        layers[v](x)
    samples = {v: [] for v in names}
    comm_share = {v: [] for v in names}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            clocks[v].seconds = 0.0
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.inner):
                layers[v](x)
            elapsed = time.perf_counter() - t0
            slowest = comm.allreduce(elapsed, op=MPI.MAX)
            in_comm = comm.allreduce(clocks[v].seconds, op=MPI.SUM) / world       # mean over ranks
            samples[v].append(slowest / args.inner)
            comm_share[v].append(in_comm / args.inner)
    for v in variants:
        layers[v].disp.exchange.close()

    if rank == 0:
        def per_rank(v, key):
            m = [t[v][key]["messages"] for t in gathered_tallies]
            b = [t[v][key]["bytes"] for t in gathered_tallies]
            return {"messages_mean": float(np.mean(m)), "messages_max": int(max(m)), "bytes_mean": float(np.mean(b)),
                    "bytes_max": int(max(b))}

        out = {
            "world": world, "tp": args.tp, "dp": mesh.shape.dp, "ep": ep, "expert_tp": args.expert_tp,
            "ranks_per_node": args.ranks_per_node, "stage_ranks_per_node": stage_rpn, "dp_ranks_per_node": dp_rpn,
            "settings": {k: getattr(args, k) for k in ("tokens", "hidden", "experts", "ffn", "top_k", "normalize",
                                                       "capacity_factor", "min_capacity", "repeats", "inner",
                                                       "seed")},
            "blas_threads_per_rank": 1,
            "checks": {"allclose": bool(all_ok), "identical_between_variants": bool(all_identical),
                       "max_abs_diff_vs_local": diff_local, "max_abs_diff_between_variants": diff_between},
            "layer_s": samples, "in_comm_s": comm_share,
            "layer_s_median": {v: float(np.median(samples[v])) for v in names},
            "in_comm_s_median": {v: float(np.median(comm_share[v])) for v in names},
            "levels": info,
            "measured_per_layer": {v: {"rows": per_rank(v, "rows"), "ids": per_rank(v, "ids")} for v in variants},
            "job_s": round(time.perf_counter() - t_start, 2),
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
