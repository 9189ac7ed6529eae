"""The paged KV cache's bookkeeping (issue 21; vLLM's PagedAttention, nano-vllm's BlockManager): one pool of
fixed-size blocks per rank and a block table per sequence. A sequence's position p lives in block
table[p // block_size] at offset p % block_size; blocks are taken as a sequence grows and given back when it ends
(or is preempted). Only the host-side indices live here; the KV arrays that the blocks index are the cache's.

Its user: the continuous schedule (generate/schedules/continuous.py) through generate/paged_cache.py.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError


class BlockPool:
    """`num_blocks` blocks of `block_size` token positions: which are free (a stack: the last freed is reused
    first, so a finished sequence's blocks are warm in cache when the next one takes them)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"a KV block pool needs at least one block of at least one position, got "
                              f"{num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n free blocks (taken out of the pool); the caller checks free_blocks first."""
        if n > len(self._free):
            raise RuntimeError(f"KV block pool: {n} blocks asked, {len(self._free)} free (check free_blocks first)")
        taken, self._free = self._free[len(self._free) - n:][::-1], self._free[:len(self._free) - n]
        return taken

    def free(self, blocks: list[int]) -> None:
        """Give blocks back; each must be in use."""
        if len(set(blocks)) != len(blocks) or set(blocks) & set(self._free) or \
                any(not 0 <= b < self.num_blocks for b in blocks):
            raise RuntimeError(f"KV block pool: freeing blocks that are not all in use: {sorted(blocks)}")
        self._free.extend(reversed(blocks))


class BlockTables:
    """The block table of every running sequence, over one BlockPool."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.tables: dict = {}                       # sequence id -> [block ids], position order

    def blocks_for(self, length: int) -> int:
        """Blocks that hold `length` positions."""
        return -(-length // self.pool.block_size)

    def extra_blocks(self, seq_id, length: int) -> int:
        """Blocks sequence `seq_id` must take to hold `length` positions (0 when it already does)."""
        return max(0, self.blocks_for(length) - len(self.tables.get(seq_id, ())))

    def can_grow(self, seq_id, length: int) -> bool:
        return self.extra_blocks(seq_id, length) <= self.pool.free_blocks

    def grow(self, seq_id, length: int) -> None:
        """Take blocks so that `seq_id` holds `length` positions (a new sequence starts an empty table)."""
        self.tables.setdefault(seq_id, []).extend(self.pool.allocate(self.extra_blocks(seq_id, length)))

    def release(self, seq_id) -> int:
        """The sequence ended or is preempted: its blocks go back to the pool. Returns how many."""
        blocks = self.tables.pop(seq_id, [])
        self.pool.free(blocks)
        return len(blocks)

    def slots(self, seq_id, start: int, count: int) -> np.ndarray:
        """[count] int64: the flat slots (block * block_size + offset) of positions start .. start + count - 1."""
        size, table = self.pool.block_size, self.tables[seq_id]
        positions = np.arange(start, start + count, dtype=np.int64)
        if count and positions[-1] >= len(table) * size:
            raise RuntimeError(f"sequence {seq_id!r}: position {int(positions[-1])} past its {len(table)} blocks "
                               f"(grow it first)")
        return np.asarray(table, dtype=np.int64)[positions // size] * size + positions % size

    def table_array(self, seq_ids: list) -> np.ndarray:
        """[S, max blocks] int32 block tables of `seq_ids`, padded with -1 (what a paged attention kernel reads)."""
        width = max((len(self.tables[s]) for s in seq_ids), default=0)
        out = np.full((len(seq_ids), width), -1, dtype=np.int32)
        for row, s in enumerate(seq_ids):
            out[row, :len(self.tables[s])] = self.tables[s]
        return out
