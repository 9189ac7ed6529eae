"""cuda_src/decode_attention.cu on the CPU emulator, against NumpyOps' decode attention (the spec): the single
launch that splits each context into C chunks and lets the last block of each (sequence, KV head) combine them.

Sequences of mixed lengths (1: only the appended row; lengths no chunk count, warp or vector width divides; fewer
positions than chunks: empty chunks), chunk counts 1, 2, a few and many, GQA groups 1, 3 and 8, head dims 16, 64,
80 and 128 (one to four 16-byte vectors a lane; 80: a row the lanes do not split evenly), float32, float16 and
bfloat16 caches (half precision: the rows the reference stores are the same rounded values, so the tolerance is the
float32 one but for the order of the sums). The output and workspace start as NaN (an entry left unwritten fails),
every cache position past a sequence's new row is NaN in the kernel's copy (a read past the length fails); the
counters must come back zero. Rotary fused into the q load and the k append, against NumpyOps.rotary then
attention. Determinism: the blocks run in several orders (so a different block finishes last) and the output is the
same bits each time. Also decode_splits, the chunk-count policy (pure host code).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hpcinfer.backend.cupy_decode import SPLIT_MAX, decode_splits
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate

F32, F16, BF16 = np.float32, np.float16, ml_dtypes.bfloat16
OPS = NumpyOps()
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
N, LMAX, NWARPS = 4, 48, 4
SLOTS, STARTS = [2, 0, 3], [0, 10, 44]         # lengths 1, 11, 45
SCALE = 0.3
DTYPES = {"float": F32, "__half": F16, "__nv_bfloat16": BF16}


def qkv_rows(rng, S, H, Hkv, hd):
    """qkv [S, (H + 2 Hkv) hd] float32 and q [S, H, hd], k, v [S, Hkv, hd] views into it (as the model passes)."""
    qkv = rng.standard_normal((S, (H + 2 * Hkv) * hd)).astype(F32)
    q = qkv[:, :H * hd].reshape(S, H, hd)
    k = qkv[:, H * hd:(H + Hkv) * hd].reshape(S, Hkv, hd)
    v = qkv[:, (H + Hkv) * hd:].reshape(S, Hkv, hd)
    return qkv, q, k, v


def rope_rows(rng, S, rotary_dim):
    """cos, sin [S, rotary_dim / 2] float32 of random angles (each sequence's position)."""
    angles = rng.uniform(0, 2 * np.pi, (S, rotary_dim // 2))
    return np.cos(angles).astype(F32), np.sin(angles).astype(F32)


def launch(module, function, grid_hs, chunks, H, hd, rows, tail, rope=None):
    """Run a decode attention kernel over grid (Hkv, S, chunks) -> out [S, H hd] (NaN before). rows: its arguments
    before cos; tail: those after counters. Checks that the workspace was filled and the counters come back 0."""
    Hkv, S = grid_hs
    out = np.full((S, H * hd), np.nan, F32)
    part = np.full((S, H, chunks, 2 + hd), np.nan, F32) if chunks > 1 else None
    counters = np.zeros(S * Hkv, np.int32) if chunks > 1 else None
    cos, sin, rd = rope if rope is not None else (None, None, 0)
    module.launch(function, (Hkv, S, chunks), (32, NWARPS), *rows, cos, sin, rd, out, part, counters, *tail)
    if chunks > 1:
        assert not np.isnan(part).any(), "a block left its workspace entries unwritten"
        assert not counters.any(), "the counters must come back zero for the next launch"
    return out


def _dense(storage, H, Hkv, hd, chunks, rope=None, seed=3, order=0):
    """(kernel output, reference output, kernel caches, reference caches) of one decode step."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[storage]
    qkv, q, k, v = qkv_rows(rng, len(SLOTS), H, Hkv, hd)
    ref_k, ref_v = (rng.standard_normal((N, Hkv, LMAX, hd)).astype(dt) for _ in range(2))
    cache_k, cache_v = ref_k.copy(), ref_v.copy()
    for slot, start in zip(SLOTS, STARTS):
        cache_k[slot, :, start:] = cache_v[slot, :, start:] = np.nan
    cos_sin = rope_rows(rng, len(SLOTS), rope) if rope else None
    if rope:
        rot = OPS.rotary(np.concatenate([q, k], axis=1), *cos_sin, rope)
        q, k = rot[:, :H], rot[:, H:]
    ref = OPS.attention(q, k, v, ref_k, ref_v, StepLayout.build(SLOTS, STARTS, [1] * len(SLOTS)), SCALE)
    ld = qkv.shape[1]
    module = emulate.build("decode_attention", {"T_STORAGE": storage, "T_ACT": "float", "HEAD_DIM": hd,
                                                "GROUP": H // Hkv, "NWARPS": NWARPS})
    module.set_block_order(order)
    try:
        out = launch(module, "decode_attention", (Hkv, len(SLOTS)), chunks, H, hd,
                     (qkv, qkv[:, H * hd:], qkv[:, (H + Hkv) * hd:], cache_k, cache_v, np.array(SLOTS, np.int64),
                      np.array(STARTS, np.int64)),
                     (H, Hkv, hd, LMAX, ld, ld, ld, H * hd, SCALE), (*cos_sin, rope) if rope else None)
    finally:
        module.set_block_order(0)
    return out, ref, (cache_k, cache_v), (ref_k, ref_v)


FLOAT_CASES = [
    # storage, H, Hkv, hd, chunks
    ("float", 4, 4, 64, 1),            # MHA, one pass
    ("float", 4, 2, 64, 2),            # GQA 2
    ("__half", 8, 1, 64, 3),           # MQA (group 8), float16 cache: 8 lanes a row, 4 positions a warp
    ("float", 8, 1, 128, 16),          # many chunks: more than the 1- and 11-position sequences fill
    ("__half", 6, 2, 128, 5),          # group 3 (SmolLM2's), 16 lanes a row
    ("__nv_bfloat16", 2, 2, 80, 4),    # 10 vectors a row over 8 lanes: two lanes take two
    ("float", 3, 1, 16, 7),            # 4 lanes a row, 8 positions a warp
]


@pytest.mark.parametrize("storage, H, Hkv, hd, chunks", FLOAT_CASES)
@needs_emulator
def test_decode_attention_matches_numpy(storage, H, Hkv, hd, chunks):
    out, ref, caches, refs = _dense(storage, H, Hkv, hd, chunks)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 if storage == "float" else 2e-4)
    for got, want in zip(caches, refs):                              # the new rows appended, nothing else moved
        for slot, start in zip(SLOTS, STARTS):
            np.testing.assert_array_equal(got[slot, :, :start + 1], want[slot, :, :start + 1])


@pytest.mark.parametrize("storage, hd, rotary_dim, chunks", [("float", 64, 64, 1), ("__half", 64, 32, 3),
                                                             ("float", 80, 40, 5)])
@needs_emulator
def test_fused_rotary_matches_rotary_then_attention(storage, hd, rotary_dim, chunks):
    """q rotated as it is loaded, k as it is appended (partial rotary_dim: the rest passes through): the output
    and the appended rows equal NumpyOps.rotary followed by NumpyOps.attention."""
    out, ref, caches, refs = _dense(storage, 6, 2, hd, chunks, rope=rotary_dim, seed=11)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 if storage == "float" else 2e-4)
    for got, want in zip(caches, refs):
        for slot, start in zip(SLOTS, STARTS):
            np.testing.assert_array_equal(got[slot, :, :start + 1], want[slot, :, :start + 1])


@needs_emulator
def test_the_combine_is_deterministic_whichever_block_finishes_last():
    """The same step with the blocks in four orders (a different block of each group finds itself last and
    combines): the output is the same bits, and equals the natural order's."""
    outs = [_dense("__half", 4, 2, 64, 6, order=order)[0] for order in (0, 1, 7, 12345)]
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))


@needs_emulator
def test_decode_attention_writes_nothing_for_shapes_it_was_not_built_for():
    # a module built for group 2 given group 4: the wrapper never launches this; the kernel must leave all alone
    rng = np.random.default_rng(1)
    qkv, _, _, _ = qkv_rows(rng, 1, 4, 1, 16)
    cache = np.full((1, 1, 8, 16), 7.0, F32)
    module = emulate.build("decode_attention", {"T_STORAGE": "float", "T_ACT": "float", "HEAD_DIM": 16,
                                                "GROUP": 2, "NWARPS": NWARPS})
    out = launch(module, "decode_attention", (1, 1), 1, 4, 16,
                 (qkv, qkv[:, 64:], qkv[:, 80:], cache, cache.copy(), np.zeros(1, np.int64), np.array([3])),
                 (4, 1, 16, 8, 96, 96, 96, 64, SCALE))
    assert np.isnan(out).all() and np.all(cache == 7.0)


# ---- the policy ------------------------------------------------------------------------------------------------
def test_decode_splits_fills_a_small_batch_and_leaves_a_full_grid_alone():
    # gpt2-1.5b at batch 1 on 132 SMs: 25 blocks; at context 160 ten chunks of 16 (250 blocks), in a graph's
    # 256 bucket eleven (275 blocks, >= 2 per SM)
    assert decode_splits(25, 160, 132) == 10
    assert decode_splits(25, 256, 132) == 11
    assert decode_splits(16 * 25, 4096, 132) == 1              # batch 16: 400 blocks already
    assert decode_splits(25, 31, 132) == 1                     # too short to pay for the combine
    assert decode_splits(1, 1 << 20, 132) == SPLIT_MAX
    assert decode_splits(25, 4096, 0) == 1                     # unknown device: one pass
