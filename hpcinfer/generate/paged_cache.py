"""The paged KV cache of the continuous schedule (issue 21; vLLM's PagedAttention): one pool of fixed-size blocks
per rank and local layer, k[i], v[i] [num_blocks, Hkv local, block_size, hd] float32, and a block table per running
sequence (generate/block_manager.py). A step over it is a StepLayout.paged; the backends' attention appends the
step's rows at their blocks and reads each sequence's positions through its table (backend/paged_attention.py).

The pool's size is `[schedule] kv_cache_memory` (bytes, or a share of the memory left after the weights), or by
default what batch_size sequences need at their longest: then the running set never outgrows it.
"""

from __future__ import annotations

import numpy as np

from ..backend.interface import StepLayout
from ..quant.kv import kv_bytes_per_token
from .block_manager import BlockPool, BlockTables

F32 = np.float32


def block_bytes(num_layers: int, kv_heads: int, block_size: int, head_dim: int, kv_format=None) -> int:
    """Bytes of one block across this rank's layers: K and V, float32 (kv_format: quant.kv.KVFormat or None)."""
    if kv_format is not None:
        raise NotImplementedError("quantized KV rows in paged blocks")
    return kv_bytes_per_token(kv_heads, head_dim, num_layers) * block_size


def supports(kv_cache: str = "none", attention_topk: float = 0.0) -> list[str]:
    """Why the paged cache cannot hold this job's KV (empty: it can): `[model] kv_cache` and
    `[generate] attention_topk`, as the continuous schedule asks (schedules/continuous.unsupported)."""
    why = []
    if kv_cache != "none":
        why.append(f"model.kv_cache = {kv_cache!r} is not stored in blocks yet")
    if 0 < attention_topk < 1:
        why.append("generate.attention_topk reads the dense cache")
    return why


def pool_blocks(nbytes: int, per_block: int, batch_size: int, longest: int, block_size: int) -> int:
    """Blocks of the pool: `nbytes` ([schedule] kv_cache_memory resolved, config.ScheduleSection.kv_memory_bytes)
    over `per_block`; 0 = batch_size sequences of `longest` positions."""
    if nbytes == 0:
        return batch_size * -(-longest // block_size)
    return nbytes // per_block


class PagedKVCache:
    """One rank's paged KV pool over its local layers and the running sequences' block tables."""

    def __init__(self, ops, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 kv_format=None):
        if kv_format is not None:
            raise NotImplementedError("quantized KV rows in paged blocks")
        self.tables = BlockTables(BlockPool(num_blocks, block_size))
        self.block_size = block_size
        self.kv_format = kv_format
        self.spare_block = num_blocks            # one block past the pool's: where padding rows write, never read
        shape = (num_blocks + 1, kv_heads, block_size, head_dim)
        self.k = [ops.zeros(shape, F32) for _ in range(num_layers)]
        self.v = [ops.zeros(shape, F32) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.k + self.v)

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    def layer_step(self, layer: int, step: StepLayout) -> StepLayout:
        """Every layer reads the same tables (Decoder.run_layer asks the dense cache for per-layer slots)."""
        return step

    def layout(self, seq_ids: list, starts: list, counts: list) -> StepLayout:
        """The paged step of `seq_ids` (their tables grown to hold starts + counts positions)."""
        return StepLayout.paged(self.tables.table_array(seq_ids), self.block_size, starts, counts)
