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

With pp > 1 the scheduler runs on the first stage and up to `micro_batches` steps ([schedule] gen_micro_batches,
default pp) are in flight down the pipeline at once, each over running sequences no other step in flight holds
(about batch_size / micro_batches of them): micro-batches are formed from the running set at every step, so
finished sequences leave and new ones enter without draining the pipeline. A step's header (ids, starts, counts,
block tables, rows to sample) travels with its activations; the last stage samples and returns the tokens
(continuous_stages.py). Preemption takes only sequences no step in flight holds.

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
from ..runner import Runner
from .continuous_stages import FirstStage, LocalStage, StageStep, serve


@dataclass(frozen=True)
class ContinuousParams:
    batch_size: int          # running sequences at most ([generate] batch_size)
    max_batch_tokens: int    # tokens per step ([schedule] max_batch_tokens, >= batch_size; static: unbounded)
    micro_batches: int = 1   # decode steps in flight at once: pp > 1 keeps every stage busy (gen_micro_batches)
    whole_prompts: bool = False   # feed steps as static does: a prompt whole, a recomputed token one per step
    static: bool = False     # the static policy: admit only when the running set is empty, prompts whole
    prompt_micro_batches: int = 0   # static: prefill steps the running set's prompts are split into (0 = micro_batches)

    @classmethod
    def static_policy(cls, batch_size: int, micro_batches: int = 1, prompt_micro_batches: int = 0):
        """DeepSpeed Inference's static batching as a policy of this scheduler: batch_size prompts enter together
        when the running set is empty, each prefilled whole in one of prompt_micro_batches steps, then decode in
        micro_batches steps until the last of them ends."""
        return cls(batch_size, 1 << 62, micro_batches, True, True, prompt_micro_batches)

    @property
    def step_sequences(self) -> int:
        """Sequences a decode step takes at most: the running set shared over the steps in flight."""
        return -(-self.batch_size // self.micro_batches)

    @property
    def prompt_step_sequences(self) -> int:
        """Sequences a step that prefills takes at most."""
        return -(-self.batch_size // (self.prompt_micro_batches or self.micro_batches))

    @property
    def in_flight(self) -> int:
        """Steps in flight at most (static: every prompt micro-batch goes down before the first tokens are back)."""
        return max(self.micro_batches, self.prompt_micro_batches)

    @property
    def step_tokens(self) -> int:
        return max(self.max_batch_tokens // self.micro_batches, self.step_sequences)


@dataclass
class _Running:
    seq: Sequence
    computed: int = 0        # positions of prompt + generated whose K and V are in the pool (or on their way)

    @property
    def tokens(self) -> list:
        return self.seq.prompt + self.seq.generated

    @property
    def pending(self) -> int:
        """Tokens still to feed before the next sample (1 for a decode step)."""
        return self.seq.length - self.computed


@dataclass
class _InFlight:
    plan: list               # [(_Running, tokens fed)]
    sample: list             # rows of the plan whose tokens are all in: they sample
    sent_s: float


class ContinuousScheduler:
    """The running set, the queue and the pool of one replica, on its first pipeline stage; `run` steps until both
    are empty (or `after_step` says stop). `after_step(finished sequences) -> bool` runs after every step's tokens
    are back. `stage` runs the steps (continuous_stages.LocalStage, or FirstStage down a pipeline); up to
    params.micro_batches steps are in flight at once, each over running sequences that no other step holds."""

    def __init__(self, stage, cache, seqs: list, params: ContinuousParams, times: StepTimes,
                 after_step=lambda finished: False, lockstep=None, groups=None):
        self.stage, self.cache, self.params, self.times = stage, cache, params, times
        self.lockstep = lockstep                        # the dp group when MoE replicas step together, else None
        self.waiting: deque = deque(seqs)
        self.groups: deque = deque(groups or [])        # static: the sizes of the batches the waiting enter in
        self.all_idle = True                            # lockstep: no replica has a running sequence
        self.running: list[_Running] = []               # admission order
        self.in_flight: deque[_InFlight] = deque()
        self.busy: set = set()                          # ids of the running sequences some step in flight holds
        self.after_step = after_step
        self.applies_tokens = not stage.runner.model.stage.is_last   # the last stage records its own

    def run(self) -> None:
        """Launch a step whenever one fits (in lockstep: every round, empty or not) and take the oldest step's
        tokens back when micro_batches are in flight or nothing more can be launched."""
        while True:
            work = self._any_work()
            if not work and not self.in_flight:
                return
            launched = False
            if work:
                self._admit()
                plan = self._plan()
                if plan or self.lockstep is not None:
                    self.stage.launch(*self._step_inputs(plan))
                    launched = True
            if self.in_flight and (len(self.in_flight) >= self.params.in_flight or not launched):
                if self._receive():
                    self._drain()
                    return

    def _any_work(self) -> bool:
        """This replica has sequences left; in lockstep, any replica has (every replica asks at every round, and
        learns whether every running set is empty: the static policy's replicas refill together)."""
        mine = bool(self.waiting or self.running)
        if self.lockstep is None:
            return mine
        gathered = self.lockstep.all_gather(np.array([mine, bool(self.running)], dtype=np.int64))
        self.all_idle = not gathered.reshape(-1, 2)[:, 1].any()
        return bool(gathered.reshape(-1, 2)[:, 0].any())

    # ---- decisions -------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting prompts into the running set: up to batch_size (static: only when the running set is empty)."""
        if self.params.static and (self.running or not self.all_idle):     # (steps in flight hold running ones)
            return
        limit = self.groups.popleft() if self.params.static and self.groups else self.params.batch_size
        while self.waiting and len(self.running) < limit:
            self.running.append(_Running(self.waiting.popleft()))

    def _plan(self) -> list[tuple[_Running, int]]:
        """[(sequence, tokens to feed)] of the next step over the running sequences no step in flight holds, its
        blocks allocated: decode tokens first, then prompt chunks in admission order, up to the step's sequences
        and tokens; preempts (newest idle first) when the pool runs out."""
        budget = self.params.step_tokens
        idle = [r for r in self.running if r.seq.index not in self.busy]
        plan = []
        prefill = [r for r in idle if r.pending > 1]
        room = self._room(bool(prefill))
        decode = sorted((r for r in idle if r.pending == 1), key=lambda r: self.cache.row_order(r.seq.index))
        for r in decode + prefill:
            if budget <= 0 or len(plan) == room:
                break
            if r not in self.running:                      # preempted while planning this step
                continue
            count = self._tokens(r, budget, oldest=bool(prefill) and r is prefill[0])
            if count == 0:
                continue                                   # a whole prompt that waits for a step with room
            if not self._reserve(r, r.computed + count):
                continue                                   # r was preempted, or waits for blocks in flight
            plan.append((r, count))
            budget -= count
        return [(r, n) for r, n in plan if r in self.running]

    def _room(self, prefill: bool) -> int:
        """Sequences the next step takes at most: the running set shared over the steps in flight (static: its
        running set in prompt_micro_batches prefill steps, or micro_batches decode steps, as DeepSpeed splits a
        batch)."""
        p = self.params
        if not p.static:
            return p.step_sequences
        split = (p.prompt_micro_batches or p.micro_batches) if prefill else p.micro_batches
        return max(1, -(-len(self.running) // split))

    def _tokens(self, r: _Running, budget: int, oldest: bool) -> int:
        """Tokens of r the step feeds: as many as the budget allows; with whole_prompts (a quantized KV cache or
        top-k attention, whose arithmetic depends on how positions are grouped into steps) as the static
        schedule feeds them: the prompt whole (the oldest prompt even past the budget, so that none starves), then
        one token a step (a preempted sequence's generated tokens are recomputed as the decode steps they were)."""
        if not self.params.whole_prompts:
            return min(r.pending, budget)
        if r.computed > 0:
            return 1
        prompt = len(r.seq.prompt)
        return prompt if prompt <= budget or oldest else 0

    def _reserve(self, r: _Running, length: int) -> bool:
        """Blocks for `length` positions of r, preempting the newest idle running sequences until they fit; False
        when r is the newest idle one: it is preempted, or, while steps are in flight (their sequences will
        grow or end), it waits with its blocks."""
        tables = self.cache.tables
        while not tables.can_grow(r.seq.index, length):
            victim = [x for x in self.running if x.seq.index not in self.busy][-1]
            if victim is r and self.in_flight:
                return False
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

    # ---- a step out and its tokens back ----------------------------------------------------------------------
    def _step_inputs(self, plan: list[tuple[_Running, int]]) -> tuple[dict, np.ndarray]:
        """The plan as a step for the stage: (header with the rows that sample, those whose tokens are then all
        in; token ids [T]), its sequences marked busy and the step in flight."""
        self._record_occupancy(plan)
        ids = [r.seq.index for r, _ in plan]
        starts = [r.computed for r, _ in plan]
        counts = [n for _, n in plan]
        tokens = np.array([t for r, n in plan for t in r.tokens[r.computed:r.computed + n]], dtype=np.int64)
        header = {"ids": ids, "starts": starts, "counts": counts, "layout": self.cache.layout(ids, starts, counts)}
        for r, n in plan:
            r.computed += n
        header["sample"] = [row for row, (r, _) in enumerate(plan) if r.pending == 0]
        self.busy.update(ids)
        self.in_flight.append(_InFlight(plan, header["sample"], time.perf_counter()))
        return header, tokens

    def _receive(self) -> bool:
        """The oldest step's tokens: record them, retire the finished (their blocks go back), then after_step."""
        step = self.in_flight.popleft()
        reply = self.stage.receive()
        if self.applies_tokens:
            for index, token, reason in zip(reply["ids"], reply["tokens"], reply["finish"]):
                seq = step.plan[[r.seq.index for r, _ in step.plan].index(index)][0].seq
                seq.generated.append(token)
                seq.finish_reason = reason
        self._record_time(step)
        self.busy.difference_update(r.seq.index for r, _ in step.plan)
        finished = [r for r, _ in step.plan if r.seq.finish_reason is not None]
        for r in finished:
            self.cache.tables.release(r.seq.index)
            self.running.remove(r)
        return self.after_step([r.seq for r in finished])

    def _drain(self) -> None:
        """Stopping: the steps still in flight come back (their tokens are not kept: a re-run redoes them)."""
        while self.in_flight:
            self.in_flight.popleft()
            self.stage.receive()

    def _record_time(self, step: _InFlight) -> None:
        """A step from launch to its tokens back: decode steps one by one, the rest as prefill."""
        elapsed = time.perf_counter() - step.sent_s
        if not step.plan:
            return                                      # an empty lockstep step: only the exchanges
        if all(n == 1 for _, n in step.plan):
            self.times.decode_s.append(elapsed)
        else:
            self.times.prefill_s += elapsed

    def _record_occupancy(self, plan: list) -> None:
        """Running sequences per step that could have been full (continuous: while prompts wait; static: every
        decode step), and the pool's use."""
        times, pool = self.times, self.cache.pool
        decode = bool(plan) and all(n == 1 for _, n in plan)
        if (decode and self.params.static) or (self.waiting and not self.params.static):
            times.occupancy_steps += 1
            times.occupancy_running += len(self.running)
        times.kv_blocks_total = pool.num_blocks
        times.kv_blocks_peak = max(times.kv_blocks_peak, pool.used_blocks)
        times.kv_blocks_sum += pool.used_blocks
        times.kv_block_samples += 1


def check_fits(seqs: list, cache, name=lambda index: f"prompt {index}") -> None:
    """A sequence the pool cannot hold alone is a set-up error naming it (every stage checks: they agree on the
    pool's size)."""
    tables, pool = cache.tables, cache.pool
    for seq in seqs:
        if tables.blocks_for(seq.capacity) > pool.num_blocks:
            raise ConfigError(f"{name(seq.index)}: {seq.capacity} positions (prompt {len(seq.prompt)} + "
                              f"max_new_tokens) need {tables.blocks_for(seq.capacity)} KV blocks of "
                              f"{pool.block_size}, the pool has {pool.num_blocks}: raise "
                              f"[schedule] kv_cache_memory")


def run_continuous(runner: Runner, prompts: list, indices: list, times: StepTimes, params: ContinuousParams,
                   cache, after_step=lambda finished: False, name=lambda index: f"prompt {index}",
                   lockstep=None, graphs=None, link=None, end_round=None) -> list:
    """run_sequences over the Sequences of `prompts` (token id lists, input indices `indices`)."""
    return run_sequences(runner, runner.sequences(prompts, indices), times, params, cache, after_step, name,
                         lockstep, graphs, link, end_round)


def run_sequences(runner: Runner, seqs: list, times: StepTimes, params: ContinuousParams, cache,
                  after_step=lambda finished: False, name=lambda index: f"prompt {index}", lockstep=None,
                  graphs=None, link=None, end_round=None, groups=None, prompt_logits=None, finish=None) -> list:
    """Generate for `seqs` under `params`' policy over `cache` (a kv_store.KVStore). On the first stage, every
    step's finished sequences go to `after_step` (the replica's commit points, replica.CommitPoints) as they end.
    With pp > 1 (`link`, a comm.pipeline.StageLink) the later stages serve the steps and call end_round(their
    finished results) at each commit point; the last stage returns the results it did not hand to end_round.
    name(index): how an error names a prompt. lockstep: the dp group of MoE replicas, which step together.
    graphs: the captured paged decode steps over `cache` (generate/graphs.paged_decode_graphs), or None. groups:
    under the static policy, the sizes of the batches `seqs` enter in (default: batch_size at a time).
    prompt_logits: a dict the last stage fills with each sequence's first-token logits [V], by index. finish(): run
    on the first stage when the schedule has ended, before the later stages are told to stop (the commit points
    an empty share never reached: their end_round must find those stages still serving)."""
    check_fits(seqs, cache, name)
    runner.times = times                                # the run's steps are timed there (Runner.step)
    step_args = (runner, cache, seqs, times, graphs, prompt_logits)
    try:
        if not runner.model.stage.is_first:
            return serve(StageStep(*step_args), link, end_round)
        stage = LocalStage(*step_args) if link is None else FirstStage(StageStep(*step_args), link)
        try:
            ContinuousScheduler(stage, cache, seqs, params, times, after_step, lockstep, groups).run()
            if finish is not None:
                finish()
        finally:
            stage.close()
        return []
    finally:
        if graphs is not None:                          # the run's captures and replays (its maker closes it)
            graphs.record(times)


def balanced_shares(lengths: list, dp: int) -> list[list[int]]:
    """Prompt positions (into `lengths`, each prompt's predicted work: its positions) split over dp replicas by
    longest-first greedy (LPT): each goes to the replica with the least work so far; each share in input order."""
    shares, load = [[] for _ in range(dp)], [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        d = min(range(dp), key=lambda d: (load[d], d))
        shares[d].append(i)
        load[d] += lengths[i]
    return [sorted(share) for share in shares]
