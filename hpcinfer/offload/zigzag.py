"""FlexGen's zig-zag block schedule (its Algorithm 1) for one pipeline stage of one rank.

A block of `num_gpu_batches` GPU batches (of `gpu_batch_size` sequences) advances one token step at a time; within
a step the loop goes layer by layer and, for each layer, over every GPU batch, so each layer's weights are fetched
once per step for the whole block (prefetching the next layers meanwhile), instead of once per batch as in the
row-by-row schedule of ZeRO-Inference. A batch's KV cache lives on the device or in host memory
(`cache_gpu` percent of the batches on the device); a host-resident cache is loaded before its batch's layer runs
and stored after, unless `cpu_attention` delegates that attention to the host, which then works on it in place.
With `[model] kv_cache = "int8" | "int4"` every one of these caches (device, host, staging) holds QuantizedKV parts
(q, scale, min) and the loads and stores move those parts as they are: FlexGen's point of compressing the cache,
~3.8x (int8) and ~7.1x (int4) fewer bytes than float32 at head_dim 64, group 64. Attention dequantizes only the
rows it reads (backend/kv_attention.py), as in the row schedule, so both give the same tokens.

Shape legend: T tokens of a batch's step, S its running sequences, D hidden.
"""

from __future__ import annotations

import time

import numpy as np

from ..backend.ops import StepLayout
from ..comm.mappings import broadcast_from_tp_root
from ..generate.engine import Sequence, record_token
from ..generate.kv_cache import KVCache
from ..generate.sampling import sample, sequence_rng
from ..generate.schedule import micro_batches
from ..quant.kv import QuantizedKV


class HostKV:
    """KV caches of GPU batches that live in host memory, and the one device staging cache they pass through
    (loaded before a batch's layer runs, stored after), unless CPU attention reads them where they are. A quantized
    cache (model.kv_format) moves as its quantized parts; the byte counts are of what moves."""

    def __init__(self, model, sizes: dict, max_len: int, cpu_attention: bool):
        from ..backend.numpy_ops import NumpyOps

        arch = model.arch
        make = lambda ops, n: KVCache(ops, model.num_local_layers, n, model.kv_heads_local, max_len, arch.head_dim,
                                      kv_format=model.kv_format)
        self.host = {b: make(NumpyOps(), n) for b, n in sizes.items()}          # b -> host-resident cache
        self.staging = None if cpu_attention or not sizes else make(model.ops, max(sizes.values()))
        self.bytes_to_device = self.bytes_to_host = 0

    def cache_for(self, b: int, layer: int):
        """The cache the layer computes with: the host one (CPU attention) or the staging one, loaded."""
        host = self.host[b]
        if self.staging is None:
            return host
        for rows, staged in ((host.k[layer], self.staging.k[layer]), (host.v[layer], self.staging.v[layer])):
            staged[:rows.shape[0]] = _moved(rows, self.staging.ops.asarray)
            self.bytes_to_device += int(rows.nbytes)
        return self.staging

    def store(self, b: int, layer: int) -> None:
        if self.staging is None:
            return
        host = self.host[b]
        for rows, staged in ((host.k[layer], self.staging.k[layer]), (host.v[layer], self.staging.v[layer])):
            rows[...] = _moved(staged[:rows.shape[0]], self.staging.ops.to_host)
            self.bytes_to_host += int(rows.nbytes)


def _moved(rows, move):
    """A float array, or a QuantizedKV part by part, through `move` (ops.asarray / ops.to_host)."""
    return rows.map(move) if isinstance(rows, QuantizedKV) else move(rows)


def run_block_zigzag(model, prompts, indices, params, times, policy) -> list:
    """Generate for every prompt of the block; returns [(generated ids, finish_reason)] in prompt order."""
    arch = model.arch
    seqs = [Sequence(i, list(p), min(len(p) + params.max_new_tokens, arch.max_positions),
                     sequence_rng(params.seed, i)) for i, p in zip(indices, prompts)]
    batches = micro_batches(len(seqs), policy.num_gpu_batches)                    # the GPU batches of the block
    max_len = max(s.capacity for s in seqs)
    on_device = round(len(batches) * policy.cache_gpu / 100)
    caches = {b: KVCache(model.ops, model.num_local_layers, len(batches[b]), model.kv_heads_local, max_len,
                         arch.head_dim, kv_format=model.kv_format) for b in range(on_device)}
    host_kv = HostKV(model, {b: len(batches[b]) for b in range(on_device, len(batches))}, max_len,
                     policy.cpu_attention)
    eos = set() if params.ignore_eos else set(arch.eos_token_ids)
    t_start, first, prefill = time.perf_counter(), True, 0.0
    while True:
        work = _step_work(seqs, batches, first)                                   # b -> (seq slots, layout, tokens)
        if not work:
            break
        t0 = time.perf_counter()
        x = {b: model.embed_tokens(tokens, step) for b, (_, step, tokens) in work.items()}
        rope = {b: model.rope_for(step) for b, (_, step, _) in work.items()}
        for layer in range(model.num_local_layers):
            model.weights.fetch(layer)                                            # once for the whole block
            for b, (_, step, _) in work.items():
                cache = caches[b] if b in caches else host_kv.cache_for(b, layer)
                x[b] = model.run_layer(layer, x[b], step, cache, rope[b])
                if b not in caches:
                    host_kv.store(b, layer)
            model.weights.release(layer)
        for b, (slots, step, _) in work.items():
            _sample_batch(model, [seqs[batches[b][s]] for s in slots], model.logits(x[b], step), params, eos)
        elapsed = time.perf_counter() - t0
        if first:
            prefill = elapsed
        else:
            times.decode_s.append(elapsed)
        first = False
    times.prefill_s += prefill
    times.gen_phase_s += time.perf_counter() - t_start - prefill
    times.busy_s += time.perf_counter() - t_start
    times.prompt_tokens += sum(len(s.prompt) for s in seqs)
    times.generated_tokens += sum(len(s.generated) for s in seqs)
    device_kv = sum(c.nbytes for c in caches.values()) + (host_kv.staging.nbytes if host_kv.staging else 0)
    times.kv_peak_device_bytes = max(times.kv_peak_device_bytes, device_kv)
    times.kv_bytes_to_device += host_kv.bytes_to_device
    times.kv_bytes_to_host += host_kv.bytes_to_host
    return [(s.generated, s.finish_reason) for s in seqs]


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
