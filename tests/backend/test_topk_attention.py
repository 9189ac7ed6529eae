"""Top-k sparse decode attention (FlexGen; backend/kv_attention.py) against a float64 reference, over a float and a
quantized KV cache; topk = 1 is dense attention; prefill stays dense."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.kv_attention import keep_counts
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.quant.kv import QuantizedKV, kv_format

OPS = NumpyOps()
H, HKV, HD, NSLOTS, LMAX = 6, 2, 16, 4, 40
SLOTS, LENGTHS = [3, 0, 2], [31, 7, 18]             # cached positions before the decode step


def _filled_caches(fmt=None, seed=0):
    """Caches whose slots hold LENGTHS[s] random rows, and their float64 contents (as the cache stores them)."""
    rng = np.random.default_rng(seed)
    shape = (NSLOTS, HKV, LMAX, HD)
    ck, cv = ((np.zeros(shape, np.float32), np.zeros(shape, np.float32)) if fmt is None else
              (QuantizedKV.zeros(OPS, fmt, shape), QuantizedKV.zeros(OPS, fmt, shape)))
    for slot, n in zip(SLOTS, LENGTHS):
        ck[slot, :, :n] = rng.normal(size=(HKV, n, HD)).astype(np.float32) * 2
        cv[slot, :, :n] = rng.normal(size=(HKV, n, HD)).astype(np.float32)
    read = (lambda c: c.astype(np.float64)) if fmt is None else (lambda c: c.read(slice(None)).astype(np.float64))
    return ck, cv, read(ck), read(cv)


def _decode_inputs(seed=1):
    rng = np.random.default_rng(seed)
    S = len(SLOTS)
    return (rng.normal(size=(S, H, HD)).astype(np.float32) * 2, rng.normal(size=(S, HKV, HD)).astype(np.float32),
            rng.normal(size=(S, HKV, HD)).astype(np.float32))


def _reference(q, k, v, keys, values, topk, scale):
    """float64: per sequence and query head, scores over its cached rows + its new row, keep the top
    ceil(topk * length) positions, softmax over them, weighted sum of their V rows -> [S, H*hd]."""
    out = np.zeros((len(SLOTS), H, HD))
    for s, (slot, n) in enumerate(zip(SLOTS, LENGTHS)):
        for h in range(H):
            kv = h // (H // HKV)
            K = np.concatenate([keys[slot, kv, :n], k[s, kv][None].astype(np.float64)])          # [n + 1, hd]
            V = np.concatenate([values[slot, kv, :n], v[s, kv][None].astype(np.float64)])
            scores = K @ q[s, h].astype(np.float64) * scale
            keep = np.argsort(-scores)[:int(np.ceil(topk * (n + 1)))]
            p = np.exp(scores[keep] - scores[keep].max())
            out[s, h] = (p / p.sum()) @ V[keep]
    return out.reshape(len(SLOTS), H * HD)


def test_keep_counts_round_up_and_keep_one():
    assert keep_counts([10, 11, 1, 3], 0.1).tolist() == [1, 2, 1, 1]
    assert keep_counts([100, 7], 0.25).tolist() == [25, 2]
    assert keep_counts([5, 9], 1.0).tolist() == [5, 9]


@pytest.mark.parametrize("topk", [0.1, 0.3, 0.5, 0.9])
def test_topk_matches_float64_reference(topk):
    ck, cv, keys, values = _filled_caches()
    q, k, v = _decode_inputs()
    out = OPS.attention(q, k, v, ck, cv, StepLayout.build(SLOTS, LENGTHS, [1] * 3), 0.25, topk)
    np.testing.assert_allclose(out, _reference(q, k, v, keys, values, topk, 0.25), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("topk", [0.1, 0.5])
def test_topk_over_quantized_cache_matches_float64_reference(mode, topk):
    """Cached rows as the quantized cache holds them; the step's own new row unquantized."""
    ck, cv, keys, values = _filled_caches(kv_format(mode, 8, HD))
    q, k, v = _decode_inputs()
    out = OPS.attention(q, k, v, ck, cv, StepLayout.build(SLOTS, LENGTHS, [1] * 3), 0.25, topk)
    np.testing.assert_allclose(out, _reference(q, k, v, keys, values, topk, 0.25), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", [None, kv_format("int4", 16, HD)], ids=["float", "int4"])
def test_topk_one_equals_dense(fmt):
    """topk = 1.0 is dense attention exactly (the dense code); a fraction that keeps every position runs the
    sparse code and agrees with it to float32 rounding."""
    q, k, v = _decode_inputs()
    step = StepLayout.build(SLOTS, LENGTHS, [1] * 3)
    outs = {}
    for topk in (0.0, 1.0, 0.99999):
        ck, cv, _, _ = _filled_caches(fmt)
        outs[topk] = OPS.attention(q, k, v, ck, cv, step, 0.25, topk)
    np.testing.assert_array_equal(outs[1.0], outs[0.0])
    np.testing.assert_allclose(outs[0.99999], outs[0.0], atol=1e-6)


def test_prefill_stays_dense():
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(12, h, HD)).astype(np.float32) for h in (H, HKV, HKV))
    step = StepLayout.build([1, 2], [0, 0], [5, 7])
    outs = []
    for topk in (0.0, 0.1):
        ck, cv, _, _ = _filled_caches()
        outs.append(OPS.attention(q, k, v, ck, cv, step, 0.25, topk))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_topk_changes_the_output_and_appends_the_cache():
    q, k, v = _decode_inputs()
    step = StepLayout.build(SLOTS, LENGTHS, [1] * 3)
    ck, cv, _, _ = _filled_caches()
    dense = OPS.attention(q, k, v, ck.copy(), cv.copy(), step, 0.25)
    sparse = OPS.attention(q, k, v, ck, cv, step, 0.25, 0.1)
    assert np.abs(dense - sparse).max() > 1e-3
    np.testing.assert_array_equal(ck[SLOTS, :, LENGTHS], k)
    np.testing.assert_array_equal(cv[SLOTS, :, LENGTHS], v)
