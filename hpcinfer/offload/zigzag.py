"""FlexGen's zig-zag block schedule (its Algorithm 1) for one pipeline stage of one rank.

A block of `num_gpu_batches` GPU batches (of `gpu_batch_size` sequences) advances one token step at a time; within
a step the loop goes layer by layer and, for each layer, over every GPU batch, so each layer's weights are fetched
once per step for the whole block (prefetching the next layers meanwhile), instead of once per batch as in the
row-by-row schedule of ZeRO-Inference. The KV cache is placed at tensor granularity, as FlexGen places it:
every layer's K (and V) of a GPU batch, [N, Hkv, L, hd], is seen as N * Hkv rows [N * Hkv, L, hd]; the first
R = device_rows(N * Hkv, cache_gpu) rows stay on the device and the rest live in (pinned) host memory, for every
GPU batch alike. A batch with all rows on the device computes on its cache in place (cache_gpu = 100: no copy);
otherwise its rows of a layer are gathered in a device staging buffer before the layer runs (host rows through
the copy engine, device rows by a device copy) and scattered back after, unless `cpu_attention` delegates the
attention over the host rows to the host (FlexGen's CPU delegation): then nothing is staged and every row
attends where it lies, the device rows on the device and the host rows on the host, for which only their
queries (with the step's new K, V) go down and their outputs come up (backend/kv_attention.split_attention: a
row's attention is one sequence, one KV head and its group of query heads, so no softmax merge is needed).
The prompt step is delegated the same way (with cache_gpu = 0 every row attends on the host, as before).
With `[model] kv_cache = "int8" | "int4"` every one of these caches (device, host, staging) holds QuantizedKV parts
(q, scale, min) and the loads and stores move those parts as they are: FlexGen's point of compressing the cache,
~3.8x (int8) and ~7.1x (int4) fewer bytes than float32 at head_dim 64, group 64. Attention dequantizes only the
rows it reads (backend/kv_attention.py), as in the row schedule, so both give the same tokens.
The activations (the hidden states between layers, [T, D] per GPU batch) are placed by `act_gpu` in the same
zig-zag order, stored after each layer and loaded before the next (offload/activations.py).

Shape legend: T tokens of a batch's step, S its running sequences, D hidden.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from ..backend.kv_attention import SplitRows
from ..backend.numpy_ops import NumpyOps
from ..backend.ops import StepLayout
from ..comm.mappings import broadcast_from_tp_root
from ..generate.engine import Sequence, record_token
from ..generate.kv_cache import KVCache
from ..generate.sampling import sample, sequence_rng
from ..parallel.micro_batches import micro_batches
from ..quant.kv import QuantizedKV
from .activations import EMBEDDING, HostActivations
from .budget import device_rows


class HostKV:
    """The KV rows of GPU batches that do not all live on the device: each batch's host rows in (pinned) host
    memory, its device rows (tensor granularity, module docstring) in device arrays, and two device staging
    buffers of one layer they pass through, unless CPU attention attends every row where it lies (no staging;
    `delegated` counts the bytes of the host rows' q, k, v sent down and outputs sent up). A step visits
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
        own = [p for part in (rows.k[layer], rows.v[layer]) for p in _parts(part[window])]
        staged = [p for part in (staging.k[0][:n], staging.v[0][:n])
                  for p in _parts(_as_rows(part)[staged_rows][window])]
        return own, staged


def _as_rows(cache):
    """One layer's K or V of N sequences [N, Hkv, L, X] (each part of a QuantizedKV) as [N Hkv, 1, L, X] rows: a
    view, the arrays are contiguous."""
    flat = lambda a: a.reshape(a.shape[0] * a.shape[1], 1, *a.shape[2:])
    return cache.map(flat) if isinstance(cache, QuantizedKV) else flat(cache)


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
        self.copies = copies

    def zeros(self, shape, dtype=np.float32):
        out = self.copies.host_buffer(shape, dtype)
        out[...] = 0
        return out


def _parts(rows) -> tuple:
    """A float array, or a QuantizedKV's arrays."""
    return rows.parts() if isinstance(rows, QuantizedKV) else (rows,)


def run_block_zigzag(model, prompts, indices, params, times, policy) -> list:
    """Generate for every prompt of the block; returns [(generated ids, finish_reason)] in prompt order.

    The schedule (FlexGen's Algorithm 1; docs/offload.md, Schedules), one action per line in _run_step:
        for token_step: for layer: fetch weights; for gpu_batch: load cache, load activation, compute,
        store activation, store cache; release weights."""
    arch = model.arch
    seqs = [Sequence(i, list(p), min(len(p) + params.max_new_tokens, arch.max_positions),
                     sequence_rng(params.seed, i)) for i, p in zip(indices, prompts)]
    batches = micro_batches(len(seqs), policy.num_gpu_batches)                    # the GPU batches of the block
    max_len = max(s.capacity for s in seqs)
    heads = model.kv_heads_local
    on_device = [b for b, group in enumerate(batches)                             # every row on the device
                 if device_rows(len(group) * heads, policy.cache_gpu) == len(group) * heads]
    caches = {b: KVCache(model.ops, model.num_local_layers, len(batches[b]), heads, max_len, arch.head_dim,
                         kv_format=model.kv_format) for b in on_device}
    host_kv = HostKV(model, {b: len(g) for b, g in enumerate(batches) if b not in caches}, max_len,
                     policy.cpu_attention, policy.cache_gpu)
    memory = model.weights.memory                                                 # tiers.TierMemory
    device_kv = sum(c.nbytes for c in caches.values()) + host_kv.device_bytes
    memory.hold("device", "KV cache", device_kv)                                  # device caches, rows, staging
    memory.hold("host", "KV cache rows", host_kv.host_bytes)
    memory.hold("host", "host attention scratch", host_kv.scratch_bytes(max_len))  # CPU attention: scores (+ K, V)
    acts = HostActivations(model.ops, arch.hidden_size, policy.act_gpu, memory)
    eos = set() if params.ignore_eos else set(arch.eos_token_ids)
    t_start, prefill = time.perf_counter(), 0.0
    for token_step in itertools.count():
        work = _step_work(seqs, batches, first=token_step == 0)                   # gpu_batch -> (slots, layout, ids)
        if not work:
            break
        t0 = time.perf_counter()
        _run_step(model, work, caches, host_kv, acts)
        for gpu_batch, (slots, step, _) in work.items():
            x = acts.load(gpu_batch, model.num_local_layers)                      # the last layer's output [T, D]
            logits = model.logits(x, step)
            _sample_batch(model, [seqs[batches[gpu_batch][s]] for s in slots], logits, params, eos)
        elapsed = time.perf_counter() - t0
        if token_step == 0:
            prefill = elapsed
        else:
            times.decode_s.append(elapsed)
    times.prefill_s += prefill
    times.gen_phase_s += time.perf_counter() - t_start - prefill
    times.busy_s += time.perf_counter() - t_start
    times.prompt_tokens += sum(len(s.prompt) for s in seqs)
    times.generated_tokens += sum(len(s.generated) for s in seqs)
    host_kv.finish()
    acts.finish()
    memory.hold("device", "KV cache", 0)                                          # dropped with the block
    memory.hold("host", "KV cache rows", 0)
    memory.hold("host", "host attention scratch", 0)
    times.kv_peak_device_bytes = max(times.kv_peak_device_bytes, device_kv)
    times.kv_bytes_to_device += host_kv.bytes_to_device
    times.kv_bytes_to_host += host_kv.bytes_to_host
    times.attention_bytes_to_host += host_kv.delegated[0]                       # CPU attention: q, k, v down
    times.attention_bytes_to_device += host_kv.delegated[1]                     # and the outputs up
    times.act_peak_device_bytes = max(times.act_peak_device_bytes, acts.peak_device_bytes)
    times.act_bytes_to_device += acts.bytes_to_device
    times.act_bytes_to_host += acts.bytes_to_host
    return [(s.generated, s.finish_reason) for s in seqs]


def _run_step(model, work: dict, caches: dict, host_kv: HostKV, acts: HostActivations) -> None:
    """One token step of the block through every layer, in the zig-zag order: for each layer, every GPU batch
    (work: gpu_batch -> (slots, step layout, input ids))."""
    rope = {gpu_batch: model.rope_for(step) for gpu_batch, (_, step, _) in work.items()}
    host_kv.begin_step({gpu_batch: step for gpu_batch, (_, step, _) in work.items() if gpu_batch not in caches},
                       model.num_local_layers)
    acts.begin_step({gpu_batch: len(ids) for gpu_batch, (_, _, ids) in work.items()}, model.num_local_layers)
    for gpu_batch, (_, step, ids) in work.items():
        x = model.embed_tokens(ids, step)                                         # compute: [T, D]
        acts.store(gpu_batch, EMBEDDING, x)                                       # store activation: layer 0's input
    for layer in range(model.num_local_layers):
        model.weights.fetch(layer)                                                # load weight, once for the block
        for gpu_batch, (_, step, _) in work.items():
            on_device = gpu_batch in caches
            cache = caches[gpu_batch] if on_device else host_kv.cache_for(gpu_batch, layer)   # load cache
            x = acts.load(gpu_batch, layer)                                       # load activation [T, D]
            y = model.run_layer(layer, x, step, cache, rope[gpu_batch])           # compute [T, D]
            acts.store(gpu_batch, layer, y)                                       # store activation
            if not on_device:
                host_kv.store(gpu_batch, layer)                                   # store cache
        model.weights.release(layer)                                              # streamed layers leave the device


def _step_work(seqs, batches, first: bool) -> dict:
    """For each GPU batch with running sequences: (their slots in the batch, the step layout, the input tokens)."""
    work = {}
    for b, group in enumerate(batches):
        slots = [s for s, i in enumerate(group) if seqs[i].finish_reason is None]
        if not slots:
            continue
        members = [seqs[group[s]] for s in slots]
        if first:
            step = StepLayout.build(slots, [0] * len(slots), [len(q.prompt) for q in members])
            tokens = np.array([t for q in members for t in q.prompt], dtype=np.int64)
        else:
            step = StepLayout.build(slots, [q.length - 1 for q in members], [1] * len(slots))
            tokens = np.array([q.generated[-1] for q in members], dtype=np.int64)
        work[b] = (slots, step, tokens)
    return work


def _sample_batch(model, members, logits, params, eos) -> None:
    chosen = sample(model.ops.to_host(logits), params.sampling, [q.rng for q in members])
    chosen = broadcast_from_tp_root(chosen, model.tp)
    for seq, token in zip(members, chosen.tolist()):
        record_token(seq, token, eos, params.max_new_tokens)
