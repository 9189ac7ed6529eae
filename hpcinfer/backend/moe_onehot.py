"""The one-hot einsum formulation of MoE gating, dispatch and combine (GShard / DeepSpeed `top1gating` and
`MOELayer.forward`): `[moe] dispatch = "one-hot"`, kept as the naive baseline of `hpcinfer bench` (docs/moe.md).

Gating makes a one-hot dispatch mask and the combine weights, both [T, E, C]; the expert inputs are
einsum("tec,td->ecd") and the layer output einsum("tec,ecd->td"); every expert runs on all C rows of its buffer,
the unused ones zeros. Cost O(T*E*C*D) where the indexed path (backend/moe_ops.py) costs O(T*K*D). The choices,
gate weights and capacity rules are those of moe_ops (and tests/helpers/moe_reference.py): softmax over E in float32, k
argmax passes (lower expert first on ties), topk renormalization or none, a token-major scan for each pair's slot,
pairs with slot >= capacity dropped (capacity None: C = T, nothing is). So both paths give the same tokens.

Array code of the ops' array module (`ops.xp`: numpy or cupy); the experts and the all-to-all are the
Dispatcher's (parallel/moe_dispatch.py), fed the [E * C, D] buffer as rows grouped by expert.

Shape legend: T=tokens, D=hidden, E=experts, K=top-k, C=capacity (rows an expert's buffer holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class OneHotGating:
    combine: object      # [T, E, C] float32: gate weight of token t at slot c of expert e (0 elsewhere)
    dispatch: object     # [T, E, C] float32 one-hot: 1 where token t sits in slot c of expert e

    @property
    def capacity(self) -> int:
        return int(self.combine.shape[2])

    @property
    def num_experts(self) -> int:
        return int(self.combine.shape[1])

    @property
    def kept_choices(self):
        """[T] float32: how many of each token's k choices were kept (k minus the ones over capacity)."""
        return self.dispatch.sum(axis=(1, 2))


def softmax32(xp, logits):
    """Row softmax in float32, [T, E] -> [T, E]: the arithmetic of moe_ops._softmax (the same probabilities)."""
    probs = logits.astype(F32)                                          # a copy, float32
    probs -= probs.max(axis=1, keepdims=True)
    xp.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs


def choice_masks(xp, probs, k: int):
    """probs [T, E] -> one-hot masks [T, K, E] of the k chosen experts, by decreasing probability (GShard top-2:
    argmax, mask the winner out, argmax again; the first maximum wins a tie)."""
    tokens, experts = probs.shape
    eye = xp.eye(experts, dtype=F32)
    remaining, masks = probs.copy(), []
    for _ in range(k):
        mask = eye[xp.argmax(remaining, axis=1)]                        # [T, E] one-hot
        masks.append(mask)
        remaining = xp.where(mask > 0, F32(-np.inf), remaining)
    return xp.stack(masks, axis=1) if masks else xp.zeros((tokens, 0, experts), F32)


def onehot_gating(xp, logits, k: int, normalize: str, capacity: int | None) -> OneHotGating:
    """logits [T, E] -> the combine weights and dispatch mask [T, E, C] (C = capacity, or T when None)."""
    if logits.ndim != 2:
        raise ValueError(f"onehot_gating: logits must be [tokens, experts], got shape {logits.shape}")
    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"onehot_gating: top-k = {k} must be between 1 and the number of experts ({experts})")
    if normalize not in ("topk", "none"):
        raise ValueError(f"onehot_gating: normalize = {normalize!r}, expected one of ('topk', 'none')")
    cap = tokens if capacity is None else int(capacity)
    probs = softmax32(xp, logits)                                       # [T, E]
    mask = choice_masks(xp, probs, k)                                   # [T, K, E]
    gate = xp.einsum("te,tke->tk", probs, mask)                         # [T, K] gate of each chosen expert
    if normalize == "topk":
        gate = gate / gate.sum(axis=1, keepdims=True)
    # token-major scan over the (token, choice) pairs: each pair's place in its expert's buffer
    pairs = mask.reshape(tokens * k, experts).astype(np.int64)
    locations = (xp.cumsum(pairs, axis=0) - 1).reshape(tokens, k, experts)        # [T, K, E]
    kept = mask * (locations < cap)                                     # [T, K, E] drop pairs over capacity
    slot = (locations * kept.astype(np.int64)).sum(axis=2)             # [T, K] (0 where dropped)
    eye_c = xp.eye(cap, dtype=F32)                                      # [C, C]
    combine = xp.zeros((tokens, experts, cap), dtype=F32)
    dispatch = xp.zeros((tokens, experts, cap), dtype=F32)
    for choice in range(k if cap > 0 else 0):                           # top-k experts differ: no overlap
        slot_tc = eye_c[slot[:, choice]]                                # [T, C] one-hot slot
        kept_te = kept[:, choice]                                       # [T, E]
        combine += xp.einsum("te,tc->tec", gate[:, choice, None] * kept_te, slot_tc)
        dispatch += xp.einsum("te,tc->tec", kept_te, slot_tc)
    return OneHotGating(combine, dispatch)


def dispatch_tokens(xp, gating: OneHotGating, x):
    """x [T, D] -> the experts' input buffers [E, C, D] (zero rows where a slot is unused)."""
    return xp.einsum("tec,td->ecd", gating.dispatch, x.astype(F32, copy=False))


def combine_outputs(xp, gating: OneHotGating, expert_out):
    """expert outputs [E, C, D] -> [T, D] = sum over (e, c) of combine weight * output row."""
    return xp.einsum("tec,ecd->td", gating.combine, expert_out.astype(F32, copy=False))


def onehot_moe(ops, dispatcher, experts, logits, x, k: int, normalize: str, capacity: int | None):
    """The MoE branch by the one-hot formulation: x [T, D], logits [T, E] -> [T, D]. The [E, C, D] buffer goes
    through the Dispatcher as E * C rows grouped by expert (C per expert, empty slots included), so expert
    parallelism and every all-to-all variant work as for the indexed path."""
    xp = ops.xp
    gating = onehot_gating(xp, logits, k, normalize, capacity)          # [T, E, C]
    buffers = dispatch_tokens(xp, gating, x)                            # [E, C, D]
    experts_n, cap, hidden = buffers.shape
    rows = buffers.reshape(experts_n * cap, hidden)                     # [E * C, D]
    expert_of_row = xp.repeat(xp.arange(experts_n), cap)                # [E * C]
    counts = np.full(experts_n, cap, dtype=np.int64)                    # host [E]
    out = dispatcher.run_experts(rows, expert_of_row, counts, experts)  # [E * C, D]
    return combine_outputs(xp, gating, out.reshape(experts_n, cap, hidden))
