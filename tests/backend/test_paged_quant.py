"""Quantized KV pools (int8 / int4 rows in blocks) and top-k attention over blocks on the NumPy backend
(backend/paged_attention.through_dense): a paged step gives the dense step's numbers. The reference is
kv_attention.attention over a dense cache [S, Hkv, Lmax, hd] holding the same rows (the static schedule's cache):
the same output, bit for bit, and the same bytes stored for the new rows, for decode, prefill and mixed steps, block
sizes 1 and 4, tables scattered through a pool whose other rows hold other sequences' data. With top-k, the decode
tokens of a mixed step attend top-k (as the static schedule's decode steps) and its prompt chunks densely. The
pool's bytes are the format's (block_bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend import kv_attention, paged_attention
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.generate.block_manager import BlockPool, BlockTables
from hpcinfer.generate.paged_cache import PagedKVCache, block_bytes, supports
from hpcinfer.quant.kv import QuantizedKV, kv_format

F32, SCALE = np.float32, 0.3
H, HKV, HD = 4, 2, 16
STEPS = {   # (starts, counts): positions cached before the step, new tokens
    "decode": ([0, 5, 17, 8], [1, 1, 1, 1]),
    "prefill": ([0, 0], [6, 9]),
    "mixed": ([6, 0, 11, 3], [1, 7, 3, 1]),         # decode tokens, a prompt, a prompt's later chunk
}
FORMATS = ["int8", "int4", "float"]


def fmt_of(name, group=8):
    return None if name == "float" else kv_format(name, group, HD)


def zeros(fmt, shape):
    return np.zeros(shape, F32) if fmt is None else QuantizedKV.zeros(NumpyOps(), fmt, shape)


def arrays(cache) -> tuple:
    return cache.parts() if isinstance(cache, QuantizedKV) else (cache,)


def scattered(starts, counts, bs, spare=3) -> BlockTables:
    """Tables grown in turn, position by position: each sequence's blocks scattered among the others'."""
    tables = BlockTables(BlockPool(sum(-(-(a + n) // bs) for a, n in zip(starts, counts)) + spare, bs))
    for length in range(1, max(a + n for a, n in zip(starts, counts)) + 1):
        for s, (a, n) in enumerate(zip(starts, counts)):
            if length <= a + n:
                tables.grow(s, length)
    return tables


def case(kind, fmt, bs, seed=0):
    """(paged step, pools k, v, dense caches k, v [S, Hkv, Lmax, hd], q, k, v): every pool row and every dense row
    random (other sequences' data, stale rows), then each sequence's cached rows (positions < start) the same in
    both."""
    rng = np.random.default_rng(seed)
    starts, counts = STEPS[kind]
    tables = scattered(starts, counts, bs)
    S, lmax = len(starts), max(a + n for a, n in zip(starts, counts)) + 2
    pools = [zeros(fmt, (tables.pool.num_blocks + 1, HKV, bs, HD)) for _ in range(2)]
    dense = [zeros(fmt, (S, HKV, lmax, HD)) for _ in range(2)]
    for cache in pools + dense:
        cache[:] = rng.standard_normal(cache.shape).astype(F32)
    for s, a in enumerate(starts):
        rows = rng.standard_normal((2, a, HKV, HD)).astype(F32)
        paged_attention.paged_append(*pools, tables.slots(s, 0, a), *rows)
        for cache, r in zip(dense, rows):
            cache[s, :, :a] = r.transpose(1, 0, 2)
    step = StepLayout.paged(tables.table_array(list(range(S))), bs, starts, counts)
    T = step.num_tokens
    q, k, v = (rng.standard_normal((T, n, HD)).astype(F32) for n in (H, HKV, HKV))
    return step, pools, dense, q, k, v


def dense_reference(step, dense, q, k, v, topk):
    """The static schedule's steps over the dense cache: decode tokens (with top-k: apart, as its decode steps)
    and prompt chunks -> [T, H*hd]."""
    out = np.empty((q.shape[0], H * HD), F32)
    every, one = np.arange(step.num_seqs), step.counts == 1
    for rows in ([every[one], every[~one]] if 0 < topk < 1 else [every]):
        if not len(rows):
            continue
        tok = np.concatenate([np.arange(*step.token_range(s)) for s in rows])
        part = StepLayout.build(rows, step.starts[rows], step.counts[rows])
        out[tok] = kv_attention.attention(NumpyOps(), q[tok], k[tok], v[tok], *dense, part, SCALE, topk)
    return out


@pytest.mark.parametrize("kind", sorted(STEPS))
@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("fmt_name, topk", [("int8", 0.0), ("int4", 0.0), ("int8", 0.4), ("int4", 0.5),
                                            ("float", 0.4)])
def test_a_paged_step_gives_the_dense_steps_numbers_and_bytes(kind, bs, fmt_name, topk):
    fmt = fmt_of(fmt_name)
    step, pools, dense, q, k, v = case(kind, fmt, bs)
    before = [a.copy() for pool in pools for a in arrays(pool)]
    got = paged_attention.attention(NumpyOps(), q, k, v, *pools, step, SCALE, topk)
    want = dense_reference(step, dense, q, k, v, topk)
    np.testing.assert_array_equal(got, want)
    new = np.zeros(before[0].shape[:3], bool)                           # [blocks, Hkv, bs]: the step's new rows
    for s in range(step.num_seqs):
        for p in range(int(step.starts[s]), int(step.starts[s] + step.counts[s])):
            block, off = int(step.tables[s, p // bs]), p % bs
            new[block, :, off] = True
            for pool, cache in zip(pools, dense):                       # stored as the dense path stores them
                for a, b in zip(arrays(pool), arrays(cache)):
                    np.testing.assert_array_equal(a[block, :, off], b[s, :, p])
    for a, b in zip((a for pool in pools for a in arrays(pool)), before):
        np.testing.assert_array_equal(a[~new], b[~new])                 # nothing else written


def test_top_k_applies_to_the_decode_tokens_of_a_mixed_step():
    step, pools, dense, q, k, v = case("mixed", None, 4, seed=1)
    got = paged_attention.attention(NumpyOps(), q, k, v, *pools, step, SCALE, 0.3)
    dense_all = dense_reference(step, [c.copy() for c in dense], q, k, v, 0.0)
    decode_tok = [step.token_range(s)[0] for s in range(step.num_seqs) if step.counts[s] == 1]
    prompt_tok = [t for t in range(step.num_tokens) if t not in decode_tok]
    assert not np.allclose(got[decode_tok], dense_all[decode_tok])     # top-k, not dense, for decode tokens
    np.testing.assert_array_equal(got[prompt_tok], dense_all[prompt_tok])


def test_the_step_is_indexed_once_for_every_layer():
    ops = NumpyOps()
    step, pools, _, q, k, v = case("mixed", fmt_of("int4"), 4)
    first = paged_attention.attention(ops, q, k, v, *pools, step, SCALE, 0.5)
    made = dict(ops._paged_step[1])
    second_pools = [p.map(np.copy) for p in case("mixed", fmt_of("int4"), 4)[1]]
    paged_attention.attention(ops, q, k, v, *second_pools, step, SCALE, 0.5)
    assert list(made) == [("dense", HKV, 4, True)] and ops._paged_step[1][("dense", HKV, 4, True)] is made[
        ("dense", HKV, 4, True)]
    assert len(made[("dense", HKV, 4, True)]) == 2 and first.shape == (step.num_tokens, H * HD)


# ---- the pool --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt_name, row", [("int8", 16 + 4), ("int4", 8 + 4), ("float", 64)])
def test_pool_bytes_are_the_formats(fmt_name, row):
    """A row of hd 16 in one group: values (16 bytes int8, 8 int4) + fp16 scale and min; float: 64 bytes."""
    fmt = fmt_of(fmt_name, group=16)
    layers, blocks, bs = 3, 5, 4
    per_block = block_bytes(layers, HKV, bs, HD, fmt)
    assert per_block == 2 * layers * HKV * bs * row                     # K and V of every layer
    cache = PagedKVCache(NumpyOps(), layers, blocks, HKV, bs, HD, kv_format=fmt)
    assert cache.nbytes == per_block * (blocks + 1)                     # the pool and its spare block
    assert cache.kv_format == fmt and cache.spare_block == blocks and cache.pool.num_blocks == blocks
    pool = cache.k[0]
    if fmt is None:
        assert pool.shape == (blocks + 1, HKV, bs, HD) and pool.dtype == F32
    else:
        assert isinstance(pool, QuantizedKV) and pool.shape == (blocks + 1, HKV, bs, HD) and pool.fmt == fmt
        assert pool.q.dtype == np.uint8 and pool.scale.dtype == np.float16


def test_the_paged_cache_holds_every_kv_format_and_top_k():
    assert supports("int8") == supports("int4") == supports("none", 0.5) == supports("int4", 0.25) == []
