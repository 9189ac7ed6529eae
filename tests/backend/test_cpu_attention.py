"""The compiled CPU attention kernels (backend/cpu_kernels/attention.py, wired by backend/compiled_attention.py)
against their NumPy twins: NumpyOps.attention with cpu_kernels = "numba" equals it with "numpy" within float32
rounding, over the dense cache, the paged pool (non-contiguous and shared blocks) and quantized stores, for decode,
prefill, chunked prefill after cached positions and top-k; the new rows are stored as the NumPy path stores them;
the result does not depend on the thread count; the numpy setting never reaches the kernels."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend import compiled_attention
from hpcinfer.backend.cpu_kernels import NUMBA_ERROR
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.backend.paged_attention import paged_append
from hpcinfer.generate.block_manager import BlockPool, BlockTables
from hpcinfer.quant.kv import NO_SCALES, QuantizedKV, kv_format
from paged_reference import paged_decode_attention

pytestmark = pytest.mark.skipif(NUMBA_ERROR is not None, reason=f"numba does not import: {NUMBA_ERROR}")
F32 = np.float32
TOL = dict(rtol=2e-5, atol=2e-5)


def rand(rng, *shape):
    return rng.standard_normal(shape, dtype=F32)


def dense_cache(rng, slots, kv_heads, lmax, hd, mode="none"):
    """A filled dense cache [slots, Hkv, lmax, hd]: float32, or QuantizedKV of random rows."""
    rows = rand(rng, slots, kv_heads, lmax, hd)
    if mode == "none":
        return rows
    cache = QuantizedKV.zeros(NumpyOps(), kv_format(mode, 32, hd), rows.shape)
    cache[:] = rows
    return cache


def copied(cache):
    return cache.map(np.copy) if isinstance(cache, QuantizedKV) else cache.copy()


def stored(cache):
    return [a.copy() for a in cache.parts()] if isinstance(cache, QuantizedKV) else [cache.copy()]


def both(q, k, v, cache_k, cache_v, step, topk=0.0, threads=2):
    """(want, got, the caches after each): NumpyOps' attention with cpu_kernels numpy and numba."""
    caches = [(copied(cache_k), copied(cache_v)) for _ in range(2)]
    for cache in caches[0]:                                   # the NumPy paged path reads past each length and
        if isinstance(cache, np.ndarray):                     # masks the scores: it needs finite rows there
            np.nan_to_num(cache, copy=False)
    want = NumpyOps(threads, "numpy").attention(q, k, v, *caches[0], step, 0.3, topk)
    got = NumpyOps(threads, "numba").attention(q, k, v, *caches[1], step, 0.3, topk)
    return want, got, caches


def step_rows(rng, counts, heads, kv_heads, hd):
    T = int(np.sum(counts))
    return rand(rng, T, heads, hd), rand(rng, T, kv_heads, hd), rand(rng, T, kv_heads, hd)


@pytest.mark.parametrize("heads, kv_heads, hd", [(2, 2, 64), (6, 2, 128), (8, 1, 64)])   # groups 1, 3, 8
def test_dense_decode_equals_numpy(heads, kv_heads, hd):
    rng = np.random.default_rng(heads * 7 + hd)
    starts = [0, 70, 13, 129]                                # lengths 1 .. 130, none a multiple of a chunk
    cache_k, cache_v = (dense_cache(rng, 6, kv_heads, 136, hd) for _ in range(2))
    step = StepLayout.build([4, 0, 5, 2], starts, [1] * 4)   # slots out of order, some idle
    q, k, v = step_rows(rng, [1] * 4, heads, kv_heads, hd)
    want, got, caches = both(q, k, v, cache_k, cache_v, step)
    np.testing.assert_allclose(got, want, **TOL)
    for a, b in zip(caches[0], caches[1]):
        np.testing.assert_array_equal(a, b)                  # the new rows stored, the rest untouched


@pytest.mark.parametrize("heads, kv_heads", [(3, 1), (8, 8)])
def test_dense_prefill_and_chunked_prefill_equal_numpy(heads, kv_heads):
    rng = np.random.default_rng(heads)
    hd, starts, counts = 64, [0, 45, 0, 3], [70, 19, 1, 33]   # whole prompts, chunks after cached rows, one token
    cache_k, cache_v = (dense_cache(rng, 4, kv_heads, 128, hd) for _ in range(2))
    step = StepLayout.build([1, 3, 0, 2], starts, counts)
    q, k, v = step_rows(rng, counts, heads, kv_heads, hd)
    want, got, caches = both(q, k, v, cache_k, cache_v, step)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_array_equal(caches[0][0], caches[1][0])


def paged_step(rng, lengths, counts, kv_heads, hd, block_size, mode="none", share=True):
    """A pool whose tables interleave (non-contiguous blocks), sequences 0 and 1 sharing their first block, filled
    with rows for each sequence's cached positions; the step adds counts[s] tokens after lengths[s]."""
    tables = BlockTables(BlockPool(num_blocks=64, block_size=block_size))
    ends = np.add(lengths, counts)
    for p in range(int(ends.max())):
        for s, end in enumerate(ends):
            if p < end:
                tables.grow(s, p + 1)
    if share:                                                # sequence 1 reads sequence 0's first block
        tables.tables[1][0] = tables.tables[0][0]
    shape = (65, kv_heads, block_size, hd)
    pools = [np.full(shape, np.nan, dtype=F32) if mode == "none" else
             QuantizedKV.zeros(NumpyOps(), kv_format(mode, 32, hd), shape) for _ in range(2)]
    for s, n in enumerate(lengths):
        if n:
            paged_append(*pools, tables.slots(s, 0, n), rand(rng, n, kv_heads, hd), rand(rng, n, kv_heads, hd))
    step = StepLayout.paged(tables.table_array(list(range(len(lengths)))), block_size, lengths, counts)
    return pools, step


@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [1, 20, 3, 1]])
@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_paged_equals_numpy(mode, counts):
    rng = np.random.default_rng(len(mode) + counts[1])
    heads, kv_heads, hd, lengths = 6, 2, 64, [37, 21, 0, 9]   # sequence 1 shares sequence 0's first block
    (pool_k, pool_v), step = paged_step(rng, lengths, counts, kv_heads, hd, block_size=8, mode=mode)
    q, k, v = step_rows(rng, counts, heads, kv_heads, hd)
    want, got, caches = both(q, k, v, pool_k, pool_v, step)
    np.testing.assert_allclose(got, want, **TOL)
    for a, b in zip(stored(caches[0][0]), stored(caches[1][0])):
        np.testing.assert_array_equal(np.nan_to_num(a), np.nan_to_num(b))   # quantized as NumPy quantizes them


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_dense_cache_equals_numpy(mode):
    rng = np.random.default_rng(5)
    cache_k, cache_v = (dense_cache(rng, 3, 2, 96, 128, mode) for _ in range(2))
    for starts, counts in (([40, 0, 77], [1, 1, 1]), ([40, 0, 7], [17, 30, 1])):
        step = StepLayout.build([2, 0, 1], starts, counts)
        q, k, v = step_rows(rng, counts, 4, 2, 128)
        want, got, caches = both(q, k, v, cache_k, cache_v, step)
        np.testing.assert_allclose(got, want, **TOL)
        for a, b in zip(stored(caches[0][1]), stored(caches[1][1])):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_top_k_equals_numpy(mode):
    rng = np.random.default_rng(11)
    counts = [1, 1, 12, 1]                                    # decode rows take top-k, the prompt chunk stays dense
    (pool_k, pool_v), step = paged_step(rng, [50, 3, 0, 17], counts, 2, 64, block_size=16, mode=mode)
    q, k, v = step_rows(rng, counts, 6, 2, 64)
    want, got, _ = both(q, k, v, pool_k, pool_v, step, topk=0.3)
    np.testing.assert_allclose(got, want, **TOL)
    cache = dense_cache(rng, 4, 2, 64, 64)
    step = StepLayout.build([3, 1, 0, 2], [0, 40, 9, 63], [1] * 4)
    want, got, _ = both(*step_rows(rng, [1] * 4, 6, 2, 64), cache, cache.copy(), step, topk=0.25)
    np.testing.assert_allclose(got, want, **TOL)


def test_kernel_over_plain_arrays_equals_paged_decode_reference():
    """The kernel as any store calls it: the pool's arrays, int32 tables, starts, counts and the new rows."""
    rng = np.random.default_rng(2)
    (pool_k, pool_v), step = paged_step(rng, [12, 5, 30], [1, 1, 1], 3, 64, block_size=4, share=False)
    q, k, v = step_rows(rng, [1, 1, 1], 9, 3, 64)
    paged_append(pool_k, pool_v, step.flat_slots(), k, v)
    want = paged_decode_attention(q, pool_k, pool_v, step.tables, step.starts + 1, 0.3)
    got = np.full_like(want, np.nan)
    kernels = compiled_attention.kernels
    kernels.causal_attention(q, k, v, (pool_k, NO_SCALES, NO_SCALES), (pool_v, NO_SCALES, NO_SCALES), 1, step.tables,
                             step.starts, step.counts, step.offsets, kernels.make_items(step.starts, step.counts, 3),
                             F32(0.3), got, 2)
    np.testing.assert_allclose(got, want, **TOL)


def test_threads_do_not_change_a_bit():
    rng = np.random.default_rng(4)
    counts = [1, 40, 1, 1, 9]
    cache = dense_cache(rng, 5, 2, 100, 64)
    step = StepLayout.build(range(5), [60, 0, 99 - 1, 3, 20], counts)
    q, k, v = step_rows(rng, counts, 4, 2, 64)
    one = NumpyOps(1, "numba").attention(q, k, v, cache.copy(), cache.copy(), step, 0.3)
    two = NumpyOps(2, "numba").attention(q, k, v, cache.copy(), cache.copy(), step, 0.3)
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("block_size", [64, 128, 256])
def test_a_pool_of_whole_chunks_reads_the_slots_bits(block_size):
    """Blocks of a multiple of the kernels' chunk (CHUNK keys) cut a sequence's positions where the slots' one block
    does, so decode over such a pool (blocks shuffled) gives the dense slots' bits: the ground on which a CPU pool
    of 256-position blocks can replace the slot store without changing a token (docs/cpu-attention.md)."""
    assert block_size % compiled_attention.kernels.CHUNK == 0
    rng = np.random.default_rng(block_size)
    S, kv_heads, hd, lengths = 3, 2, 64, [300, 45, 129]                      # cached positions before the step
    lmax = max(lengths) + 1
    dense = [dense_cache(rng, S, kv_heads, lmax, hd) for _ in range(2)]
    per_seq = -(-lmax // block_size)
    order = rng.permutation(S * per_seq)                                     # the pool's blocks, shuffled
    pools = []
    for cache in dense:
        padded = np.zeros((S, kv_heads, per_seq * block_size, hd), dtype=F32)
        padded[:, :, :lmax] = cache
        pool = np.zeros((S * per_seq, kv_heads, block_size, hd), dtype=F32)
        pool[order] = padded.reshape(S, kv_heads, per_seq, block_size, hd).transpose(0, 2, 1, 3, 4) \
            .reshape(S * per_seq, kv_heads, block_size, hd)
        pools.append(pool)
    q, k, v = step_rows(rng, [1] * S, 6, kv_heads, hd)
    ops = NumpyOps(2, "numba")
    want = ops.attention(q, k, v, *dense, StepLayout.build(range(S), lengths, [1] * S), 0.3)
    paged = StepLayout.paged(order.reshape(S, per_seq), block_size, lengths, [1] * S)
    np.testing.assert_array_equal(ops.attention(q, k, v, *pools, paged, 0.3), want)


def test_numpy_setting_never_calls_the_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the numpy setting reached the compiled kernels")
    monkeypatch.setattr(compiled_attention, "attention", refuse)
    rng = np.random.default_rng(0)
    cache = dense_cache(rng, 2, 1, 16, 64)
    step = StepLayout.build([0, 1], [3, 5], [1, 1])
    NumpyOps(2, "numpy").attention(*step_rows(rng, [1, 1], 2, 1, 64), cache, cache.copy(), step, 0.3)
    with pytest.raises(AssertionError, match="reached the compiled kernels"):
        NumpyOps(2, "numba").attention(*step_rows(rng, [1, 1], 2, 1, 64), cache, cache.copy(), step, 0.3)


def test_positions_past_the_dense_cache_are_an_error():
    rng = np.random.default_rng(0)
    cache = dense_cache(rng, 2, 1, 16, 64)
    step = StepLayout.build([0, 1], [3, 15], [1, 2])
    with pytest.raises(ValueError, match="positions up to 17 do not fit a KV cache of 16"):
        NumpyOps(2, "numba").attention(*step_rows(rng, [1, 2], 2, 1, 64), cache, cache.copy(), step, 0.3)
