"""DeepSpeed Inference's pipeline schedule: one batch through the stages, in the order of generate/schedule.py,
as a loop over the step runner (generate/runner.py).

Stage 0 feeds every prompt micro-batch, then loops over a FIFO of generation micro-batches: it takes the oldest
one in flight, waits for its sampled tokens from the last stage, and sends it on for its next token while it has
running sequences. Middle stages receive, run their layers and pass on. The last stage runs its layers and the LM
head, samples, and returns the tokens to stage 0. With one stage all of this happens in one process (the return
path is a local queue). Shape legend: T=tokens of a step, S=sequences of a micro-batch, D=hidden.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ...backend.interface import StepLayout
from ...parallel.micro_batches import micro_batches
from ..engine import GenerationParams, ScheduleParams, StepTimes
from ..graphs import batch_cache
from ..kv_cache import KVCache
from ..runner import Runner
from ..schedule import gen_ready_order


def generate_batch(model, prompts: list, indices: list, params: GenerationParams, times: StepTimes,
                   schedule: ScheduleParams = ScheduleParams(), link=None, prompt_logits: dict | None = None,
                   lockstep=None, batch_size: int | None = None) -> list | None:
    """One batch on a runner of its own (api.py, benchmarks, tests): run_batch, then the runner's kept cache and
    graphs are freed."""
    runner = Runner(model, params)
    try:
        return run_batch(runner, prompts, indices, times, schedule, link, prompt_logits, lockstep, batch_size)
    finally:
        runner.close()


def run_batch(runner: Runner, prompts: list, indices: list, times: StepTimes, schedule: ScheduleParams,
              link=None, prompt_logits: dict | None = None, lockstep=None,
              batch_size: int | None = None) -> list | None:
    """Run prompts (lists of token ids) to completion. Returns [(generated ids, finish_reason)] in prompt order on
    the last pipeline stage, None on the others. `link` (comm.pipeline.StageLink) is needed when pp > 1. If
    `prompt_logits` is a dict, the last stage also stores there each prompt's last-position logits [V], by index
    (for checking layouts against each other).

    `lockstep`: the dp group, when data-parallel replicas must step together because their MoE layers
    exchange tokens; each then holds its slice of one batch of `batch_size` sequences (possibly none), and every
    replica runs the same micro-batch steps, with no tokens where its slice has none."""
    model, arch, stage = runner.model, runner.model.arch, runner.model.stage
    seqs = runner.sequences(prompts, indices)
    exact = lockstep is not None
    cap = batch_size or len(seqs)
    prompt_groups = micro_batches(len(seqs), min(schedule.prompt_micro_batches, cap), exact)
    gen_groups = micro_batches(len(seqs), min(schedule.gen_micro_batches, cap), exact)
    largest_micro_batch = max(max(len(g) for g in prompt_groups + gen_groups), 1)

    def make_cache(slots: int, max_len: int) -> KVCache:
        return KVCache(model.ops, model.num_local_layers, slots, model.kv_heads_local, max_len, arch.head_dim,
                       schedule.kv_offload, stage.first_layer, largest_micro_batch, kv_format=model.kv_format)

    # with [runtime] cuda_graphs on cupy: the run's cache and graphs, kept across batches; else graphs is None
    cache, graphs = batch_cache(model, schedule, runner.graphs, len(seqs), max((s.capacity for s in seqs), default=1),
                                make_cache)
    counted = (graphs.captures, graphs.replays, graphs.eager_steps) if graphs is not None else (0, 0, 0)
    stage_runner = _StageRunner(runner, link, cache, seqs, times, prompt_groups, gen_groups, prompt_logits,
                                lockstep, graphs)
    start = time.perf_counter()
    if stage.is_first:
        stage_runner.drive()
    else:
        stage_runner.serve()
    if link is not None:
        link.flush()
    times.gen_phase_s += time.perf_counter() - start - stage_runner.prompt_phase_s
    times.prefill_s += stage_runner.prompt_phase_s
    times.kv_bytes_to_host += cache.bytes_to_host
    times.kv_bytes_to_device += cache.bytes_to_device
    times.kv_peak_device_bytes = max(times.kv_peak_device_bytes, cache.peak_bytes)
    if graphs is not None:
        times.graph_captures += graphs.captures - counted[0]
        times.graph_replays += graphs.replays - counted[1]
        times.graph_eager_steps += graphs.eager_steps - counted[2]
        if not graphs.kept:
            graphs.close()
    return runner.account(seqs, times) if stage.is_last else None


class _StageRunner:
    def __init__(self, runner: Runner, link, cache, seqs, times, prompt_groups, gen_groups, prompt_logits=None,
                 lockstep=None, graphs=None):
        self.runner, self.model, self.link, self.cache, self.seqs = runner, runner.model, link, cache, seqs
        self.graphs = graphs                                # generate/graphs.DecodeGraphs, or None
        self.prompt_logits = prompt_logits                  # optional {prompt index: logits [V]} (last stage)
        self.times = times
        self.prompt_groups, self.gen_groups = prompt_groups, gen_groups
        self.stage = runner.model.stage
        self.start = time.perf_counter()
        self.prompt_phase_s = 0.0
        self.returned: deque = deque()                    # one stage: the return path is local
        self.lockstep = lockstep                            # the dp group when replicas step together
        # A gen micro-batch starts once its sequences' first tokens exist; replicas in lockstep all start them
        # after the last prompt micro-batch, so that they answer in the same order.
        self.release_after = (gen_ready_order(prompt_groups, gen_groups) if lockstep is None else
                              [(len(prompt_groups) - 1, g) for g in range(len(gen_groups))])

    # ---- stage 0 --------------------------------------------------------------------------------------------
    def drive(self) -> None:
        """Feed the prompt micro-batches, then the generation micro-batches from the FIFO until all have stopped."""
        for p, group in enumerate(self.prompt_groups):
            ids = list(group)
            starts, counts, tokens = Runner.prompt_inputs([self.seqs[i] for i in ids])
            self._step({"phase": "prompt", "mb": p, "seqs": ids, "starts": starts, "counts": counts},
                       {"tokens": tokens})
        if self.stage.is_last:
            self.prompt_phase_s = time.perf_counter() - self.start
        in_flight = deque(range(len(self.gen_groups)))      # answered by the last stage in this order
        sent_at = {g: time.perf_counter() for g in in_flight}
        while in_flight:
            g = in_flight.popleft()
            reply = self._receive_tokens()
            assert reply["mb"] == g, "the last stage answers micro-batches in the order they were sent"
            if not reply["prompt"]:
                self.times.decode_s.append(time.perf_counter() - sent_at[g])
            self._apply_tokens(reply)
            if reply["alive"] == 0:                             # every sequence of g (on every replica) stopped
                continue
            running = [i for i in self.gen_groups[g] if self.seqs[i].finish_reason is None]
            self.times.occupancy_steps += 1                     # a decode step: the batch's running sequences
            self.times.occupancy_running += sum(1 for s in self.seqs if s.finish_reason is None)
            sent_at[g] = time.perf_counter()
            starts, counts, tokens = Runner.decode_inputs([self.seqs[i] for i in running])
            self._step({"phase": "gen", "mb": g, "seqs": running, "starts": starts, "counts": counts},
                       {"tokens": tokens})
            in_flight.append(g)
        if not self.stage.is_last:
            self.link.send_to_next_stage({"stop": True})

    def _receive_tokens(self) -> dict:
        if self.stage.is_last:
            return self.returned.popleft()
        t0 = time.perf_counter()
        reply, _ = self.link.recv_from_last_stage()
        self.times.wait_s += time.perf_counter() - t0
        return reply

    def _apply_tokens(self, reply: dict) -> None:
        """Stage 0 (and every stage that is not last) learns each sequence's new token and whether it stopped."""
        if self.stage.is_last:
            return                                          # the last stage already recorded them
        for i, token, reason in zip(reply["seqs"], reply["tokens"], reply["finish"]):
            self.seqs[i].generated.append(token)
            self.seqs[i].finish_reason = reason

    # ---- stages after the first ------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            t0 = time.perf_counter()
            header, x = self.link.recv_from_prev_stage()
            self.times.wait_s += time.perf_counter() - t0
            if header.get("stop"):
                if not self.stage.is_last:
                    self.link.send_to_next_stage(header)
                return
            self._step(header, {"x": x})

    # ---- every stage -----------------------------------------------------------------------------------------
    def _step(self, header: dict, inputs: dict) -> None:
        """One micro-batch step from `inputs` ({"tokens": ids [T]} on stage 0, {"x": [T, D]} after it): this stage's
        share (Runner.step; a decode step replays its CUDA graph when [runtime] cuda_graphs is on), then sample
        (last stage) or pass the activations on."""
        step = StepLayout.build(header["seqs"], header["starts"], header["counts"])
        t0 = time.perf_counter()
        self.cache.prepare(step.slots)
        out = self.runner.step(self.cache, step, inputs, self.graphs)
        if self.stage.is_last:
            out = self.model.ops.to_host(out)                                       # logits [S, V]
        self.times.busy_s += time.perf_counter() - t0
        self.cache.peak_bytes = max(self.cache.peak_bytes, self.cache.nbytes)
        if self.stage.is_last:
            self._finish(header, out)
        else:
            self.link.send_to_next_stage(header, out)
            if header["phase"] == "prompt" and header["mb"] == len(self.prompt_groups) - 1:
                self.prompt_phase_s = time.perf_counter() - self.start

    # ---- last stage ------------------------------------------------------------------------------------------
    def _finish(self, header: dict, logits: np.ndarray) -> None:
        """Sample one token per sequence (the same on every tp rank), record it, and return tokens to stage 0."""
        ids = header["seqs"]
        if header["phase"] == "prompt" and self.prompt_logits is not None:
            self.prompt_logits.update({self.seqs[i].index: row.copy() for i, row in zip(ids, logits)})
        self.runner.sample([self.seqs[i] for i in ids], logits)
        if header["phase"] == "gen":
            self._return_tokens(header["mb"], ids, prompt=False)
            return
        for after, g in self.release_after:                 # gen micro-batches whose first tokens are all known
            if after == header["mb"]:
                self._return_tokens(g, list(self.gen_groups[g]), prompt=True)
        if header["mb"] == len(self.prompt_groups) - 1:
            self.prompt_phase_s = time.perf_counter() - self.start

    def _return_tokens(self, g: int, ids: list, prompt: bool) -> None:
        alive = sum(1 for i in self.gen_groups[g] if self.seqs[i].finish_reason is None)
        if self.lockstep is not None:                       # the micro-batch goes on while any replica needs it
            alive = int(self.lockstep.all_reduce(np.array([alive], dtype=np.int64))[0])
        reply = {"mb": g, "prompt": prompt, "seqs": ids, "tokens": [self.seqs[i].generated[-1] for i in ids],
                 "finish": [self.seqs[i].finish_reason for i in ids], "alive": alive}
        if self.stage.is_first:
            self.returned.append(reply)
        else:
            self.link.send_to_first_stage(reply)
