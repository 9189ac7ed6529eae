"""Continuous batching over a paged KV cache (issue 21; vLLM's scheduler, Sarathi's chunked prefill), one
data-parallel replica at a time, as a loop over the step runner (generate/runner.py).

A running set of at most `batch_size` sequences. Each step packs, up to `max_batch_tokens`, first one decode token
of every running sequence whose prompt is in the cache, then chunks of the prompts still being prefilled, in the
order they were admitted (a long prompt takes several steps; decode tokens are never starved by prefill). A
sequence samples its next token when the step has fed all its tokens; one that finishes gives its KV blocks back at
once, and the next waiting prompt enters at the next step. When the pool cannot hold a step's new positions, the
most recently admitted running sequence is preempted: its blocks are freed and it goes back to the front of the
queue, to be prefilled again (prompt + what it generated) when it re-enters; its sampled tokens and its generator
are kept, so preemption never changes a token.

Every tp rank of a replica runs this loop with the same inputs and the same sampled tokens (Runner.sample
broadcasts them), so all of them take the same decisions. MoE replicas exchange tokens in every MoE layer
(`lockstep`, the dp group): each runs its own running set, but all of them step together, a replica with nothing
to run taking part with an empty step, until none has work left. Shape legend: S=sequences in a step, T=its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ..engine import Sequence, StepTimes
from ..paged_cache import PagedKVCache, supports as paged_supports
from ..runner import Runner


@dataclass(frozen=True)
class ContinuousParams:
    batch_size: int          # running sequences at most ([generate] batch_size)
    max_batch_tokens: int    # tokens per step ([schedule] max_batch_tokens, >= batch_size)


@dataclass
class _Running:
    seq: Sequence
    computed: int = 0        # positions of prompt + generated whose K and V are in the pool

    @property
    def tokens(self) -> list:
        return self.seq.prompt + self.seq.generated

    @property
    def pending(self) -> int:
        """Tokens still to feed before the next sample (1 for a decode step)."""
        return self.seq.length - self.computed


class ContinuousScheduler:
    """The running set, the queue and the pool of one replica; `run` steps until both are empty (or `after_step`
    says stop). `after_step(finished sequences) -> bool` runs after every step, on every rank of the replica."""

    def __init__(self, runner: Runner, cache: PagedKVCache, seqs: list, params: ContinuousParams,
                 times: StepTimes, after_step=lambda finished: False, name=lambda index: f"prompt {index}",
                 lockstep=None, graphs=None):
        self.runner, self.cache, self.params, self.times = runner, cache, params, times
        self.graphs = graphs                            # captured decode steps over `cache` (generate/graphs.py)
        self.lockstep = lockstep                        # the dp group when MoE replicas step together, else None
        self.waiting: deque = deque(seqs)
        self.running: list[_Running] = []               # admission order
        self.after_step = after_step
        pool = cache.pool
        for seq in seqs:                                # a sequence the pool cannot hold alone: a set-up error
            if cache.tables.blocks_for(seq.capacity) > pool.num_blocks:
                raise ConfigError(f"{name(seq.index)}: {seq.capacity} positions (prompt {len(seq.prompt)} + "
                                  f"max_new_tokens) need {cache.tables.blocks_for(seq.capacity)} KV blocks of "
                                  f"{pool.block_size}, the pool has {pool.num_blocks}: raise "
                                  f"[schedule] kv_cache_memory")

    def run(self) -> None:
        while self._any_work():
            self._admit()
            plan = self._plan()
            finished = self._step(plan) if plan or self.lockstep is not None else []
            if self.after_step(finished):
                return

    def _any_work(self) -> bool:
        """This replica has sequences left; in lockstep, any replica has (every replica asks at every step)."""
        mine = bool(self.waiting or self.running)
        if self.lockstep is None:
            return mine
        return bool(self.lockstep.all_gather(np.array([mine], dtype=np.int64)).max())

    # ---- decisions -------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.params.batch_size:
            self.running.append(_Running(self.waiting.popleft()))

    def _plan(self) -> list[tuple[_Running, int]]:
        """[(sequence, tokens to feed)] of the next step, its blocks allocated: decode tokens first, then prompt
        chunks in admission order, up to max_batch_tokens; preempts (newest first) when the pool runs out."""
        budget = self.params.max_batch_tokens
        decode = [r for r in self.running if r.pending == 1]
        prefill = [r for r in self.running if r.pending > 1]
        plan = []
        for r in decode + prefill:
            if budget == 0:
                break
            if r not in self.running:                      # preempted while planning this step
                continue
            count = min(r.pending, budget)
            if not self._reserve(r, r.computed + count):
                continue                                   # r itself was preempted
            plan.append((r, count))
            budget -= count
        return [(r, n) for r, n in plan if r in self.running]

    def _reserve(self, r: _Running, length: int) -> bool:
        """Blocks for `length` positions of r, preempting the newest running sequences until they fit; False when
        r is the newest and had to go itself."""
        tables = self.cache.tables
        while not tables.can_grow(r.seq.index, length):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        tables.grow(r.seq.index, length)
        return True

    def _preempt(self, r: _Running) -> None:
        self.cache.tables.release(r.seq.index)
        self.running.remove(r)
        r.computed = 0
        self.waiting.appendleft(r.seq)
        self.times.preemptions += 1

    # ---- one step --------------------------------------------------------------------------------------------
    def _step(self, plan: list[tuple[_Running, int]]) -> list[Sequence]:
        """Feed the plan's tokens, sample where a sequence's tokens are all in, retire the finished."""
        ids = [r.seq.index for r, _ in plan]
        starts = [r.computed for r, _ in plan]
        counts = [n for _, n in plan]
        tokens = np.array([t for r, n in plan for t in r.tokens[r.computed:r.computed + n]], dtype=np.int64)
        self._record_occupancy(plan)
        layout = self.cache.layout(ids, starts, counts)
        t0 = time.perf_counter()
        logits = self.runner.step(self.cache, layout, {"tokens": tokens}, self.graphs)
        ready = []
        for row, (r, n) in enumerate(plan):
            r.computed += n
            if r.pending == 0:
                ready.append(row)
        if ready:                                       # (an empty lockstep step has none)
            logits = self.runner.model.ops.to_host(logits)
            self.runner.sample([plan[row][0].seq for row in ready], logits[ready])
        step_s = time.perf_counter() - t0
        self.times.busy_s += step_s
        if not counts:
            self.times.wait_s += step_s                 # an empty lockstep step: only the exchanges
        elif all(n == 1 for n in counts):
            self.times.decode_s.append(step_s)
        else:
            self.times.prefill_s += step_s
        finished = [r for r, _ in plan if r.seq.finish_reason is not None]
        for r in finished:
            self.cache.tables.release(r.seq.index)
            self.running.remove(r)
        Runner.account([r.seq for r in finished], self.times)
        return [r.seq for r in finished]

    def _record_occupancy(self, plan) -> None:
        """Running sequences per step while prompts wait (the batch could be full), and the pool's use."""
        times, pool = self.times, self.cache.pool
        if self.waiting:
            times.occupancy_steps += 1
            times.occupancy_running += len(self.running)
        times.kv_blocks_total = pool.num_blocks
        times.kv_blocks_peak = max(times.kv_blocks_peak, pool.used_blocks)
        times.kv_blocks_sum += pool.used_blocks
        times.kv_block_samples += 1


def run_continuous(runner: Runner, prompts: list, indices: list, times: StepTimes, params: ContinuousParams,
                   cache: PagedKVCache, after_step=lambda finished: False, name=lambda index: f"prompt {index}",
                   lockstep=None, graphs=None) -> None:
    """Generate for `prompts` (token id lists, input indices `indices`) with continuous batching over `cache`;
    every finished sequence is handed to `after_step` (the replica's commit point) as it ends. name(index): how
    an error names a prompt. lockstep: the dp group of MoE replicas, which step together. graphs: the captured
    paged decode steps over `cache` (generate/graphs.paged_decode_graphs), or None (every step eager)."""
    seqs = runner.sequences(prompts, indices)
    ContinuousScheduler(runner, cache, seqs, params, times, after_step, name, lockstep, graphs).run()


def unsupported(config) -> list[str]:
    """Why this job cannot batch continuously in this runtime (empty: it can)."""
    why = []
    if config.offload.active:
        why.append("[offload] runs fixed blocks by design (FlexGen's zig-zag and ZeRO-Inference's row schedules)")
    if config.parallel.pp > 1:
        why.append(f"pipeline parallelism (pp = {config.parallel.pp}) runs the static micro-batch schedule")
    if config.runtime.cuda_graphs:
        why.append("[runtime] cuda_graphs captures the static schedule's decode steps (paged steps run eagerly)")
    return why + paged_supports(config.model.kv_cache, config.generate.attention_topk)


def batching_mode(config) -> str:
    """"continuous" or "static" for `[schedule] batching` (auto: continuous where supported); asking for
    continuous where it is not supported is a ConfigError that names why."""
    asked, why = config.schedule.batching, unsupported(config)
    if asked == "continuous" and why:
        raise ConfigError(f"schedule.batching = \"continuous\" is not supported here: {'; '.join(why)}; use "
                          f"batching = \"static\" (or \"auto\")")
    return "static" if asked == "static" or why else "continuous"


def balanced_shares(lengths: list, dp: int) -> list[list[int]]:
    """Prompt positions (into `lengths`, each prompt's predicted work: its positions) split over dp replicas by
    longest-first greedy (LPT): each goes to the replica with the least work so far; each share in input order."""
    shares, load = [[] for _ in range(dp)], [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        d = min(range(dp), key=lambda d: (load[d], d))
        shares[d].append(i)
        load[d] += lengths[i]
    return [sorted(share) for share in shares]
