"""The continuous schedule's KV store on backends that read a dense cache fastest (NumPy; issue 23).

The scheduler keeps the paged cache's accounting unchanged (generate/block_manager.BlockTables: blocks taken as a
sequence grows, freed when it ends, preemption when the pool is full), so every decision is the same as over the
paged pool. But the rows live in a dense cache, `[slots, Hkv, Lmax, hd]` per layer (generate/kv_cache.KVCache: the
static schedule's own store, float32 or quantized): each running sequence holds one slot from its admission to its
end (`SlotTables`), and a step is the dense StepLayout of its sequences' slots. Attention then runs the static
schedule's own path on it: a sequence's rows are a contiguous view, read by the batched matmuls without a gather
(NumPy's gather of a paged pool, 256-byte rows with np.take, took about half a decode step at 400 positions).

Memory: `running` slots at the share's longest length, as the default pool; the pages of rows never written are
not touched (np.zeros), and the pool's blocks still bound what the running sequences may hold.
"""

from __future__ import annotations

from ..backend.interface import StepLayout
from .block_manager import BlockPool, BlockTables
from .kv_cache import KVCache, KVOffload


class SlotTables(BlockTables):
    """BlockTables that also give each sequence a slot of the dense cache while it holds blocks (the lowest free
    one, taken when its table starts, given back when it is released)."""

    def __init__(self, pool: BlockPool, slots: int):
        super().__init__(pool)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.slot: dict = {}                             # sequence id -> its slot

    def grow(self, seq_id, length: int) -> None:
        if seq_id not in self.slot:
            if not self.free_slots:
                raise RuntimeError(f"sequence {seq_id!r}: every slot of the dense KV store is held (more running "
                                   f"sequences than slots)")
            self.slot[seq_id] = self.free_slots.pop()
        super().grow(seq_id, length)

    def release(self, seq_id) -> int:
        slot = self.slot.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)           # the lowest free slot next
        return super().release(seq_id)


class SlotKVCache:
    """The continuous schedule's cache (the interface of paged_cache.PagedKVCache) over a dense KVCache of
    `slots` sequences of `max_len` positions: the pool's blocks are accounting only."""

    def __init__(self, ops, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 slots: int, max_len: int, kv_format=None, offload: KVOffload | None = None, first_layer: int = 0,
                 largest_step: int = 1):
        self.tables = SlotTables(BlockPool(num_blocks, block_size), slots)
        self.block_size, self.kv_format = block_size, kv_format
        self.dense = KVCache(ops, num_layers, slots, kv_heads, max_len, head_dim, offload, first_layer, largest_step,
                             kv_format=kv_format)
        self.k, self.v = self.dense.k, self.dense.v

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    def row_order(self, seq_id) -> int:
        """A decode step's rows in slot order, so that they are a view of the dense cache (NumpyOps
        ._decode_attention): its slot; after them a sequence that has none yet (a one-token prompt, about to
        take one)."""
        return self.tables.slot.get(seq_id, len(self.tables.free_slots) + len(self.tables.slot))

    def prepare(self, layout: StepLayout) -> None:
        """With a KV offload threshold: the step's slots on the device, the least recently used to the host."""
        self.dense.prepare(layout.slots)

    def layer_step(self, layer: int, step: StepLayout) -> StepLayout:
        return self.dense.layer_step(layer, step)

    def report(self, times) -> None:
        times.kv_bytes_to_host += self.dense.bytes_to_host
        times.kv_bytes_to_device += self.dense.bytes_to_device
        times.kv_peak_device_bytes = max(times.kv_peak_device_bytes, self.nbytes)

    def layout(self, seq_ids: list, starts: list, counts: list) -> StepLayout:
        """The dense step of `seq_ids` over their slots (their tables grown to hold starts + counts positions)."""
        return StepLayout.build([self.tables.slot[s] for s in seq_ids], starts, counts)
