"""Device-resident MoE routing for CupyOps: the routing tables are built and stay on the GPU.

`route` runs moe_gating.cu's moe_route (one block: the scan that numbers each (token, choice) inside its expert,
the capacity drop, the expert->token tables) and copies one thing to the host: the [E] kept rows per expert, which
give the row count R (the tables are sliced to it) and every host-side size the dispatcher needs (what it sends to
each rank, the expert stack's segments). `permute` gathers the rows with moe_permute; `unpermute` is CupyOps's
(moe_unpermute). Without the kernel (kernels off, E > MAX_EXPERTS) the same tables come from plain array code
(`route_arrays`, which runs on NumPy too and is held to moe_ops.route by the tests).

`gate_dispatch` is the paper's fused kernel (moe_gate_dispatch): gating, scan, tables and the row scatter in one
launch, for decode-sized T; the model does not call it yet (it calls top_k_gating, route and permute in turn).

Shape legend: T=tokens, D=hidden, E=experts, K=top-k, N=T*K (token, choice) pairs, R=kept rows (R <= N).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import moe_ops

F32 = np.float32
MAX_EXPERTS = 256          # moe_gating.cu's MAX_EXPERTS for every launch here
ROUTE_BLOCK = 256          # the single block of moe_route / moe_gate_dispatch: one thread per expert at E <= 256
BLOCK = 256                # moe_permute: threads per row
FUSED_MAX_TOKENS = 64      # gate_dispatch (one block walks every (token, choice) pair): decode-sized steps only
_i32, _i64 = np.int32, np.int64


@dataclass(frozen=True)
class DeviceRouting(moe_ops.Routing):
    """A moe_ops.Routing whose tables are device arrays (expert_of_row, token_of_row, weight_of_row [R]; slot,
    row_of_choice [T, K]) and whose expert_counts [E] is the host copy: the only routing data that crosses to the
    host. num_rows_d: [1] int64 device R, as moe_permute reads it (None from the plain-array path)."""

    num_rows_d: object = None


def route(ops, experts, weights, num_experts: int, capacity) -> DeviceRouting:
    """experts, weights [T, K] (device) -> DeviceRouting; the same tables as moe_ops.route (an expert id outside
    [0, E) is dropped rather than refused: checking would cost a copy, and top_k_gating never makes one)."""
    cp = ops.xp
    if experts.ndim != 2 or weights.shape != experts.shape:
        raise ValueError(f"route: experts and weights must both be [tokens, k]; got {experts.shape} and "
                         f"{weights.shape}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"route: capacity must be >= 0 (or None for no limit), got {capacity}")
    experts = cp.ascontiguousarray(cp.asarray(experts, dtype=np.int64))              # [T, K]
    weights = cp.ascontiguousarray(cp.asarray(weights, dtype=F32))                   # [T, K]
    T, K = experts.shape
    N, E = T * K, num_experts
    fn = ops._kernel("moe_gating", "moe_route", MAX_EXPERTS=MAX_EXPERTS, ROUTE_BLOCK=ROUTE_BLOCK)
    if fn is None or E > MAX_EXPERTS or N >= 2 ** 31 or N == 0:
        return route_arrays(cp, ops.to_host, experts, weights, E, capacity)
    t = _tables(cp, T, K, E)
    cap = -1 if capacity is None else min(int(capacity), N)
    fn((1,), (ROUTE_BLOCK,), (experts, weights, _i32(T), _i32(K), _i32(E), _i32(cap), t["expert_counts"],
                              t["offsets"], t["slot"], t["row_of_choice"], t["expert_of_row"], t["token_of_row"],
                              t["weight_of_row"], t["num_rows"]))
    return _routing(ops, t, T, K)


def route_arrays(xp, to_host, experts, weights, num_experts: int, capacity) -> DeviceRouting:
    """moe_ops.route in array code of `xp` (cupy or numpy), with no data-dependent shape before the one copy of
    the [E] counts: the kept pairs are scattered to row offsets[e] + slot (dropped ones to a spare row N)."""
    T, K = experts.shape
    N = T * K
    flat = experts.reshape(-1)                                                       # [N]
    order = xp.argsort(flat, kind="stable")                                         # [N] grouped by expert
    counts = xp.bincount(flat, minlength=num_experts)                                # [E] before capacity
    run_start = xp.cumsum(counts) - counts                                           # [E] exclusive scan
    slot = xp.empty(N, dtype=np.int64)
    slot[order] = xp.arange(N) - run_start[flat[order]]                              # [N] token-major
    kept_counts = counts if capacity is None else xp.minimum(counts, capacity)      # [E]
    expert_counts = np.asarray(to_host(kept_counts), dtype=np.int64)                 # the one device->host copy
    R = int(expert_counts.sum())
    offsets = xp.cumsum(kept_counts) - kept_counts                                   # [E] first row of expert e
    keep = slot < (N if capacity is None else capacity)                              # [N]
    row = xp.where(keep, offsets[flat] + slot, -1)                                   # [N] -1: dropped
    spare = xp.where(keep, row, N)                                                   # dropped pairs write row N
    expert_of_row = xp.empty(N + 1, dtype=np.int64)
    token_of_row = xp.empty(N + 1, dtype=np.int64)
    weight_of_row = xp.empty(N + 1, dtype=F32)
    expert_of_row[spare] = flat
    token_of_row[spare] = xp.arange(N) // K
    weight_of_row[spare] = weights.reshape(-1)
    return DeviceRouting(expert_of_row=expert_of_row[:R], token_of_row=token_of_row[:R],
                         weight_of_row=weight_of_row[:R], expert_counts=expert_counts,
                         slot=xp.where(keep, slot, -1).reshape(T, K), row_of_choice=row.reshape(T, K))


def permute(ops, x, routing):
    """x [T, D] -> rows [R, D] grouped by expert: moe_permute (one block per row) for float32 rows and a device
    routing; else a gather by index."""
    cp = ops.xp
    index = routing.token_of_row
    if not isinstance(index, cp.ndarray):
        return x[cp.asarray(index)]                      # a host routing: one copy of the [R] index
    num_rows_d = getattr(routing, "num_rows_d", None)
    fn = ops._kernel("moe_gating", "moe_permute", MAX_EXPERTS=MAX_EXPERTS, BLOCK=BLOCK)
    R = routing.num_rows
    if fn is None or num_rows_d is None or x.ndim != 2 or x.dtype != F32 or R == 0:
        return x[index]
    x, ld = ops._rows(x)
    D = x.shape[1]
    rows = cp.empty((R, D), dtype=F32)
    fn((R,), (BLOCK,), (x, index, num_rows_d, rows, _i32(D), _i64(ld), _i64(D)))
    return rows


def gate_dispatch(ops, logits, x, k: int, normalize: str, num_experts: int, capacity):
    """The fused kernel (moe_gate_dispatch, one block): logits [T, E] and x [T, D] (float32) -> (experts [T, K],
    weights [T, K], DeviceRouting, rows [R, D]) as top_k_gating + route + permute would give; one copy of the [E]
    counts to the host. Meant for decode-sized T (a single block does the whole gating). None when the kernel
    cannot run here (kernels off, E > MAX_EXPERTS, other dtypes): the caller then runs the three steps."""
    cp = ops.xp
    fn = ops._kernel("moe_gating", "moe_gate_dispatch", MAX_EXPERTS=MAX_EXPERTS, ROUTE_BLOCK=ROUTE_BLOCK,
                     PERMUTE=1)
    T, E = logits.shape
    if (fn is None or E != num_experts or E > MAX_EXPERTS or not 1 <= k <= E or logits.dtype != F32
            or x.dtype != F32 or x.ndim != 2 or T == 0 or normalize not in moe_ops.NORMALIZE):
        return None
    logits, ld = ops._rows(logits)
    x, ldx = ops._rows(x)
    N, D = T * k, x.shape[1]
    chosen = cp.empty((T, k), dtype=np.int64)
    weights = cp.empty((T, k), dtype=F32)
    t = _tables(cp, T, k, E)
    rows = cp.empty((N, D), dtype=F32)
    cap = -1 if capacity is None else min(int(capacity), N)
    fn((1,), (ROUTE_BLOCK,), (logits, _i32(T), _i32(E), _i32(k), _i64(ld), _i32(normalize == "topk"), _i32(cap),
                              chosen, weights, t["expert_counts"], t["offsets"], t["slot"], t["row_of_choice"],
                              t["expert_of_row"], t["token_of_row"], t["weight_of_row"], t["num_rows"], x, rows,
                              _i32(D), _i64(ldx), _i64(D)))
    routing = _routing(ops, t, T, k)
    return chosen, weights, routing, rows[:routing.num_rows]


def _tables(cp, T: int, K: int, E: int) -> dict:
    """Device buffers for moe_route's outputs (row tables at their upper bound N = T * K)."""
    N = T * K
    i64 = np.int64
    return {"expert_counts": cp.empty(E, dtype=i64), "offsets": cp.empty(E + 1, dtype=i64),
            "slot": cp.empty((T, K), dtype=i64), "row_of_choice": cp.empty((T, K), dtype=i64),
            "expert_of_row": cp.empty(N, dtype=i64), "token_of_row": cp.empty(N, dtype=i64),
            "weight_of_row": cp.empty(N, dtype=F32), "num_rows": cp.empty(1, dtype=i64)}


def _routing(ops, t: dict, T: int, K: int) -> DeviceRouting:
    expert_counts = ops.to_host(t["expert_counts"])                                  # the one copy: [E] int64
    R = int(expert_counts.sum())
    return DeviceRouting(expert_of_row=t["expert_of_row"][:R], token_of_row=t["token_of_row"][:R],
                         weight_of_row=t["weight_of_row"][:R], expert_counts=expert_counts, slot=t["slot"],
                         row_of_choice=t["row_of_choice"], num_rows_d=t["num_rows"])
