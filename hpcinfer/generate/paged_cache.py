"""The paged KV cache of the continuous schedule (issue 21; vLLM's PagedAttention): one pool of fixed-size blocks
per rank and local layer, k[i], v[i] [num_blocks, Hkv local, block_size, hd] in the backend's float KV dtype
(`ops.kv_dtype`: float32, or on the GPU `[model] kv_dtype`) (or, with `[model] kv_cache`
int8 / int4, a quant.kv.QuantizedKV of that logical shape: the dense cache's rows, in blocks), and a block table
per running sequence (generate/block_manager.py). A step over it is a StepLayout.paged; the backends' attention appends the
step's rows at their blocks and reads each sequence's positions through its table (backend/paged_attention.py).

The pool's size is `[schedule] kv_cache_memory` (bytes, or a share of the memory left after the weights), or by
default what batch_size sequences need at their longest: then the running set never outgrows it.
"""

from __future__ import annotations

from ..backend.interface import StepLayout
from ..quant.kv import QuantizedKV, kv_bytes_per_token
from .block_manager import BlockPool, BlockTables



def block_bytes(num_layers: int, kv_heads: int, block_size: int, head_dim: int, kv_format=None) -> int:
    """Bytes of one block across this rank's layers: K and V, float32 or quantized rows (kv_format:
    quant.kv.KVFormat or None)."""
    return kv_bytes_per_token(kv_heads, head_dim, num_layers, kv_format) * block_size


def supports(kv_cache: str = "none", attention_topk: float = 0.0) -> list[str]:
    """Why the paged cache cannot hold this job's KV (empty: it can), as the continuous schedule asks
    (schedules/continuous.unsupported): every `[model] kv_cache` format is stored in blocks and every
    `[generate] attention_topk` reads them (backend/paged_attention.through_dense), so none today; the seam
    stays for formats to come."""
    return []


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
        self.tables = BlockTables(BlockPool(num_blocks, block_size))
        self.block_size = block_size
        self.kv_format = kv_format
        self.spare_block = num_blocks            # one block past the pool's: where padding rows write, never read
        shape = (num_blocks + 1, kv_heads, block_size, head_dim)
        self.k = [_pool(ops, shape, kv_format) for _ in range(num_layers)]
        self.v = [_pool(ops, shape, kv_format) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.k + self.v)

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    def row_order(self, seq_id) -> int:
        """Where a sequence's decode row is best placed in a step (the scheduler sorts by it; stable): any."""
        return 0

    def prepare(self, layout: StepLayout) -> None:
        """(the pool stays on the device)"""

    def layer_step(self, layer: int, step: StepLayout) -> StepLayout:
        """Every layer reads the same tables."""
        return step

    def report(self, times) -> None:
        times.kv_peak_device_bytes = max(times.kv_peak_device_bytes, self.nbytes)     # the pool, allocated whole

    def layout(self, seq_ids: list, starts: list, counts: list) -> StepLayout:
        """The paged step of `seq_ids` (their tables grown to hold starts + counts positions)."""
        return StepLayout.paged(self.tables.table_array(seq_ids), self.block_size, starts, counts)


def _pool(ops, shape: tuple, kv_format):
    """One layer's K (or V) pool [blocks, Hkv, bs, hd]: zeros of the backend's float KV dtype ([model] kv_dtype:
    float32 on NumPy), or a QuantizedKV of zeros (the dense quantized cache's arrays with slots = blocks and
    positions = a block's rows)."""
    if kv_format is None:
        return ops.zeros(shape, getattr(ops, "kv_dtype", "float32"))
    return QuantizedKV.zeros(ops, kv_format, shape)
