"""Flash-decoding kernels on the CPU emulator, against NumpyOps' decode attention (the spec).

decode_attention_split (float32 / float16 cache) and decode_attention_quant_split (int8 / int4 cache) write each
chunk's partial softmax into a workspace, decode_attention_combine merges the chunks. Sequences of mixed lengths
(1: only the appended row; lengths the chunk count does not divide; fewer positions than chunks: empty chunks),
chunk counts 1, 2, a few and many, GQA groups 1, 2 and 8, head dims 64 and 128. The workspace and the output
start as NaN (an entry left unwritten fails), and every cache position past a sequence's new row is NaN in the
kernels' copy (a read past the length fails); the reference reads finite copies of those rows and masks them.
Also decode_splits, the chunk-count policy (pure host code).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.cupy_decode import SPLIT_MAX, decode_splits
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.quant.kv import QuantizedKV, kv_format
import kernel_emulator as emulate

F32, F16 = np.float32, np.float16
OPS = NumpyOps()
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
N, LMAX, NWARPS = 4, 32, 4
SLOTS, STARTS = [2, 0, 3], [0, 10, 29]         # lengths 1, 11, 30
SCALE = 0.3


def _inputs(rng, H, Hkv, hd):
    """qkv [S, (H + 2 Hkv) hd] float32 (q, k, v are views into it, as the model passes them) and the step."""
    S = len(SLOTS)
    qkv = rng.standard_normal((S, (H + 2 * Hkv) * hd)).astype(F32)
    q = qkv[:, :H * hd].reshape(S, H, hd)
    k = qkv[:, H * hd:(H + Hkv) * hd].reshape(S, Hkv, hd)
    v = qkv[:, (H + Hkv) * hd:].reshape(S, Hkv, hd)
    return qkv, q, k, v, StepLayout.build(SLOTS, STARTS, [1] * S)


def _past_the_rows():
    """(slot, positions) of each sequence's rows from its new one on (the kernels write the new row; they must read
    nothing after it)."""
    return [(slot, slice(start, None)) for slot, start in zip(SLOTS, STARTS)]


def _combine(H, hd, part):
    """decode_attention_combine over the workspace part [S, H, C, 2 + hd] -> out [S, H hd] (NaN before)."""
    S, _, C, _ = part.shape
    out = np.full((S, H * hd), np.nan, F32)
    emulate.build("decode_attention", {"T_ACT": "float"}).launch(
        "decode_attention_combine", (-(-H * hd // (32 * NWARPS)), S), (32, NWARPS), part, out, H, hd, C, H * hd)
    return out


def _check_partials(part):
    """Every workspace entry written; the chunks past a short sequence's length are neutral (m -inf, l = acc = 0)."""
    S, _, C, _ = part.shape
    assert not np.isnan(part).any(), "the split kernel left workspace entries unwritten"
    for s, start in enumerate(STARTS):
        for c in range(C):
            if (start + 1) * (c + 1) // C == (start + 1) * c // C:      # an empty chunk
                assert np.all(part[s, :, c, 0] == -np.inf) and not part[s, :, c, 1:].any()


FLOAT_CASES = [
    # storage, H, Hkv, hd, chunks
    ("float", 4, 4, 64, 1),            # MHA, one chunk (the combine only normalizes)
    ("float", 4, 2, 64, 2),            # GQA 2
    ("__half", 8, 1, 64, 3),           # MQA (group 8), float16 cache
    ("float", 8, 1, 128, 16),          # many chunks: more than 1 and 11 positions, empty chunks
    ("__half", 4, 2, 128, 5),
]


@pytest.mark.parametrize("storage, H, Hkv, hd, chunks", FLOAT_CASES)
@needs_emulator
def test_split_decode_attention_matches_numpy(storage, H, Hkv, hd, chunks):
    rng = np.random.default_rng(3)
    dt = {"float": F32, "__half": F16}[storage]
    qkv, q, k, v, step = _inputs(rng, H, Hkv, hd)
    ref_k, ref_v = (rng.standard_normal((N, Hkv, LMAX, hd)).astype(dt) for _ in range(2))
    cache_k, cache_v = ref_k.copy(), ref_v.copy()
    for slot, past in _past_the_rows():
        cache_k[slot, :, past] = cache_v[slot, :, past] = np.nan
    ref = OPS.attention(q, k, v, ref_k, ref_v, step, SCALE)

    S, ld = len(SLOTS), qkv.shape[1]
    part = np.full((S, H, chunks, 2 + hd), np.nan, F32)
    emulate.build("decode_attention", {"T_STORAGE": storage, "T_ACT": "float"}).launch(
        "decode_attention_split", (Hkv, S, chunks), (32, NWARPS), qkv, qkv[:, H * hd:], qkv[:, (H + Hkv) * hd:],
        cache_k, cache_v, np.array(SLOTS, np.int64), np.array(STARTS, np.int64), part, H, Hkv, hd, LMAX, ld, ld, ld,
        SCALE)
    _check_partials(part)
    out = _combine(H, hd, part)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 if storage == "float" else 2e-3)
    for slot, start in zip(SLOTS, STARTS):                           # the new rows appended, nothing else moved
        np.testing.assert_array_equal(cache_k[slot, :, :start + 1], ref_k[slot, :, :start + 1])
        np.testing.assert_array_equal(cache_v[slot, :, :start + 1], ref_v[slot, :, :start + 1])


QUANT_CASES = [
    # mode, group, H, Hkv, chunks
    ("int8", 32, 4, 4, 2),
    ("int4", 32, 4, 2, 7),             # more chunks than the 1- and (nearly) the 11-position sequences fill
    ("int8", 64, 8, 1, 3),
]


def _quantized(rng, fmt, Hkv, hd, spread):
    """A QuantizedKV [N, Hkv, LMAX, hd] of random rows."""
    cache = QuantizedKV.zeros(OPS, fmt, (N, Hkv, LMAX, hd))
    cache[:] = rng.standard_normal((N, Hkv, LMAX, hd)).astype(F32) * spread
    return cache


@pytest.mark.parametrize("mode, group, H, Hkv, chunks", QUANT_CASES)
@needs_emulator
def test_split_decode_attention_quant_matches_numpy(mode, group, H, Hkv, chunks):
    rng, hd = np.random.default_rng(7), 64
    fmt = kv_format(mode, group, hd)
    qkv, q, k, v, step = _inputs(rng, H, Hkv, hd)
    ref_k, ref_v = _quantized(rng, fmt, Hkv, hd, 2.0), _quantized(rng, fmt, Hkv, hd, 1.0)
    cache_k, cache_v = ref_k.map(np.copy), ref_v.map(np.copy)
    for slot, past in _past_the_rows():
        for cache in (cache_k, cache_v):
            cache.scale[slot, :, past] = cache.min[slot, :, past] = np.nan
    ref = OPS.attention(q, k, v, ref_k, ref_v, step, SCALE)

    S, ld = len(SLOTS), qkv.shape[1]
    part, status = np.full((S, H, chunks, 2 + hd), np.nan, F32), np.zeros(1, np.int32)
    emulate.build("decode_attention_quant", {"T_ACT": "float", "KV_BITS": fmt.bits}).launch(
        "decode_attention_quant_split", (Hkv, S, chunks), (32, NWARPS), qkv, qkv[:, H * hd:],
        qkv[:, (H + Hkv) * hd:], *cache_k.parts(), *cache_v.parts(), np.array(SLOTS, np.int64),
        np.array(STARTS, np.int64), part, H, Hkv, hd, fmt.group, LMAX, ld, ld, ld, SCALE, status)
    _check_partials(part)
    out = _combine(H, hd, part)
    assert np.isfinite(out).all() and status[0] == 0
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    for slot, start in zip(SLOTS, STARTS):                           # the new rows stored, bit-exact
        for got, want in zip((*cache_k.parts(), *cache_v.parts()), (*ref_k.parts(), *ref_v.parts())):
            np.testing.assert_array_equal(got[slot, :, :start + 1].view(np.uint8),
                                          want[slot, :, :start + 1].view(np.uint8))


# ---- the policy ------------------------------------------------------------------------------------------------
def test_decode_splits_fills_a_small_batch_and_leaves_a_full_grid_alone():
    # gpt2-1.5b at batch 1 on 132 SMs: 25 blocks; at context 160 ten chunks of 16 (250 blocks), in a graph's
    # 256 bucket eleven (275 blocks, >= 2 per SM)
    assert decode_splits(25, 160, 132) == 10
    assert decode_splits(25, 256, 132) == 11
    assert decode_splits(16 * 25, 4096, 132) == 1              # batch 16: 400 blocks already
    assert decode_splits(25, 31, 132) == 1                     # too short to pay for a second kernel
    assert decode_splits(1, 1 << 20, 132) == SPLIT_MAX
    assert decode_splits(25, 4096, 0) == 1                     # unknown device: one pass
