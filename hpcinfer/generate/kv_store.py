"""The KV store (ARCHITECTURE.md, "KV store"): the one interface every schedule's cache offers the model and the
scheduler (`KVStore`), and the one place a rank's store is built (`build`, called by the Runner, which owns it).

A store holds, per local layer, K and V rows (`k[i]`, `v[i]`: float32 arrays, or quant.kv.QuantizedKV of the same
logical shape; the model reads both alike) and the running sequences' block tables over one pool of blocks (the
scheduler's accounting: blocks taken as a sequence grows, freed when it ends, preemption when the pool is full).
Two layouts of the rows implement it:
  - paged (generate/paged_cache.PagedKVCache): the rows are the pool's blocks, attention reads through the tables;
  - slots (generate/slot_cache.SlotKVCache): each running sequence's rows are one contiguous slot of a dense
    cache, so attention reads a view (NumPy: a gather of 256-byte rows cost half a decode step), and the slots of
    the layers a rank offloads may move to host memory (`[schedule] kv_offload_threshold`, DeepSpeed's KV offload
    by layer parity).
"""

from __future__ import annotations

from typing import Protocol

from ..backend.interface import StepLayout
from .block_manager import BlockPool, BlockTables
from .kv_cache import KVOffload
from .paged_cache import PagedKVCache
from .slot_cache import SlotKVCache


class KVStore(Protocol):
    k: list                  # per local layer: K rows (float32 array or QuantizedKV)
    v: list                  # ... and V rows
    kv_format: object        # quant.kv.KVFormat, or None for float32
    tables: BlockTables      # the running sequences' block tables

    @property
    def pool(self) -> BlockPool: ...                       # the blocks the tables take (tables.pool)

    @property
    def nbytes(self) -> int: ...                           # device bytes of the rows

    def row_order(self, seq_id) -> int: ...                # where a decode row reads fastest (the scheduler sorts)

    def layout(self, seq_ids: list, starts: list, counts: list) -> StepLayout: ...    # a step over the store

    def prepare(self, layout: StepLayout) -> None: ...     # the step's rows on the device before it runs

    def layer_step(self, layer: int, step: StepLayout) -> StepLayout: ...   # the step as layer `layer` reads it

    def report(self, times) -> None: ...                   # its counters into a StepTimes


def build(model, blocks: int, block_size: int, running: int, longest: int,
          offload: KVOffload | None = None, largest_step: int = 1) -> KVStore:
    """This rank's store over its local layers: `blocks` blocks of `block_size` positions for at most `running`
    sequences of at most `longest` positions (a step holds at most `largest_step` of them: what a KV offload
    threshold must keep on the device). Slots where the backend reads a dense cache fastest
    (Ops.continuous_kv = "slots": NumPy) or where KV moves to host memory (`offload`); else the paged pool."""
    shape = (model.ops, model.num_local_layers, blocks, model.kv_heads_local, block_size, model.arch.head_dim)
    if getattr(model.ops, "continuous_kv", "blocks") == "slots" or offload is not None:
        return SlotKVCache(*shape, running, longest, model.kv_format, offload, model.stage.first_layer,
                           largest_step)
    return PagedKVCache(*shape, model.kv_format)
