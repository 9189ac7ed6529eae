"""A dense KV cache of `slots` sequences on one pipeline stage (the slot store's rows, generate/slot_cache.py, and
the zig-zag schedule's caches), with optional offload of idle sequences to host memory.

Without offload, layer i keeps k[i], v[i]: [N sequences, Hkv local, Lmax, hd] and a sequence's slot is its index in
the batch. With `[schedule] kv_offload_threshold` set and the cache larger than it, the layers this rank offloads
(every other layer: even layers on even node-local ranks, odd layers on odd ones, so two ranks sharing a host link
do not move bytes at once; DeepSpeed Inference IV-C) keep only `capacity` slots on the device. A micro-batch's
sequences are given slots before it is computed (`prepare`); when slots run out, the sequences used most recently,
which a round-robin schedule needs last, go to the host store. Device bytes never exceed the threshold.

With `[model] kv_cache = "int8" | "int4"` (a quant.kv.KVFormat), each k[i], v[i] is a QuantizedKV instead of a
float32 array: the same [N, Hkv, Lmax, hd] rows held as packed values + fp16 scale and min per group
(docs/quantization.md). Offload moves those quantized arrays as they are, and every byte count (threshold,
metrics) is of the quantized form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend.interface import StepLayout
from ..errors import ConfigError
from ..quant.kv import KVFormat, QuantizedKV, kv_bytes_per_token, kv_rows


@dataclass(frozen=True)
class KVOffload:
    threshold_bytes: int         # device KV bytes this rank may hold
    parity: int                  # layers with index % 2 == parity are offloadable here (node-local rank % 2)


def plan_offload(num_layers: int, first_layer: int, n_seqs: int, kv_heads: int, max_len: int, head_dim: int,
                 offload: KVOffload | None, largest_micro_batch: int,
                 kv_format: KVFormat | None = None) -> tuple[set, int]:
    """(local layers kept in a pool of slots, pool capacity in sequences). Raises ConfigError when the threshold
    cannot hold one micro-batch. Used by the cache and, before any weight is read, by the runtime's checks."""
    per_seq_layer = kv_bytes_per_token(kv_heads, head_dim, 1, kv_format) * max_len
    if offload is None or n_seqs * num_layers * per_seq_layer <= offload.threshold_bytes:
        return set(), n_seqs
    pooled = {i for i in range(num_layers) if (first_layer + i) % 2 == offload.parity}
    resident_bytes = n_seqs * (num_layers - len(pooled)) * per_seq_layer
    capacity = (offload.threshold_bytes - resident_bytes) // (len(pooled) * per_seq_layer) if pooled else 0
    if not pooled:
        raise ConfigError(
            f"[schedule] kv_offload_threshold = {offload.threshold_bytes} bytes is below the {resident_bytes} bytes "
            f"of KV cache that a rank holding layers {first_layer}..{first_layer + num_layers - 1} keeps on the "
            f"device (it offloads only the layers of its parity, {'odd' if offload.parity else 'even'}); raise it")
    if capacity < largest_micro_batch:
        raise ConfigError(
            f"[schedule] kv_offload_threshold = {offload.threshold_bytes} bytes cannot hold the KV cache of a "
            f"micro-batch of {largest_micro_batch} sequences on a stage with {num_layers} layers "
            f"({resident_bytes} bytes for the layers this rank keeps on the device + "
            f"{largest_micro_batch * len(pooled) * per_seq_layer} for the offloaded ones); raise it, or use more "
            f"micro-batches")
    return pooled, min(capacity, n_seqs)


class KVCache:
    def __init__(self, ops, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 offload: KVOffload | None = None, first_layer: int = 0, largest_micro_batch: int = 1,
                 kv_format: KVFormat | None = None):
        self.ops, self.n_seqs, self.max_len, self.kv_format = ops, slots, max_len, kv_format
        pooled, self.capacity = plan_offload(num_layers, first_layer, slots, kv_heads, max_len, head_dim, offload,
                                             largest_micro_batch, kv_format)
        self.pooled = pooled                                      # local layer indices with `capacity` slots
        shape = lambda i: (self.capacity if i in pooled else slots, kv_heads, max_len, head_dim)
        self.k = [self._zeros(shape(i)) for i in range(num_layers)]
        self.v = [self._zeros(shape(i)) for i in range(num_layers)]
        self.host_k = {i: None for i in pooled}                   # host store, allocated on first eviction
        self.host_v = {i: None for i in pooled}
        self.slot_of = np.arange(slots) if not pooled else np.full(slots, -1, dtype=np.int64)
        self.free = list(range(self.capacity))[::-1] if pooled else []
        self.recent: list[int] = []                               # resident sequences, least recently used first
        self.on_host: set[int] = set()
        self.bytes_to_host = self.bytes_to_device = 0

    def _zeros(self, shape):                                     # one layer's K or V: [N, Hkv, Lmax, hd] rows
        if self.kv_format is None:                               # the backend's float KV dtype ([model] kv_dtype)
            return self.ops.zeros(shape, getattr(self.ops, "kv_dtype", "float32"))
        return QuantizedKV.zeros(self.ops, self.kv_format, shape)

    @property
    def nbytes(self) -> int:
        """Device bytes of the cache (the compute arrays)."""
        return sum(int(a.nbytes) for a in self.k + self.v)

    def prepare(self, seqs) -> None:
        """Give every sequence of the micro-batch about to run a device slot, evicting others if needed."""
        if not self.pooled:
            return
        keep = {int(s) for s in seqs}
        for seq in keep:
            if self.slot_of[seq] < 0:
                self._place(seq, keep)
            else:
                self.recent.remove(seq)
            self.recent.append(seq)

    def layer_step(self, layer: int, step: StepLayout) -> StepLayout:
        """The step with slots that index this layer's arrays (sequence ids, or pool slots for offloaded layers)."""
        if layer not in self.pooled:
            return step
        return StepLayout(self.slot_of[step.slots], step.starts, step.counts)

    def _place(self, seq: int, keep: set) -> None:
        if not self.free:
            victim = next(s for s in reversed(self.recent) if s not in keep)     # most recently used
            self._evict(victim)
        slot = self.free.pop()
        self.slot_of[seq] = slot
        if seq in self.on_host:
            for i in self.pooled:
                self.k[i][slot] = kv_rows(self.host_k[i][seq]).map(self.ops.asarray)
                self.v[i][slot] = kv_rows(self.host_v[i][seq]).map(self.ops.asarray)
                self.bytes_to_device += int(self.k[i][slot].nbytes) * 2

    def _evict(self, seq: int) -> None:
        slot = int(self.slot_of[seq])
        for i in self.pooled:
            if self.host_k[i] is None:
                self.host_k[i] = _host_zeros(self.k[i], self.n_seqs)
                self.host_v[i] = _host_zeros(self.v[i], self.n_seqs)
            self.host_k[i][seq] = kv_rows(self.k[i][slot]).map(self.ops.to_host)
            self.host_v[i][seq] = kv_rows(self.v[i][slot]).map(self.ops.to_host)
            self.bytes_to_host += int(self.k[i][slot].nbytes) * 2
        self.on_host.add(seq)
        self.recent.remove(seq)
        self.slot_of[seq] = -1
        self.free.append(slot)


def _host_zeros(like, n: int):
    """A host store of n sequences shaped like one layer's device K or V (float array or QuantizedKV), in its
    dtypes."""
    return kv_rows(like).map(lambda a: np.zeros((n, *a.shape[1:]), a.dtype))
