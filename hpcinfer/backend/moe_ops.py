"""NumPy reference of the MoE gating and dispatch operations (DeepSpeed Inference V-C): the spec for the kernels.

Gating makes a dense token->expert table; routing turns it into an expert->token table and each (token, choice)'s
slot inside its expert's buffer with one stable sort and one exclusive scan over the expert counts; permute and
unpermute move token rows in and out of per-expert buffers by index, applying the gate weights on the way back.
Every step costs O(T*K*D) (plus O(T*E) for the softmax over the logits): nothing here is ever [T, E, C] or
[T, E, C, D], unlike the one-hot einsum formulation of GShard / DeepSpeed (kept in tests/helpers/moe_reference.py).

Shape legend: T=tokens, D=hidden, E=experts, K=top-k, R=routed rows (kept (token, choice) pairs, R <= T*K),
C=capacity (rows an expert may take).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

F32 = np.float32
NORMALIZE = ("topk", "none")


# ---- gating ----------------------------------------------------------------------------------------------------
def top_k_gating(logits: np.ndarray, k: int, normalize: str) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> (experts [T, K] int64, weights [T, K] float32).

    Softmax over all E in float32, then the k largest probabilities, ordered by decreasing probability (ties:
    lower expert index first). normalize="topk": the k weights renormalized to sum to 1 (Mixtral, as transformers'
    MixtralSparseMoeBlock: softmax -> topk -> divide by their sum); normalize="none": the raw softmax
    probabilities (DeepSpeed / GShard top-1: the gate value of the chosen expert).
    """
    if logits.ndim != 2:
        raise ValueError(f"top_k_gating: logits must be [tokens, experts], got shape {logits.shape}")
    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"top_k_gating: top-k = {k} must be between 1 and the number of experts ({experts})")
    if normalize not in NORMALIZE:
        raise ValueError(f"top_k_gating: normalize = {normalize!r}, expected one of {NORMALIZE}")
    probs = _softmax(logits)                                             # [T, E] float32
    # k passes of a row argmax (first maximum wins: the lower index on ties), masking each winner: O(T*E*K),
    # the shape of the kernel (one warp argmax per token and choice), and exact about ties where argpartition
    # is not.
    remaining = probs.copy()
    rows = np.arange(tokens)
    chosen = np.empty((tokens, k), dtype=np.int64)                       # [T, K]
    for choice in range(k):
        chosen[:, choice] = np.argmax(remaining, axis=1)
        remaining[rows, chosen[:, choice]] = -np.inf
    weights = np.take_along_axis(probs, chosen, axis=1)                  # [T, K] float32
    if normalize == "topk":
        weights /= weights.sum(axis=1, keepdims=True)
    return chosen, weights


def capacity_for(tokens: int, experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed top-1 gating capacity: ceil(tokens / experts * capacity_factor), at least min_capacity.
    capacity_factor <= 0 means no capacity limit (returns tokens: an expert can never get more)."""
    if experts < 1 or tokens < 0 or min_capacity < 0:
        raise ValueError(f"capacity_for: need experts >= 1, tokens >= 0, min_capacity >= 0; got experts={experts}, "
                         f"tokens={tokens}, min_capacity={min_capacity}")
    if capacity_factor <= 0:
        return tokens
    return max(math.ceil(tokens / experts * capacity_factor), min_capacity)


# ---- routing tables ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Where every (token, choice) goes. Rows are the kept pairs, sorted by expert, then token, then choice, so
    expert e owns rows expert_segments(expert_counts)[e] : [e + 1], and the slot of a kept pair is its row's
    offset inside that segment."""

    expert_of_row: np.ndarray     # [R] int64 expert of each routed row, rows sorted by expert (then token, then k)
    token_of_row: np.ndarray      # [R] int64 source token of each row
    weight_of_row: np.ndarray     # [R] float32 gate weight
    expert_counts: np.ndarray     # [E] int64 rows per expert (after capacity); always on the host, where the other
                                  # tables may be device arrays (cupy_moe.DeviceRouting): the dispatcher sizes from it
    slot: np.ndarray              # [T, K] int64 position of (token, choice) inside its expert's buffer, -1 if dropped
    row_of_choice: np.ndarray     # [T, K] int64 row of (token, choice) in routing order, -1 if dropped

    @property
    def num_rows(self) -> int:
        return len(self.token_of_row)

    @property
    def num_experts(self) -> int:
        return len(self.expert_counts)

    @property
    def dropped(self) -> np.ndarray:
        """[T, K] bool: the (token, choice) pairs over capacity (they add nothing to the token's output)."""
        return self.slot < 0


def route(experts: np.ndarray, weights: np.ndarray, num_experts: int, capacity: int | None) -> Routing:
    """Dense token->expert table [T, K] -> the expert->token table and each (token, choice)'s slot.

    A pair's slot is the number of earlier (token, choice) pairs, in token-major order, sent to the same expert:
    a scan over the flattened assignments, done as a stable sort by expert (which keeps token-major order inside
    each expert) and an exclusive cumsum of the per-expert counts (where each expert's run starts). Pairs with
    slot >= capacity are dropped, so earlier tokens keep their place (DeepSpeed / GShard, without DeepSpeed's
    training-time random token selection). capacity=None: no limit.
    """
    experts = np.asarray(experts)
    weights = np.asarray(weights)
    if experts.ndim != 2 or weights.shape != experts.shape:
        raise ValueError(f"route: experts and weights must both be [tokens, k]; got {experts.shape} and "
                         f"{weights.shape}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"route: capacity must be >= 0 (or None for no limit), got {capacity}")
    tokens, k = experts.shape
    flat = experts.reshape(-1).astype(np.int64, copy=False)             # [T*K] pair i = (token i // K, choice i % K)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"route: expert ids must be in [0, {num_experts}), got {flat.min()}..{flat.max()}")

    order = np.argsort(flat, kind="stable")                             # [T*K] pairs grouped by expert, token-major
    counts = np.bincount(flat, minlength=num_experts)                   # [E] pairs per expert, before capacity
    run_start = np.cumsum(counts) - counts                              # [E] exclusive scan: start of expert's run
    sorted_slot = np.arange(flat.size) - run_start[flat[order]]         # [T*K] slot of each pair, in sorted order
    slot = np.empty(flat.size, dtype=np.int64)
    slot[order] = sorted_slot                                           # [T*K] back in token-major order

    if capacity is None:
        kept = order                                                    # [R] pair index of each row
        expert_counts = counts
    else:
        kept = order[sorted_slot < capacity]
        slot[slot >= capacity] = -1
        expert_counts = np.minimum(counts, capacity)
    row_of_choice = np.full(flat.size, -1, dtype=np.int64)
    row_of_choice[kept] = np.arange(kept.size)

    return Routing(
        expert_of_row=flat[kept],
        token_of_row=kept // k,
        weight_of_row=weights.reshape(-1)[kept].astype(F32, copy=False),
        expert_counts=expert_counts.astype(np.int64, copy=False),
        slot=slot.reshape(tokens, k),
        row_of_choice=row_of_choice.reshape(tokens, k),
    )


def gate_and_dispatch(ops, logits, x, k: int, normalize: str, num_experts: int, capacity: int | None):
    """Gating, routing and the scatter of the token rows into expert order as three Ops calls -> (routing, rows
    [R, D] grouped by expert): what Ops.gate_dispatch stands for (CupyOps fuses it into one launch for
    decode-sized steps, backend/cupy_moe.gate_dispatch)."""
    experts, weights = ops.top_k_gating(logits, k, normalize)                    # [T, K]
    routing = ops.route(experts, weights, num_experts, capacity)
    return routing, ops.permute(x, routing)                                       # [R, D]


def expert_segments(expert_counts: np.ndarray) -> np.ndarray:
    """[E] rows per expert -> [E + 1] offsets: expert e's rows are [offsets[e], offsets[e + 1])."""
    offsets = np.zeros(len(expert_counts) + 1, dtype=np.int64)
    np.cumsum(expert_counts, out=offsets[1:])
    return offsets


# ---- data movement -----------------------------------------------------------------------------------------------
def permute(x: np.ndarray, routing: Routing) -> np.ndarray:
    """x [T, D] -> rows [R, D] grouped by expert (a gather: a token with K kept choices appears K times)."""
    return x[routing.token_of_row]


def unpermute(rows: np.ndarray, routing: Routing, tokens: int) -> np.ndarray:
    """rows [R, D] (expert outputs, in routing order) -> out [T, D] = sum over a token's kept choices of
    weight * row; dropped choices add nothing (a token with every choice dropped gets zeros: only the residual
    remains).

    A gather per choice rather than a scatter-add: each token reads its own <= K rows through row_of_choice and
    sums them in choice order, so the result is deterministic and a kernel needs no atomics.
    """
    if tokens != routing.slot.shape[0]:
        raise ValueError(f"unpermute: tokens = {tokens} but the routing is for {routing.slot.shape[0]} tokens")
    if rows.shape[0] != routing.num_rows:
        raise ValueError(f"unpermute: got {rows.shape[0]} rows for a routing of {routing.num_rows}")
    out = np.zeros((tokens,) + rows.shape[1:], dtype=np.result_type(rows.dtype, F32))     # [T, D]
    for choice in range(routing.row_of_choice.shape[1]):
        row = routing.row_of_choice[:, choice]                          # [T]
        token = np.flatnonzero(row >= 0)                                # tokens whose choice was kept
        row = row[token]
        contribution = rows[row].astype(out.dtype, copy=False)         # [n, D] gather
        contribution *= routing.weight_of_row[row, None]
        if token.size == tokens:
            out += contribution                                         # no drops: every token, in order
        else:
            out[token] += contribution                                  # distinct tokens: a plain indexed add
    return out


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Row softmax in float32: [T, E] -> [T, E]."""
    probs = logits.astype(F32)                                          # a copy, float32
    probs -= probs.max(axis=1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs
