"""backend/paged_attention.py (issue 21's groundwork): decode attention through block tables equals NumpyOps'
attention over the dense cache holding the same rows, for sequences of mixed lengths whose blocks are scattered
through the pool, with grouped-query heads; padding blocks are never read."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.backend.paged_attention import paged_append
from hpcinfer.generate.block_manager import BlockPool, BlockTables
from paged_reference import paged_decode_attention


@pytest.mark.parametrize("block_size, heads, kv_heads", [(4, 4, 2), (16, 6, 6), (1, 8, 1)])
def test_paged_decode_equals_dense_decode(block_size, heads, kv_heads):
    rng = np.random.default_rng(block_size * 100 + heads)
    hd, lengths = 8, [5, 1, 23, 12]                          # positions cached before this step, per sequence
    S, lmax = len(lengths), max(lengths) + 1
    tables = BlockTables(BlockPool(num_blocks=64, block_size=block_size))
    for step in range(lmax):                                 # interleaved growth: each table's blocks scattered
        for s, n in enumerate(lengths):
            if step <= n:
                tables.grow(s, step + 1)
    pool_k = np.full((64, kv_heads, block_size, hd), np.nan, dtype=np.float32)    # unwritten = NaN: must not leak
    pool_v = np.full_like(pool_k, np.nan)
    dense_k = np.zeros((S, kv_heads, lmax, hd), dtype=np.float32)
    dense_v = np.zeros_like(dense_k)
    for s, n in enumerate(lengths):                          # the cached rows, the same in both caches
        k, v = rng.standard_normal((2, n, kv_heads, hd)).astype(np.float32)
        dense_k[s, :, :n], dense_v[s, :, :n] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        paged_append(pool_k, pool_v, tables.slots(s, 0, n), k, v)
    q = rng.standard_normal((S, heads, hd)).astype(np.float32)
    k_new, v_new = rng.standard_normal((2, S, kv_heads, hd)).astype(np.float32)

    want = NumpyOps().attention(q, k_new, v_new, dense_k, dense_v, StepLayout.build(range(S), lengths, [1] * S), 0.3)
    slots = np.concatenate([tables.slots(s, n, 1) for s, n in enumerate(lengths)])
    paged_append(pool_k, pool_v, slots, k_new, v_new)
    got = paged_decode_attention(q, pool_k, pool_v, tables.table_array(list(range(S))), np.add(lengths, 1), 0.3)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_append_writes_each_row_at_its_slot():
    pool_k = np.zeros((3, 2, 4, 5), dtype=np.float32)
    pool_v = np.zeros_like(pool_k)
    k = np.arange(2 * 2 * 5, dtype=np.float32).reshape(2, 2, 5)
    paged_append(pool_k, pool_v, [6, 9], k, -k)              # block 1 offset 2, block 2 offset 1
    np.testing.assert_array_equal(pool_k[1, :, 2], k[0])
    np.testing.assert_array_equal(pool_v[2, :, 1], -k[1])
    assert np.count_nonzero(pool_k) == np.count_nonzero(k)
