"""FlexGen's zig-zag block schedule (its Algorithm 1) for one pipeline stage of one rank.

A block of `num_gpu_batches` GPU batches (of `gpu_batch_size` sequences) advances one token step at a time; within
a step the loop goes layer by layer and, for each layer, over every GPU batch, so each layer's weights are fetched
once per step for the whole block (prefetching the next layers meanwhile), instead of once per batch as in the
row-by-row schedule of ZeRO-Inference. A batch's KV cache lives on the device or in host memory
(`cache_gpu` percent of the batches on the device); a host-resident cache is loaded before its batch's layer runs
and stored after, unless `cpu_attention` delegates that attention to the host, which then works on it in place.

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


class HostKV:
    """A GPU batch's KV cache kept in host memory; `load`/`store` move one layer's keys and values."""

    def __init__(self, cache: KVCache):
        self.k = [np.array(cache.ops.to_host(a)) for a in cache.k]
        self.v = [np.array(cache.ops.to_host(a)) for a in cache.v]
        self.bytes_moved = 0

    def load(self, cache: KVCache, i: int) -> None:
        cache.k[i][...] = cache.ops.asarray(self.k[i])
        cache.v[i][...] = cache.ops.asarray(self.v[i])
        self.bytes_moved += int(self.k[i].nbytes) * 2

    def store(self, cache: KVCache, i: int) -> None:
        self.k[i][...] = cache.ops.to_host(cache.k[i])
        self.v[i][...] = cache.ops.to_host(cache.v[i])
        self.bytes_moved += int(self.k[i].nbytes) * 2


def run_block_zigzag(model, prompts, indices, params, times, policy) -> list:
    """Generate for every prompt of the block; returns [(generated ids, finish_reason)] in prompt order."""
    arch = model.arch
    seqs = [Sequence(i, list(p), min(len(p) + params.max_new_tokens, arch.max_positions),
                     sequence_rng(params.seed, i)) for i, p in zip(indices, prompts)]
    batches = micro_batches(len(seqs), policy.num_gpu_batches)                    # the GPU batches of the block
    caches = [KVCache(model.ops, model.num_local_layers, len(b), model.kv_heads_local,
                      max(seqs[s].capacity for s in b), arch.head_dim) for b in batches]
    on_device = round(len(batches) * policy.cache_gpu / 100)
    host_kv = {b: HostKV(caches[b]) for b in range(on_device, len(batches))}      # cache stored in host memory
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
                if b in host_kv and not policy.cpu_attention:
                    host_kv[b].load(caches[b], layer)
                x[b] = model.run_layer(layer, x[b], step, caches[b], rope[b])
                if b in host_kv and not policy.cpu_attention:
                    host_kv[b].store(caches[b], layer)
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
    times.kv_bytes_to_device += sum(h.bytes_moved for h in host_kv.values()) // 2
    times.kv_bytes_to_host += sum(h.bytes_moved for h in host_kv.values()) // 2
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
