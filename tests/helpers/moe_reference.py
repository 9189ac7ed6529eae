"""References for the MoE gating and dispatch ops (a helper for tests and benchmarks, not a test file).

- `einsum_gating` / `einsum_moe`: the one-hot einsum formulation of GShard / DeepSpeed (`top1gating`,
  `MOELayer.forward`): a dispatch mask and combine weights [T, E, C], dispatched = einsum("tec,td->ecd"),
  combine = einsum("tec,ecd->td"). Cost O(T*E*C*D): the slow path the table/scan ops replace.
- `moe_loop`: the straightforward dense-math reference: loops over tokens and experts, float64.
- `table_moe`: the same layer composed from hpcinfer.backend.moe_ops (gating -> route -> permute -> experts ->
  unpermute), the path the model takes on one rank.

All three compute the MoE branch only (no residual); `expert_fn(e, x_e [n, D]) -> [n, D]` must treat rows
independently (an FFN does), since the einsum path also feeds it the C - n zero rows of unused capacity.

Capacity semantics, shared by all three: the pairs (token, choice) are visited in token-major order; a pair's
slot is the number of earlier pairs sent to the same expert; pairs with slot >= capacity are dropped.
capacity=None means no limit (C = T in the einsum path: top-k experts are distinct, so no expert gets more than T).
For K=1 this is exactly DeepSpeed's top1gating without random token selection. (GShard's top2gating instead gives
every first choice priority over every second choice; for K=2 the two orders differ only when tokens are dropped.)

Shape legend: T=tokens, D=hidden, E=experts, K=top-k, C=capacity.
"""

from __future__ import annotations

import math

import numpy as np

from hpcinfer.backend import moe_ops

F32 = np.float32


# ---- the one-hot einsum formulation (GShard / DeepSpeed) ---------------------------------------------------------
def softmax32(logits: np.ndarray) -> np.ndarray:
    """Row softmax in float32 (as DeepSpeed's F.softmax(logits, dim=1) and transformers' dtype=torch.float)."""
    z = logits.astype(F32) - logits.astype(F32).max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def einsum_gating(logits: np.ndarray, k: int, normalize: str, capacity: int | None):
    """logits [T, E] -> (combine [T, E, C] float32, dispatch [T, E, C] bool), by one-hot masks and einsums."""
    tokens, experts = logits.shape
    capacity = tokens if capacity is None else capacity
    gates = softmax32(logits)                                              # [T, E]
    masks, remaining = [], gates.copy()
    for _ in range(k):                                                     # GShard top-2: argmax, mask it, argmax
        mask = np.eye(experts, dtype=F32)[np.argmax(remaining, axis=1)]    # [T, E] one-hot
        masks.append(mask)
        remaining = np.where(mask > 0, -np.inf, remaining).astype(F32)
    mask = np.stack(masks, axis=1)                                         # [T, K, E]
    gate = np.einsum("te,tke->tk", gates, mask)                            # [T, K] gate of each chosen expert
    if normalize == "topk":
        gate = gate / gate.sum(axis=1, keepdims=True)
    # token-major scan over the one-hot pairs: the location of each pair in its expert's buffer
    locations = np.cumsum(mask.reshape(tokens * k, experts), axis=0).reshape(tokens, k, experts) - 1   # [T, K, E]
    mask = mask * (locations < capacity)                                   # drop pairs over capacity
    location = np.einsum("tke,tke->tk", locations, mask).astype(np.int64)  # [T, K] (0 where dropped)
    combine = np.zeros((tokens, experts, capacity), dtype=F32)
    dispatch = np.zeros((tokens, experts, capacity), dtype=bool)
    for choice in range(k):
        location_sc = np.eye(capacity, dtype=F32)[location[:, choice]] if capacity > 0 \
            else np.zeros((tokens, 0), F32)                                # [T, C] one-hot slot
        kept_se = mask[:, choice]                                          # [T, E]
        combine += np.einsum("te,tc->tec", gate[:, choice, None] * kept_se, location_sc)
        dispatch |= np.einsum("te,tc->tec", kept_se, location_sc) > 0
    return combine, dispatch


def einsum_moe(x, gate_w, expert_fn, k: int, normalize: str, capacity: int | None) -> np.ndarray:
    """x [T, D], gate_w [E, D] -> MoE branch output [T, D] float32 by the one-hot einsum dispatch and combine."""
    logits = x @ gate_w.T                                                  # [T, E]
    combine, dispatch = einsum_gating(logits, k, normalize, capacity)      # [T, E, C]
    dispatched = np.einsum("tec,td->ecd", dispatch.astype(x.dtype), x, optimize=True)    # [E, C, D]
    expert_out = np.stack([expert_fn(e, dispatched[e]) for e in range(gate_w.shape[0])]) if dispatched.size \
        else np.zeros_like(dispatched)                                     # [E, C, D]
    return np.einsum("tec,ecd->td", combine, expert_out.astype(F32, copy=False), optimize=True)


# ---- the table / scan path, composed from moe_ops -----------------------------------------------------------------
def run_experts(rows: np.ndarray, routing: moe_ops.Routing, expert_fn) -> np.ndarray:
    """rows [R, D] grouped by expert -> expert outputs [R, D]; experts with no rows are not called."""
    offsets = moe_ops.expert_segments(routing.expert_counts)
    out = np.empty_like(rows)
    for e in np.flatnonzero(routing.expert_counts):
        out[offsets[e]:offsets[e + 1]] = expert_fn(int(e), rows[offsets[e]:offsets[e + 1]])
    return out


def table_moe(x, gate_w, expert_fn, k: int, normalize: str, capacity: int | None, return_routing: bool = False):
    """x [T, D], gate_w [E, D] -> MoE branch output [T, D] float32: gating -> route -> permute -> experts ->
    unpermute."""
    logits = x @ gate_w.T                                                  # [T, E]
    experts, weights = moe_ops.top_k_gating(logits, k, normalize)          # [T, K]
    routing = moe_ops.route(experts, weights, gate_w.shape[0], capacity)
    rows = moe_ops.permute(x, routing)                                     # [R, D]
    out = moe_ops.unpermute(run_experts(rows, routing, expert_fn), routing, x.shape[0])
    return (out, routing) if return_routing else out


# ---- the plain-loop reference ------------------------------------------------------------------------------------
def moe_loop(x, gate_w, expert_fn, k: int, normalize: str, capacity: int | None) -> np.ndarray:
    """x [T, D], gate_w [E, D] -> MoE branch output [T, D] float64, by loops over tokens and experts."""
    x = np.asarray(x, dtype=np.float64)
    gate_w = np.asarray(gate_w, dtype=np.float64)
    tokens, experts = x.shape[0], gate_w.shape[0]
    choices = []                                                           # per token: [(expert, weight)] * K
    for t in range(tokens):
        logits = [float(x[t] @ gate_w[e]) for e in range(experts)]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        probs = [v / sum(exps) for v in exps]
        best = sorted(range(experts), key=lambda e: (-probs[e], e))[:k]   # decreasing probability, lower index
        total = sum(probs[e] for e in best) if normalize == "topk" else 1.0
        choices.append([(e, probs[e] / total) for e in best])

    sent = [0] * experts                                                   # pairs sent to each expert so far
    kept = [[] for _ in range(experts)]                                    # per expert: [(token, weight)]
    for t in range(tokens):                                                # earlier tokens keep their place
        for e, w in choices[t]:
            if capacity is None or sent[e] < capacity:
                kept[e].append((t, w))
            sent[e] += 1

    out = np.zeros_like(x)
    for e in range(experts):
        if not kept[e]:
            continue
        y = expert_fn(e, x[[t for t, _ in kept[e]]])
        for i, (t, w) in enumerate(kept[e]):
            out[t] += w * y[i]
    return out
