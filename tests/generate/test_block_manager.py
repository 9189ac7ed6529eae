"""generate/block_manager.py: the paged KV cache's block pool and block tables (issue 21's groundwork), against
hand answers and a random interleaving of growth and release checked against a plain model of ownership."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.errors import ConfigError
from hpcinfer.generate.block_manager import BlockPool, BlockTables


def test_a_sequence_grows_block_by_block_and_gives_them_back():
    tables = BlockTables(BlockPool(num_blocks=4, block_size=16))
    tables.grow("a", 16)                                     # one full block
    assert tables.tables["a"] == [0] and tables.pool.free_blocks == 3
    tables.grow("a", 17)                                     # the 17th position opens a second block
    assert tables.tables["a"] == [0, 1]
    tables.grow("a", 30)                                     # still two blocks
    assert tables.tables["a"] == [0, 1] and tables.extra_blocks("a", 33) == 1
    assert tables.release("a") == 2 and tables.pool.free_blocks == 4 and "a" not in tables.tables


def test_slots_follow_the_block_table():
    tables = BlockTables(BlockPool(num_blocks=6, block_size=4))
    tables.grow("x", 3)
    tables.grow("y", 6)
    tables.grow("x", 9)                                      # x: [0, 3, 4] (y took 1 and 2 in between)
    assert tables.tables == {"x": [0, 3, 4], "y": [1, 2]}
    np.testing.assert_array_equal(tables.slots("x", 2, 5), [2, 3, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2])
    np.testing.assert_array_equal(tables.slots("x", 8, 1), [4 * 4 + 0])
    np.testing.assert_array_equal(tables.table_array(["y", "x"]), [[1, 2, -1], [0, 3, 4]])
    with pytest.raises(RuntimeError, match="position 12 past its 3 blocks"):
        tables.slots("x", 11, 2)


def test_the_pool_refuses_what_it_does_not_have():
    tables = BlockTables(BlockPool(num_blocks=2, block_size=8))
    assert tables.can_grow("a", 16) and not tables.can_grow("a", 17)
    tables.grow("a", 16)
    assert not tables.can_grow("b", 1) and tables.can_grow("a", 16)      # growing within its blocks takes none
    with pytest.raises(RuntimeError, match="1 blocks asked, 0 free"):
        tables.grow("b", 1)
    with pytest.raises(RuntimeError, match="not all in use"):
        tables.pool.free([0, 0])
    with pytest.raises(ConfigError, match="at least one block"):
        BlockPool(0, 16)


def test_a_freed_block_is_the_next_one_taken():
    pool = BlockPool(num_blocks=5, block_size=2)
    first = pool.allocate(3)
    pool.free([first[1]])
    assert pool.allocate(1) == [first[1]]


@pytest.mark.parametrize("seed", range(5))
def test_random_growth_and_release_never_share_or_lose_a_block(seed):
    rng = np.random.default_rng(seed)
    pool = BlockPool(num_blocks=40, block_size=int(rng.integers(1, 9)))
    tables, lengths = BlockTables(pool), {}
    for _ in range(400):
        seq = int(rng.integers(0, 12))
        if seq in lengths and rng.random() < 0.2:
            tables.release(seq)
            del lengths[seq]
            continue
        length = lengths.get(seq, 0) + int(rng.integers(1, 6))
        if tables.can_grow(seq, length):
            tables.grow(seq, length)
            lengths[seq] = length
        owned = [b for t in tables.tables.values() for b in t]
        assert len(owned) == len(set(owned)) and len(owned) + pool.free_blocks == pool.num_blocks
        for s, n in lengths.items():
            assert len(tables.tables[s]) == tables.blocks_for(n)
            slots = tables.slots(s, 0, n)
            assert len(set(slots.tolist())) == n and set((slots // pool.block_size).tolist()) <= set(tables.tables[s])
