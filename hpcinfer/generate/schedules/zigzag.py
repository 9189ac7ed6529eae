"""FlexGen's zig-zag block schedule (its Algorithm 1) for one pipeline stage of one rank, as a loop over the
step runner (generate/runner.py); the KV rows it places and moves are generate/host_kv.py's HostKV.

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

from ...backend.interface import StepLayout
from ...offload.activations import EMBEDDING, HostActivations
from ...offload.sizes import device_rows
from ...parallel.micro_batches import micro_batches
from ..host_kv import HostKV
from ..kv_cache import KVCache
from ..runner import Runner


def run_block_zigzag(runner: Runner, prompts, indices, times, policy) -> list:
    """Generate for every prompt of the block; returns [(generated ids, finish_reason)] in prompt order.

    The schedule (FlexGen's Algorithm 1; docs/offload.md, Schedules), one action per line in _run_step:
        for token_step: for layer: fetch weights; for gpu_batch: load cache, load activation, compute,
        store activation, store cache; release weights."""
    model = runner.model
    arch = model.arch
    seqs = runner.sequences(prompts, indices)
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
            runner.sample([seqs[batches[gpu_batch][s]] for s in slots], logits)
        elapsed = time.perf_counter() - t0
        if token_step == 0:
            prefill = elapsed
        else:
            times.decode_s.append(elapsed)
    times.prefill_s += prefill
    times.gen_phase_s += time.perf_counter() - t_start - prefill
    times.busy_s += time.perf_counter() - t_start
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
    return runner.account(seqs, times)


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
        starts, counts, tokens = (Runner.prompt_inputs if first else Runner.decode_inputs)([seqs[group[s]]
                                                                                            for s in slots])
        work[b] = (slots, StepLayout.build(slots, starts, counts), tokens)
    return work
