"""The activations of the zig-zag schedule at tensor granularity (FlexGen Section 4.2, `act_gpu` / `act_cpu`).

The activations are the hidden states x [T_b, D] between the layers of each GPU batch b of a block (T_b: the
batch's tokens this step, its prompt tokens in the prefill step and its running sequences in a decode step). Of
each batch's T_b rows, R_b = device_rows(T_b, act_gpu) stay on the device and rows [R_b:] live in (pinned) host
memory, FlexGen's load_activation / store_activation of its Algorithm 1:
- after batch b's layer l ran (or its embedding, layer 0's input), its device rows go to their device array (a
  device copy) and its host rows to the host buffer (the copy engine, asynchronous);
- before batch b's layer l + 1 runs (or its logits, after the last layer), its rows come back into one of two
  device staging buffers [max_b T_b, D]: host rows through the copy engine, prefetched one (layer, batch) pair
  ahead in the zig-zag order (as HostKV loads the cache), device rows by a device copy. The layer computes on the
  staging buffer while the next pair loads into the other (with one GPU batch the next pair's input is the output
  of the one computing: its load follows that store, FlexGen's single-batch loop does not overlap it either).
With act_gpu = 100 (every row on the device) nothing moves: the layer outputs are held as they are, the old path.
The mode is fixed per block by its prefill step (the peak: a decode step has fewer rows, so fewer host rows).
Bytes over the link per step, each way: (num_layers + 1) x sum_b (T_b - R_b) D s (s: the float32 compute dtype).

Shape legend: T tokens of a batch's step, R its device rows, D hidden.
"""

from __future__ import annotations

import numpy as np

from .sizes import device_rows

EMBEDDING = -1                                   # the "layer" whose output is layer 0's input


class HostActivations:
    """The hidden states of a block's GPU batches between layers, placed by `act_gpu` (module docstring). A step
    is begin_step, then store(b, EMBEDDING, x) per batch, then per (layer, b) in the zig-zag order load(b, layer)
    and store(b, layer, output), then load(b, num_layers) for the logits."""

    def __init__(self, ops, hidden: int, act_gpu: float, memory=None):
        self.ops, self.hidden, self.act_gpu = ops, hidden, act_gpu
        self.memory = memory                      # tiers.TierMemory: "activations" / "activation rows", or None
        self.staged = None                        # None until the prefill step: True when any row is on the host
        self.copies = None
        self.held: dict = {}                      # all on the device: b -> x [T, D] as the layer returned it
        self.device: dict = {}                    # staged: b -> [R, D] device rows (prefill size)
        self.host: dict = {}                      # staged: b -> [T - R, D] host rows (prefill size)
        self.staging: list = []                   # staged: two [max_b T_b, D] device buffers
        self.rows: dict = {}                      # b -> (T, R) this step
        self.order: list = []                     # this step's (layer, b) loads, in the order they run
        self.cursor = -1                          # index in `order` of the pair computing now
        self.loads: dict = {}                     # pair index -> its uploads in flight
        self.stores: dict = {}                    # b -> the downloads of its last store
        self.stored: set = set()                  # (layer, b) stored this step
        self.bytes_to_device = self.bytes_to_host = 0
        self.peak_device_bytes = 0

    @property
    def device_bytes(self) -> int:
        """Device bytes of the activations now: the held outputs, or the device rows and the staging buffers."""
        if not self.staged:
            return sum(int(x.nbytes) for x in self.held.values())
        return sum(int(a.nbytes) for a in self.device.values()) + sum(int(a.nbytes) for a in self.staging)

    @property
    def host_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.host.values())

    def begin_step(self, tokens: dict, num_layers: int) -> None:
        """The batches that run this step, {b: T_b} in the loop's order (the first step sizes the buffers)."""
        self.rows = {b: (t, device_rows(t, self.act_gpu)) for b, t in tokens.items()}
        if self.staged is None:
            self._allocate()
        self.order = [(layer, b) for layer in range(num_layers + 1) for b in tokens]   # layer num_layers: logits
        self.cursor, self.loads, self.stored, self.held = -1, {}, set(), {}
        if not self.staged:
            self._count()                                  # last step's outputs are dropped

    def store(self, b: int, layer: int, x) -> None:
        """Batch b's output of `layer` (EMBEDDING: of its embedding), x [T, D]: kept, or split to its tiers."""
        if not self.staged:
            self.held[b] = x
            self._count()
            return
        if layer != EMBEDDING:
            assert self.order[self.cursor] == (layer, b), f"zig-zag activations out of order: {(layer, b)}"
        t, r = self.rows[b]
        if r:
            self.device[b][:r] = x[:r]                                            # device copy, compute stream
        for download in self.stores.pop(b, []):                                   # none: its load waited
            download.wait()
        self.stores[b] = [self.copies.download(x[r:t], self.host[b][:t - r])] if t > r else []
        self.bytes_to_host += (t - r) * int(x.itemsize) * self.hidden
        self.stored.add((layer, b))
        self._prefetch()

    def load(self, b: int, layer: int):
        """Batch b's input of `layer` (num_layers: of its logits), [T, D]: held, or gathered in a staging buffer."""
        if not self.staged:
            return self.held[b]
        self.cursor += 1
        assert self.order[self.cursor] == (layer, b), f"zig-zag activations out of order: {(layer, b)}"
        for upload in self.loads.pop(self.cursor):
            upload.fence()                                                        # the compute waits for it
        t, r = self.rows[b]
        staging = self.staging[self.cursor % 2]
        if r:
            staging[:r] = self.device[b][:r]                                      # device copy, compute stream
        self._prefetch()                                  # the next pair, into the other buffer (if its source is)
        return staging[:t]

    def finish(self) -> None:
        """Wait for the stores in flight and the copy stream (the block is done)."""
        for downloads in self.stores.values():
            for download in downloads:
                download.wait()
        self.stores.clear()
        if self.copies is not None:
            self.copies.close()
        if self.memory is not None:                                # the block's buffers are dropped with it
            self.memory.hold("device", "activations", 0)
            self.memory.hold("host", "activation rows", 0)

    def _count(self) -> None:
        """The device bytes now, into the peak and the tiers' counter."""
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        if self.memory is not None:
            self.memory.hold("device", "activations", self.device_bytes)

    def _allocate(self) -> None:
        """At the prefill step (the most rows): staged when any batch has host rows; then its buffers."""
        self.staged = any(t > r for t, r in self.rows.values())
        if not self.staged:
            return
        self.copies = self.ops.copy_engine()
        self.device = {b: self.ops.zeros((r, self.hidden)) for b, (t, r) in self.rows.items()}
        self.host = {b: self.copies.host_buffer((t - r, self.hidden), np.float32) for b, (t, r) in self.rows.items()}
        widest = max(t for t, _ in self.rows.values())
        self.staging = [self.ops.zeros((widest, self.hidden)) for _ in range(2)]
        self._count()
        if self.memory is not None:
            self.memory.hold("host", "activation rows", self.host_bytes)

    def _prefetch(self) -> None:
        """Start the host rows' upload of the pair after the one computing, into the staging buffer not computing,
        once its source (the batch's previous layer) is stored."""
        k = self.cursor + 1
        if k >= len(self.order) or k in self.loads:
            return
        layer, b = self.order[k]
        if (layer - 1 if layer > 0 else EMBEDDING, b) not in self.stored:
            return
        for download in self.stores.pop(b, []):           # the host rows are whole again (usually long done)
            download.wait()
        t, r = self.rows[b]
        staged = self.staging[k % 2][r:t]
        self.loads[k] = [self.copies.upload_into(staged, self.host[b][:t - r])] if t > r else []
        self.bytes_to_device += (t - r) * int(staged.itemsize) * self.hidden
