"""MoE gating and dispatch (hpcinfer.backend.moe_ops) against torch, the one-hot einsum formulation of GShard /
DeepSpeed and a plain-loop float64 reference (tests/helpers/moe_reference.py), including tokens dropped at capacity.

Shape legend: T=tokens, D=hidden, E=experts, K=top-k, R=routed rows, C=capacity.
"""

import tracemalloc

import numpy as np
import pytest
import torch

from hpcinfer.backend import moe_ops
from moe_reference import einsum_gating, einsum_moe, moe_loop, run_experts, table_moe

D = 16


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ffn_experts(rng, experts, hidden):
    """A random row-wise expert per e: tanh(x @ W_e + b_e) (the bias makes the einsum path's padding rows
    non-zero, which its combine weights must then ignore)."""
    w = randn(rng, experts, hidden, hidden, scale=hidden ** -0.5)
    b = randn(rng, experts, hidden)
    return lambda e, x_e: np.tanh(x_e @ w[e] + b[e])


def scaled_identity(e, x_e):
    return x_e * (e + 1)


def identity(e, x_e):
    return x_e


def layer(rng, tokens, experts, hidden=D):
    """x [T, D] and gate_w [E, D] with logits of spread ~2, so the top-k is well separated from the rest."""
    return randn(rng, tokens, hidden), randn(rng, experts, hidden, scale=2 / hidden ** 0.5)


# ---- gating ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, experts, k", [(1, 2, 1), (7, 8, 2), (64, 16, 2), (33, 128, 1), (5, 8, 8)])
@pytest.mark.parametrize("normalize", ["topk", "none"])
def test_top_k_gating_matches_torch_softmax_topk(tokens, experts, k, normalize):
    logits = randn(np.random.default_rng(tokens * experts + k), tokens, experts, scale=3)
    probs = torch.softmax(torch.from_numpy(logits), dim=-1, dtype=torch.float)
    expect_w, expect_e = torch.topk(probs, k, dim=-1)
    if normalize == "topk":                                 # transformers' MixtralSparseMoeBlock
        expect_w = expect_w / expect_w.sum(dim=-1, keepdim=True)
    chosen, weights = moe_ops.top_k_gating(logits, k, normalize)
    assert chosen.dtype == np.int64 and weights.dtype == np.float32 and chosen.shape == weights.shape == (tokens, k)
    np.testing.assert_array_equal(chosen, expect_e.numpy())
    np.testing.assert_allclose(weights, expect_w.numpy(), rtol=1e-6, atol=1e-7)
    if normalize == "topk":
        np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=1e-6)


def test_top_k_gating_breaks_ties_by_lower_expert_and_orders_by_probability():
    logits = np.array([[0, 0, 0, 0], [1, 3, 3, 0], [5, -1, 2, 5]], dtype=np.float32)
    chosen, weights = moe_ops.top_k_gating(logits, 2, "topk")
    assert chosen.tolist() == [[0, 1], [1, 2], [0, 3]]
    np.testing.assert_allclose(weights, 0.5)
    chosen, weights = moe_ops.top_k_gating(logits, 3, "none")
    assert chosen.tolist() == [[0, 1, 2], [1, 2, 0], [0, 3, 2]]
    np.testing.assert_allclose(weights[0], 0.25)
    assert np.all(np.diff(weights, axis=1) <= 0)            # decreasing probability


@pytest.mark.parametrize("k, normalize, words", [(0, "topk", "top-k = 0"), (5, "topk", "top-k = 5"),
                                                  (1, "softmax", "normalize")])
def test_top_k_gating_rejects_bad_arguments(k, normalize, words):
    with pytest.raises(ValueError, match=words):
        moe_ops.top_k_gating(np.zeros((3, 4), np.float32), k, normalize)


@pytest.mark.parametrize("tokens, experts, factor, minimum", [(64, 8, 1.0, 4), (7, 2, 1.25, 1), (3, 16, 1.0, 4),
                                                               (512, 128, 1.25, 4), (100, 3, 2.0, 0), (0, 4, 1.0, 0)])
def test_capacity_for_is_deepspeeds_formula(tokens, experts, factor, minimum):
    expect = int(torch.ceil(torch.tensor(tokens / experts * factor)).item())     # deepspeed.moe.sharded_moe._capacity
    assert moe_ops.capacity_for(tokens, experts, factor, minimum) == max(expect, minimum)


def test_capacity_factor_zero_or_less_means_no_limit():
    assert moe_ops.capacity_for(37, 8, 0.0, 4) == 37
    assert moe_ops.capacity_for(37, 8, -1.0, 4) == 37


# ---- routing tables ----------------------------------------------------------------------------------------------
def slots_by_counting(experts, capacity):
    """The slot rule in plain Python: the number of earlier (token, choice) pairs sent to the same expert."""
    sent, slot = {}, np.empty(experts.shape, np.int64)
    for t in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            slot[t, j] = sent.get(e, 0)
            sent[e] = slot[t, j] + 1
    if capacity is not None:
        slot[slot >= capacity] = -1
    return slot


@pytest.mark.parametrize("capacity", [None, 0, 1, 3, 10])
def test_route_slot_table_is_the_token_major_cumsum(capacity):
    rng = np.random.default_rng(1)
    tokens, experts, k = 40, 6, 2
    chosen, weights = moe_ops.top_k_gating(randn(rng, tokens, experts, scale=2), k, "topk")
    routing = moe_ops.route(chosen, weights, experts, capacity)
    np.testing.assert_array_equal(routing.slot, slots_by_counting(chosen, capacity))
    # the same slots as GShard's one-hot scan: locations = cumsum(one_hot, axis=0) - 1, read at the chosen expert
    one_hot = np.eye(experts, dtype=np.int64)[chosen.reshape(-1)]                   # [T*K, E]
    locations = (np.cumsum(one_hot, axis=0) - 1)[np.arange(tokens * k), chosen.reshape(-1)].reshape(tokens, k)
    if capacity is not None:
        locations = np.where(locations < capacity, locations, -1)
    np.testing.assert_array_equal(routing.slot, locations)


@pytest.mark.parametrize("capacity", [None, 2])
def test_route_rows_are_sorted_by_expert_token_choice_and_agree_with_the_slot_table(capacity):
    rng = np.random.default_rng(2)
    tokens, experts, k = 30, 5, 2
    chosen, weights = moe_ops.top_k_gating(randn(rng, tokens, experts, scale=2), k, "topk")
    r = moe_ops.route(chosen, weights, experts, capacity)
    kept = np.argwhere(r.slot >= 0)                                       # (token, choice) pairs, token-major
    kept = kept[np.lexsort((kept[:, 1], kept[:, 0], chosen[kept[:, 0], kept[:, 1]]))]   # by expert, token, choice
    np.testing.assert_array_equal(r.token_of_row, kept[:, 0])
    np.testing.assert_array_equal(r.expert_of_row, chosen[kept[:, 0], kept[:, 1]])
    np.testing.assert_array_equal(r.weight_of_row, weights[kept[:, 0], kept[:, 1]])
    np.testing.assert_array_equal(r.row_of_choice[kept[:, 0], kept[:, 1]], np.arange(len(kept)))
    assert np.all(r.row_of_choice[r.slot < 0] == -1)
    np.testing.assert_array_equal(r.expert_counts, np.bincount(r.expert_of_row, minlength=experts))
    offsets = moe_ops.expert_segments(r.expert_counts)
    assert offsets[0] == 0 and offsets[-1] == r.num_rows == len(kept)
    # a row's offset inside its expert's segment is its slot
    np.testing.assert_array_equal(np.arange(r.num_rows) - offsets[r.expert_of_row], r.slot[kept[:, 0], kept[:, 1]])
    for name in ("expert_of_row", "token_of_row", "expert_counts", "slot", "row_of_choice"):
        assert getattr(r, name).dtype == np.int64, name
    assert r.weight_of_row.dtype == np.float32


def test_route_rejects_bad_input():
    chosen, weights = np.array([[0, 4]]), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        moe_ops.route(chosen, weights, 4, None)
    with pytest.raises(ValueError, match="capacity"):
        moe_ops.route(chosen, weights, 5, -1)
    with pytest.raises(ValueError, match="both be"):
        moe_ops.route(chosen, weights[:, :1], 5, None)
    routing = moe_ops.route(chosen, weights, 5, None)
    with pytest.raises(ValueError, match="tokens = 2"):
        moe_ops.unpermute(np.zeros((2, 3), np.float32), routing, 2)


def test_expert_segments():
    assert moe_ops.expert_segments(np.array([2, 0, 3, 0])).tolist() == [0, 2, 2, 5, 5]
    assert moe_ops.expert_segments(np.zeros(0, np.int64)).tolist() == [0]


# ---- the MoE layer: tables/scan against the one-hot einsum and the plain loops -------------------------------------
def max_expert_load(x, gate_w, k, normalize):
    chosen, _ = moe_ops.top_k_gating(x @ gate_w.T, k, normalize)
    return int(np.bincount(chosen.reshape(-1), minlength=gate_w.shape[0]).max())


@pytest.mark.parametrize("expert_kind", ["ffn", "scaled_identity"])
@pytest.mark.parametrize("capacity_kind", ["none", "tight", "exact"])
@pytest.mark.parametrize("normalize", ["topk", "none"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("experts", [2, 8, 16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_moe_layer_matches_einsum_and_loop_references(tokens, experts, k, normalize, capacity_kind, expert_kind):
    rng = np.random.default_rng([tokens, experts, k])
    x, gate_w = layer(rng, tokens, experts)
    expert_fn = ffn_experts(rng, experts, D) if expert_kind == "ffn" else scaled_identity
    load = max_expert_load(x, gate_w, k, normalize)
    capacity = {"none": None, "tight": load - 1, "exact": load}[capacity_kind]

    out, routing = table_moe(x, gate_w, expert_fn, k, normalize, capacity, return_routing=True)
    assert out.shape == (tokens, D) and out.dtype == np.float32
    if capacity_kind == "tight":
        assert routing.dropped.any()                     # the busiest expert turned at least one pair away
        assert routing.expert_counts.max() == capacity
    else:
        assert not routing.dropped.any() and routing.num_rows == tokens * k

    np.testing.assert_allclose(out, einsum_moe(x, gate_w, expert_fn, k, normalize, capacity), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, moe_loop(x, gate_w, expert_fn, k, normalize, capacity), rtol=1e-4, atol=2e-5)
    if capacity_kind == "exact":                          # a capacity nobody reaches changes nothing, bit for bit
        np.testing.assert_array_equal(out, table_moe(x, gate_w, expert_fn, k, normalize, None))


def test_einsum_reference_dispatch_and_combine_agree_with_the_tables():
    """The [T, E, C] tensors of the one-hot formulation hold exactly the routing tables' (token, expert, slot)."""
    rng = np.random.default_rng(3)
    tokens, experts, k, capacity = 50, 8, 2, 9
    logits = randn(rng, tokens, experts, scale=2)
    combine, dispatch = einsum_gating(logits, k, "topk", capacity)
    chosen, weights = moe_ops.top_k_gating(logits, k, "topk")
    r = moe_ops.route(chosen, weights, experts, capacity)
    slot_of_row = np.arange(r.num_rows) - moe_ops.expert_segments(r.expert_counts)[r.expert_of_row]
    expect = np.zeros((tokens, experts, capacity), np.float32)
    expect[r.token_of_row, r.expert_of_row, slot_of_row] = r.weight_of_row
    np.testing.assert_array_equal(dispatch, expect > 0)
    np.testing.assert_allclose(combine, expect, rtol=1e-6)


def test_identity_experts_return_each_token_times_its_kept_weight():
    rng = np.random.default_rng(4)
    tokens, experts = 64, 8
    x, gate_w = layer(rng, tokens, experts)
    out, routing = table_moe(x, gate_w, identity, 2, "topk", None, return_routing=True)
    np.testing.assert_allclose(out, x, rtol=1e-6, atol=1e-6)       # renormalized weights sum to 1
    out, routing = table_moe(x, gate_w, identity, 2, "topk", 10, return_routing=True)
    chosen, weights = moe_ops.top_k_gating(x @ gate_w.T, 2, "topk")
    kept_weight = np.where(routing.dropped, 0, weights).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out, x * kept_weight, rtol=1e-6, atol=1e-6)


def test_dropped_tokens_produce_zero_moe_output():
    """Top-1 with a small capacity: a token turned away by its expert gets exactly zero from the MoE branch (the
    layer's residual carries it), and every kept token is untouched by the drops."""
    rng = np.random.default_rng(5)
    tokens, experts = 64, 4
    x, gate_w = layer(rng, tokens, experts)
    expert_fn = ffn_experts(rng, experts, D)
    capacity = moe_ops.capacity_for(tokens, experts, 0.5, 1)       # 8 of the ~16 each expert gets
    out, routing = table_moe(x, gate_w, expert_fn, 1, "none", capacity, return_routing=True)
    gone = routing.dropped[:, 0]
    assert gone.sum() >= tokens // 4
    assert np.all(out[gone] == 0)
    full = table_moe(x, gate_w, expert_fn, 1, "none", None)
    # Untouched up to rounding: an expert's matmul over fewer rows may take another BLAS kernel path (seen in CI:
    # 30 of 512 values 1 ulp apart), so equal within a few float32 ulps, not bit for bit.
    np.testing.assert_allclose(out[~gone], full[~gone], rtol=4e-7, atol=1e-7)
    kept_tokens = routing.token_of_row[moe_ops.expert_segments(routing.expert_counts)[:-1]]   # first of each expert
    assert np.all(routing.slot[kept_tokens, 0] == 0)                  # the earliest tokens keep their place
    np.testing.assert_allclose(out, einsum_moe(x, gate_w, expert_fn, 1, "none", capacity), rtol=1e-6, atol=1e-7)


def test_capacity_zero_drops_everything_and_no_tokens_routes_nothing():
    rng = np.random.default_rng(6)
    x, gate_w = layer(rng, 5, 4)
    out, routing = table_moe(x, gate_w, scaled_identity, 2, "topk", 0, return_routing=True)
    assert routing.num_rows == 0 and routing.dropped.all() and np.all(out == 0)
    np.testing.assert_array_equal(out, einsum_moe(x, gate_w, scaled_identity, 2, "topk", 0))
    empty = np.zeros((0, D), np.float32)
    out, routing = table_moe(empty, gate_w, scaled_identity, 2, "topk", None, return_routing=True)
    assert out.shape == (0, D) and routing.num_rows == 0 and routing.expert_counts.tolist() == [0, 0, 0, 0]


def test_an_expert_with_no_tokens_gets_an_empty_segment_and_is_never_called():
    rng = np.random.default_rng(7)
    tokens, experts, idle = 32, 8, [2, 5]
    x, gate = layer(rng, tokens, experts)
    x[:, 0] = 1                                                       # a constant feature: a bias on the logits
    gate[idle] = 0
    gate[idle, 0] = -100                                              # these two experts always score -100
    expert_fn = ffn_experts(rng, experts, D)
    calls = []

    def counting(e, x_e):
        calls.append(e)
        return expert_fn(e, x_e)

    out, routing = table_moe(x, gate, counting, 2, "topk", None, return_routing=True)
    assert routing.expert_counts[idle].tolist() == [0, 0]
    offsets = moe_ops.expert_segments(routing.expert_counts)
    assert all(offsets[e] == offsets[e + 1] for e in idle)
    assert not set(calls) & set(idle) and len(calls) == len(set(calls))
    np.testing.assert_allclose(out, einsum_moe(x, gate, expert_fn, 2, "topk", None), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, moe_loop(x, gate, expert_fn, 2, "topk", None), rtol=1e-4, atol=2e-5)


def test_deepspeed_top1_with_capacity_factor_matches_the_references():
    """DeepSpeed-MoE GPT gating: top-1, raw softmax gate, capacity = ceil(T / E * 1.0) with min_capacity 4."""
    rng = np.random.default_rng(8)
    tokens, experts = 64, 8
    x, gate_w = layer(rng, tokens, experts)
    expert_fn = ffn_experts(rng, experts, D)
    capacity = moe_ops.capacity_for(tokens, experts, 1.0, 4)
    out, routing = table_moe(x, gate_w, expert_fn, 1, "none", capacity, return_routing=True)
    assert capacity == 8 and routing.dropped.any()
    np.testing.assert_allclose(out, einsum_moe(x, gate_w, expert_fn, 1, "none", capacity), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, moe_loop(x, gate_w, expert_fn, 1, "none", capacity), rtol=1e-4, atol=2e-5)


def test_run_experts_hands_each_expert_exactly_its_rows():
    rng = np.random.default_rng(9)
    x, gate_w = layer(rng, 20, 4)
    chosen, weights = moe_ops.top_k_gating(x @ gate_w.T, 2, "topk")
    routing = moe_ops.route(chosen, weights, 4, None)
    rows = moe_ops.permute(x, routing)
    np.testing.assert_array_equal(rows, x[routing.token_of_row])
    seen = {}
    run_experts(rows, routing, lambda e, x_e: seen.setdefault(e, x_e.copy()))
    for e, x_e in seen.items():
        np.testing.assert_array_equal(x_e, x[np.flatnonzero((chosen == e).any(axis=1))])


# ---- the cost claim ----------------------------------------------------------------------------------------------
def traced_peak(fn):
    """Peak bytes allocated while fn runs (NumPy reports its array buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def test_dispatch_never_allocates_tokens_x_experts_x_capacity():
    """route + permute + unpermute at T=512, E=128, D=64, K=2 with no capacity limit (C = T in the one-hot
    formulation, whose dispatch mask alone is T*E*C*4 = 128 MiB): the peak stays a small multiple of T*K*D."""
    rng = np.random.default_rng(10)
    tokens, experts, hidden, k = 512, 128, 64, 2
    x = randn(rng, tokens, hidden)
    logits = randn(rng, tokens, experts)
    chosen, weights = moe_ops.top_k_gating(logits, k, "topk")
    tkd = tokens * k * hidden * 4
    tec = tokens * experts * tokens * 4

    def dispatch():
        routing = moe_ops.route(chosen, weights, experts, None)
        rows = moe_ops.permute(x, routing)                                  # identity experts
        return moe_ops.unpermute(rows, routing, tokens)

    peak, out = traced_peak(dispatch)
    np.testing.assert_allclose(out, x, rtol=1e-6, atol=1e-6)
    assert tkd <= peak <= 4 * tkd, (peak, tkd)          # rows [R, D], out [T, D], one [T, D] temporary, indices
    assert peak < tec / 100, (peak, tec)
    # gating itself is O(T*E): the softmax and its masked copy
    peak, _ = traced_peak(lambda: moe_ops.top_k_gating(logits, k, "topk"))
    assert peak <= 4 * tokens * experts * 4, peak
