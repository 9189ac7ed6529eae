"""The KV rows of the zig-zag block schedule's GPU batches that do not all live on the device (FlexGen's tensor-
granularity placement, `[offload] cache_gpu`): device rows, (pinned) host rows, and the staging buffers they pass
through, or CPU attention over the host rows where they lie. generate/schedules/zigzag.py drives it; its
docstring says how the rows are placed and moved.
"""

from __future__ import annotations

import numpy as np

from ..backend.kv_attention import SplitRows
from ..backend.numpy_ops import NumpyOps
from ..offload.sizes import device_rows
from ..quant.kv import kv_rows
from .kv_cache import KVCache


class HostKV:
    """The KV rows of GPU batches that do not all live on the device: each batch's host rows in (pinned) host
    memory, its device rows (tensor granularity: generate/schedules/zigzag.py's docstring) in device arrays, and
    two device staging buffers of one layer they pass through, unless CPU attention attends every row where it
    lies (no staging; `delegated` counts the bytes of the host rows' q, k, v sent down and outputs sent up). A step visits
    (layer, batch) pairs in the zig-zag order; pair k is loaded into staging buffer k % 2 while pair k - 1 computes
    in the other, and stored back after it ran (on a GPU: host rows on the copy stream, ordered by events,
    backend/cupy_transfer.py; device rows by a device copy on the compute stream), so the loads of the next
    batch's cache and the stores of the previous one overlap the current compute. Only the positions that matter
    move, as FlexGen moves them: a load brings the positions cached before the step ([0, max start)), a store takes
    back the positions the step wrote ([min start, max end)); positions of a buffer past a sequence's own length
    hold another batch's rows and are never read (attention reads [0, length) and appends before it reads). A
    quantized cache (model.kv_format) moves as its quantized parts; the byte counts are of what crosses the link
    (the host rows)."""

    def __init__(self, model, sizes: dict, max_len: int, cpu_attention: bool, cache_gpu: float = 0.0):
        arch, heads = model.arch, model.kv_heads_local
        make = lambda ops, layers, n, h=heads: KVCache(ops, layers, n, h, max_len, arch.head_dim,
                                                       kv_format=model.kv_format)
        self.copies = model.ops.copy_engine()
        host_ops = PinnedHostOps(self.copies)
        self.sizes, self.heads = dict(sizes), heads                             # b -> sequences N
        self.device_rows = {b: device_rows(n * heads, cache_gpu) for b, n in sizes.items()}   # b -> R
        self.cpu_attention, self.quantized = cpu_attention, model.kv_format is not None
        self.group, self.head_dim = model.arch.num_heads // model.arch.num_kv_heads, arch.head_dim
        self.host = {b: make(host_ops, model.num_local_layers, n * heads - self.device_rows[b], 1)
                     for b, n in sizes.items()}                                  # b -> [N Hkv - R, 1, L, hd] rows
        self.device = {b: make(model.ops, model.num_local_layers, r, 1)          # b -> [R, 1, L, hd] rows
                       for b, r in self.device_rows.items() if r > 0}
        self.staging = [] if cpu_attention or not sizes else \
            [make(model.ops, 1, max(sizes.values())) for _ in range(2)]         # one layer of the largest batch
        self.delegated = [0, 0]                         # CPU attention: bytes of q, k, v down and outputs up
        self.order: list = []                           # this step's (layer, b) pairs, in the order they run
        self.windows: dict = {}                         # b -> (load positions, store positions) of this step
        self.loads: dict = {}                           # pair index -> the uploads into its staging buffer
        self.stores: dict = {}                          # (layer, b) -> the downloads of its last store
        self.stored_from: dict = {}                     # staging buffer -> the downloads last issued from it
        self.cursor = -1                                # index in `order` of the pair computing now
        self.bytes_to_device = self.bytes_to_host = 0

    @property
    def staging_bytes(self) -> int:
        return sum(c.nbytes for c in self.staging)

    @property
    def device_bytes(self) -> int:
        """Device bytes of the KV cache here: the device rows and the staging buffers."""
        return sum(c.nbytes for c in self.device.values()) + self.staging_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes of the KV cache here: the host rows (the whole caches with CPU attention)."""
        return sum(c.nbytes for c in self.host.values())

    def scratch_bytes(self, max_len: int) -> int:
        """CPU attention's host scratch at its largest (budget.host_attention_bytes): the float32 scores of the
        batch with the most host rows [rows, g, max_len] and, for a quantized cache, its dequantized K and V."""
        if not self.cpu_attention or not self.host:
            return 0
        rows = max(c.k[0].shape[0] for c in self.host.values())
        dequantized = 2 * self.head_dim if self.quantized else 0
        return rows * max_len * (self.group + dequantized) * 4

    def begin_step(self, steps: dict, num_layers: int) -> None:
        """The batches here that run this step ({b: its StepLayout}, in the loop's order): their windows; load the
        first pair."""
        self.windows = {b: (slice(0, int(step.starts.max())),
                            slice(int(step.starts.min()), int((step.starts + step.counts).max())))
                        for b, step in steps.items()}
        self.order = [(layer, b) for layer in range(num_layers) for b in steps]
        self.cursor = -1
        if self.staging and self.order:
            self._start_load(0)

    def cache_for(self, b: int, layer: int):
        """The cache the layer computes with: its device and host rows where they lie (CPU attention: the device
        rows attend on the device, the host rows on the host, kv_attention.split_attention) or its staging
        buffer, loaded (the next pair's load starts now, into the other buffer)."""
        if self.cpu_attention:
            return _SplitView(self.device.get(b), self.host[b], layer, self.heads, self.delegated)
        self.cursor += 1
        assert self.order[self.cursor] == (layer, b), f"zig-zag KV out of order: {(layer, b)}"
        for copy in self.stored_from.pop(self.cursor % 2, []) + self.loads.pop(self.cursor):
            copy.fence()                                # the compute waits for the buffer's last store (a prompt
                                                        # step loads nothing) and its load; the host does not
        if self.windows[b][0].stop > 0:                 # the device rows: a device copy on the compute stream
            for device, staged in zip(*self._device_rows(layer, b, self.cursor % 2, self.windows[b][0])):
                staged[...] = device
        if self.cursor + 1 < len(self.order):
            self._start_load(self.cursor + 1)
        return _LayerView(self.staging[self.cursor % 2], layer)

    def store(self, b: int, layer: int) -> None:
        """Copy the layer's rows of batch b back: device rows to their device arrays (after the compute issued so
        far, on its stream), host rows to the host cache (the copy engine); nothing with CPU attention (every row
        was written where it lies)."""
        if self.cpu_attention:
            return
        slot, positions = self.cursor % 2, self.windows[b][1]
        for device, staged in zip(*self._device_rows(layer, b, slot, positions)):
            device[...] = staged
        host, staged = self._host_rows(layer, b, slot, positions)
        self.stores[layer, b] = [self.copies.download(d, h) for d, h in zip(staged, host)]
        self.stored_from[slot] = self.stores[layer, b]
        self.bytes_to_host += sum(int(h.nbytes) for h in host)

    def finish(self) -> None:
        """Wait for the stores in flight and the copy stream (the block is done)."""
        for downloads in self.stores.values():
            for download in downloads:
                download.wait()
        self.stores.clear()
        self.copies.close()

    def _start_load(self, k: int) -> None:
        layer, b = self.order[k]
        for download in self.stores.pop((layer, b), []):  # the host rows are whole again (a step ago: done)
            download.wait()
        host, staged = self._host_rows(layer, b, k % 2, self.windows[b][0])
        loads = self.windows[b][0].stop > 0                # a prompt step has nothing cached yet
        self.loads[k] = [self.copies.upload_into(d, h) for d, h in zip(staged, host)] if loads else []
        self.bytes_to_device += sum(int(h.nbytes) for h in host)

    def _host_rows(self, layer: int, b: int, slot: int, positions: slice) -> tuple[list, list]:
        """(host arrays, staging arrays) of batch b's host K and V rows of `layer` at `positions`, part by part:
        [N Hkv - R, 1, positions, hd] windows (quantized: each part's)."""
        return self._pairs(self.host[b], layer, b, slot, positions, slice(self.device_rows[b], None))

    def _device_rows(self, layer: int, b: int, slot: int, positions: slice) -> tuple[list, list]:
        """(device arrays, staging arrays) of batch b's device rows of `layer` at `positions`: [R, 1, positions,
        hd] windows, part by part; empty when R = 0."""
        if b not in self.device:
            return [], []
        return self._pairs(self.device[b], layer, b, slot, positions, slice(0, self.device_rows[b]))

    def _pairs(self, rows: KVCache, layer: int, b: int, slot: int, positions: slice, staged_rows: slice):
        window = (slice(None), slice(None), positions)
        staging, n = self.staging[slot], self.sizes[b]
        own = [p for part in (rows.k[layer], rows.v[layer]) for p in kv_rows(part[window]).parts()]
        staged = [p for part in (staging.k[0][:n], staging.v[0][:n])
                  for p in kv_rows(_as_rows(part)[staged_rows][window]).parts()]
        return own, staged


def _as_rows(cache):
    """One layer's K or V of N sequences [N, Hkv, L, X] (each part of a QuantizedKV) as [N Hkv, 1, L, X] rows: a
    view, the arrays are contiguous."""
    flat = lambda a: a.reshape(a.shape[0] * a.shape[1], 1, *a.shape[2:])
    return kv_rows(cache).map(flat)


class _SplitView:
    """A batch's device and host rows standing for its whole cache in model.run_layer(layer, ...) with CPU
    attention: that layer's K and V as kv_attention.SplitRows."""

    def __init__(self, device: KVCache | None, host: KVCache, layer: int, kv_heads: int, link: list):
        split = lambda name: SplitRows(None if device is None else getattr(device, name)[layer],
                                       getattr(host, name)[layer], kv_heads, link)
        self.k, self.v = {layer: split("k")}, {layer: split("v")}

    def layer_step(self, layer: int, step):
        return step


class _LayerView:
    """A staging buffer standing for a batch's whole cache in model.run_layer(layer, ...): it holds that layer."""

    def __init__(self, staging: KVCache, layer: int):
        self.k, self.v = {layer: staging.k[0]}, {layer: staging.v[0]}

    def layer_step(self, layer: int, step):
        return step


class PinnedHostOps(NumpyOps):
    """NumPy ops whose arrays are the copy engine's host buffers (pinned on a GPU): the host KV caches."""

    def __init__(self, copies):
        super().__init__()
        self.copies = copies

    def zeros(self, shape, dtype=np.float32):
        out = self.copies.host_buffer(shape, dtype)
        out[...] = 0
        return out
