"""Each NumPy op against a plain reference (float64 formulas, torch's functional ops, or a naive loop)."""

import math
import time

import numpy as np
import pytest
import torch

from hpcinfer.backend.ops import make_ops
from hpcinfer.backend import numpy_decode
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps

ops = NumpyOps()
rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("tokens", [1, 5, 100])     # both sides of the weight-first threshold
def test_linear_matches_float64_with_and_without_bias(tokens):
    x, w, b = randn(tokens, 7), randn(3, 7), randn(3)      # w [out, in]
    np.testing.assert_allclose(ops.linear(x, w, b), x.astype(np.float64) @ w.T + b, atol=1e-5)
    np.testing.assert_allclose(ops.linear(x, w), x.astype(np.float64) @ w.T, atol=1e-5)


def test_linear_upcasts_half_precision_weights():
    x, w = randn(2, 8), randn(4, 8)
    np.testing.assert_allclose(ops.linear(x, w.astype(np.float16)), x @ w.astype(np.float16).astype(np.float32).T,
                               atol=1e-5)


def test_layer_norm_and_rms_norm_match_torch():
    x, w, b = randn(4, 16), randn(16), randn(16)
    expect = torch.nn.functional.layer_norm(torch.from_numpy(x), (16,), torch.from_numpy(w), torch.from_numpy(b),
                                            eps=1e-5).numpy()
    np.testing.assert_allclose(ops.layer_norm(x, w, b, 1e-5), expect, atol=1e-5)
    x64 = x.astype(np.float64)
    rms = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), rms, atol=1e-5)


@pytest.mark.parametrize("kind, reference", [
    ("gelu", lambda t: torch.nn.functional.gelu(t)),
    ("gelu_tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    ("relu", torch.relu),
    ("silu", torch.nn.functional.silu),
])
def test_activations_match_torch(kind, reference):
    x = randn(3, 50) * 4
    np.testing.assert_allclose(ops.activation(x, kind), reference(torch.from_numpy(x)).numpy(), atol=1e-5)


def test_gated_activation_is_act_of_first_half_times_second_half():
    gate_up = randn(3, 8)
    expect = ops.activation(gate_up[:, :4], "silu") * gate_up[:, 4:]
    np.testing.assert_allclose(ops.gated_activation(gate_up, "silu"), expect)


def test_rotary_matches_complex_rotation_of_half_split_pairs():
    T, heads, hd, rot = 5, 3, 8, 4
    x = randn(T, heads, hd)
    angles = rng.uniform(0, 6, (T, rot // 2))
    out = ops.rotary(x, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), rot)
    pairs = x[..., :rot // 2] + 1j * x[..., rot // 2:rot]           # element i pairs with i + rot/2
    rotated = pairs * np.exp(1j * angles)[:, None, :]
    np.testing.assert_allclose(out[..., :rot // 2], rotated.real, atol=1e-5)
    np.testing.assert_allclose(out[..., rot // 2:rot], rotated.imag, atol=1e-5)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])      # partial rotary leaves the rest alone


def naive_attention(q, k, v, scale):
    """q [n, H, hd], k, v [n, Hkv, hd] of one whole sequence; causal, GQA by repetition; loops, float64."""
    n, heads, hd = q.shape
    group = heads // k.shape[1]
    out = np.zeros((n, heads, hd))
    for h in range(heads):
        for i in range(n):
            s = np.array([q[i, h] @ k[j, h // group] * scale for j in range(i + 1)], dtype=np.float64)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ v[:i + 1, h // group]
    return out.reshape(n, heads * hd)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_prefill_then_decode_attention_matches_naive(heads, kv_heads):
    hd, lengths, Lmax = 8, [5, 2, 7], 9
    scale = 1 / math.sqrt(hd)
    seqs = [(randn(n + 1, heads, hd), randn(n + 1, kv_heads, hd), randn(n + 1, kv_heads, hd)) for n in lengths]
    cache_k = np.zeros((3, kv_heads, Lmax, hd), np.float32)
    cache_v = np.zeros_like(cache_k)
    # packed prefill of the first n tokens of each sequence (slots in a different order than sequences)
    slots = [2, 0, 1]
    step = StepLayout.build(slots, [0, 0, 0], lengths)
    cat = lambda i: np.concatenate([s[i][:n] for s, n in zip(seqs, lengths)])
    out = ops.attention(cat(0), cat(1), cat(2), cache_k, cache_v, step, scale)
    for s, (q, k, v), n in zip(range(3), seqs, lengths):
        a, b = step.token_range(s)
        np.testing.assert_allclose(out[a:b], naive_attention(q[:n], k[:n], v[:n], scale), atol=1e-5)
    # one decode step: token n of each sequence, batched
    step = StepLayout.build(slots, lengths, [1, 1, 1])
    last = lambda i: np.stack([s[i][n] for s, n in zip(seqs, lengths)])
    out = ops.attention(last(0), last(1), last(2), cache_k, cache_v, step, scale)
    for s, (q, k, v), n in zip(range(3), seqs, lengths):
        np.testing.assert_allclose(out[s], naive_attention(q, k, v, scale)[n], atol=1e-5)


def test_chunked_prefill_continues_from_cache():
    """A second prefill chunk on a non-empty cache attends to the earlier positions too."""
    heads, hd, n = 2, 4, 6
    q, k, v = randn(n, heads, hd), randn(n, heads, hd), randn(n, heads, hd)
    cache_k = np.zeros((1, heads, n, hd), np.float32)
    cache_v = np.zeros_like(cache_k)
    ops.attention(q[:4], k[:4], v[:4], cache_k, cache_v, StepLayout.build([0], [0], [4]), 0.5)
    out = ops.attention(q[4:], k[4:], v[4:], cache_k, cache_v, StepLayout.build([0], [4], [2]), 0.5)
    np.testing.assert_allclose(out, naive_attention(q, k, v, 0.5)[4:], atol=1e-5)


@pytest.mark.parametrize("start, n, score_block", [(0, 70, 1 << 18), (0, 70, 600), (23, 50, 900), (40, 1, 100)],
                         ids=["one-block", "blocks", "blocks-after-cache", "decode-row"])
def test_causal_attention_in_query_blocks_matches_the_whole_score_matrix(monkeypatch, start, n, score_block):
    """_causal_attention tiles the queries (SCORE_BLOCK floats of scores a block, at least 16 positions): with
    small budgets the blocks, a partial last block and the diagonal masks are exercised; every tiling gives the
    untiled reference, softmax over each row's whole causal prefix."""
    import hpcinfer.backend.numpy_ops as numpy_ops

    monkeypatch.setattr(numpy_ops, "SCORE_BLOCK", score_block)
    heads, kv_heads, hd, scale = 6, 2, 8, 0.3
    q = randn(n, heads, hd)
    k_seq, v_seq = randn(kv_heads, start + n + 5, hd), randn(kv_heads, start + n + 5, hd)   # + unread rows
    got = NumpyOps._causal_attention(q, k_seq, v_seq, start, scale)
    group = heads // kv_heads
    scores = np.einsum("nhd,hld->hnl", q.astype(np.float64) * scale, np.repeat(k_seq[:, :start + n], group, 0))
    scores[:, np.arange(start + n)[None, :] > (start + np.arange(n))[:, None]] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("hnl,hld->nhd", probs, np.repeat(v_seq[:, :start + n], group, 0)).reshape(n, heads * hd)
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("n", [1, 40, 300])
def test_causal_attention_gives_the_same_bits_on_any_share_of_kv_heads(n):
    """Tensor parallelism splits the KV heads (with their query heads) over ranks: attention over one rank's share
    must give the bits the whole computes for those heads (the query blocks do not depend on the KV heads held)."""
    heads, kv_heads, hd, start = 9, 3, 16, 7
    q = randn(n, heads, hd)
    k_seq, v_seq = randn(kv_heads, start + n, hd), randn(kv_heads, start + n, hd)
    whole = NumpyOps._causal_attention(q, k_seq, v_seq, start, 0.25).reshape(n, heads, hd)
    for h in range(kv_heads):                        # tp = 3: one KV head and its 3 query heads per rank
        share = NumpyOps._causal_attention(q[:, 3 * h:3 * h + 3], k_seq[h:h + 1], v_seq[h:h + 1], start, 0.25)
        np.testing.assert_array_equal(share.reshape(n, 3, hd), whole[:, 3 * h:3 * h + 3])


def test_decode_over_ascending_slots_with_gaps_gives_each_rows_own_bits():
    """The continuous schedule's dense slots: a decode step over ascending slots with idle ones between (2, 3, 6
    of 0..7) attends over the view of slots 2..6 (NumpyOps._decode_over_span), and gives the bits of the copy path
    (the slots gathered, then attended)."""
    S, heads, kv_heads, hd, Lmax = 3, 6, 2, 8, 12
    cache_k, cache_v = randn(8, kv_heads, Lmax, hd), randn(8, kv_heads, Lmax, hd)
    q = randn(S, heads, hd)
    slots, starts = np.array([2, 3, 6]), np.array([4, 9, 1])
    lengths, L = starts + 1, 10
    want = ops._decode_over(q, cache_k[slots, :, :L], cache_v[slots, :, :L], lengths, 0.3)
    got = ops._decode_over_span(q, cache_k, cache_v, slots, lengths, L, 0.3)
    np.testing.assert_array_equal(got, want)
    k, v = randn(S, kv_heads, hd), randn(S, kv_heads, hd)            # and through attention, which takes the span
    got = ops.attention(q, k, v, cache_k, cache_v, StepLayout.build(slots, starts, [1] * S), 0.3)
    assert np.array_equal(cache_k[slots, :, starts], k)               # the new rows appended first
    np.testing.assert_array_equal(got, ops._decode_over(q, cache_k[slots, :, :L], cache_v[slots, :, :L],
                                                        lengths, 0.3))


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_decode_attention_on_threads_gives_the_single_thread_bits(threads, monkeypatch):
    """Decode attention splits the sequences over the rank's threads (backend/numpy_decode.py): any split, also
    more threads than sequences, gives the bits of one thread, and equals softmax(q K^T / mask) V in float64.
    Repeated calls reuse the scratch buffers (a shorter step after a longer one, then a longer one again)."""
    monkeypatch.setattr(numpy_decode, "MIN_PART_BYTES", 1)                # split however small the step
    S, heads, kv_heads, hd = 5, 6, 2, 8
    one, many = NumpyOps(threads=1), NumpyOps(threads=threads)
    for L in (12, 7, 30):
        q, keys, values = randn(S, heads, hd), randn(S, kv_heads, L, hd), randn(S, kv_heads, L, hd)
        lengths = np.array([L, 1, L - 3, 2, L])[:S]
        want = one._decode_over(q, keys, values, lengths, 0.3)
        np.testing.assert_array_equal(many._decode_over(q, keys, values, lengths, 0.3), want)
        for s in range(S):                                       # against the definition, per sequence and head
            n = int(lengths[s])
            for h in range(heads):
                scores = 0.3 * keys[s, h // 3, :n].astype(np.float64) @ q[s, h]
                probs = np.exp(scores - scores.max())
                ref = (probs / probs.sum()) @ values[s, h // 3, :n]
                np.testing.assert_allclose(want[s, h * hd:(h + 1) * hd], ref, rtol=1e-5, atol=1e-6)


def test_decode_attention_splits_only_a_step_worth_a_thread(monkeypatch):
    """A step whose K/V bytes are below MIN_PART_BYTES a thread stays on the caller's thread (a hand-off costs more
    than it reads); a longer one is split."""
    two, parts = NumpyOps(threads=2), []
    rows = two.decode_attention._rows
    monkeypatch.setattr(two.decode_attention, "_rows", lambda part, *args: parts.append(part) or rows(part, *args))
    S, kv_heads, hd = 4, 2, 64
    short = numpy_decode.MIN_PART_BYTES // (2 * S * kv_heads * hd * 4)   # K + V of the step: one part's bytes
    for L, want in ((short, [0]), (2 * short, [0, 1])):
        parts.clear()
        two._decode_over(randn(S, 6, hd), randn(S, kv_heads, L, hd), randn(S, kv_heads, L, hd), np.full(S, L), 0.3)
        assert sorted(parts) == want


def test_decode_attention_raises_a_workers_error(monkeypatch):
    """An error in a worker thread's rows reaches the caller (no silent partial output)."""
    monkeypatch.setattr(numpy_decode, "MIN_PART_BYTES", 1)
    two = NumpyOps(threads=2)
    rows = two.decode_attention._rows

    def failing(part, *args):
        if part == 1:                                            # the worker's block only
            raise FloatingPointError("worker rows")
        return rows(part, *args)

    monkeypatch.setattr(two.decode_attention, "_rows", failing)
    with pytest.raises(FloatingPointError, match="worker rows"):
        two._decode_over(randn(4, 6, 8), randn(4, 2, 5, 8), randn(4, 2, 5, 8), np.full(4, 5), 0.3)


def test_embedding_gathers_rows():
    table = randn(10, 3)
    np.testing.assert_array_equal(ops.embedding(table, np.array([3, 3, 9])), table[[3, 3, 9]])


def test_step_layout_positions_and_last_tokens():
    step = StepLayout.build([0, 1], [3, 0], [2, 3])
    assert step.positions.tolist() == [3, 4, 0, 1, 2]
    assert step.last_token_index.tolist() == [1, 4]
    assert not step.is_decode and StepLayout.build([0], [5], [1]).is_decode


def test_decode_attention_waits_for_its_workers_when_the_callers_rows_fail(monkeypatch):
    """The caller's own block raising still waits for the workers' blocks: none outlives the call (their scratch
    buffers are reused by the next step)."""
    monkeypatch.setattr(numpy_decode, "MIN_PART_BYTES", 1)
    two, finished = NumpyOps(threads=2), []

    def rows(part, *args):
        if part == 0:
            raise FloatingPointError("caller rows")
        time.sleep(0.2)
        finished.append(part)

    monkeypatch.setattr(two.decode_attention, "_rows", rows)
    with pytest.raises(FloatingPointError, match="caller rows"):
        two._decode_over(randn(4, 6, 8), randn(4, 2, 5, 8), randn(4, 2, 5, 8), np.full(4, 5), 0.3)
    assert finished == [1]


def test_make_ops_gives_numpy_the_ranks_threads():
    """`[runtime] threads` reaches the NumPy backend's decode attention (runtime._compute_setup passes it); without
    it, the usable cores, as OpenBLAS's own default."""
    assert make_ops("numpy", threads=3).decode_attention.threads == 3
    assert make_ops("numpy").decode_attention.threads == numpy_decode.usable_cores()


def test_auto_without_a_driver_picks_numpy_without_importing_cupy():
    """backend = "auto" on a machine whose NVIDIA driver library does not load: NumPy, and cupy (about 1 s of
    import per rank) is never imported."""
    import ctypes
    import subprocess
    import sys

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("the NVIDIA driver's library loads here")
    except OSError:
        pass
    probe = ("import sys; from hpcinfer.backend.ops import make_ops; "
             "print(make_ops('auto').name, 'cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["numpy", "False"]
