"""The stages of the continuous schedule (generate/schedules/continuous.py): where a step the scheduler planned
runs, and how its sampled tokens come back.

The scheduler runs on the first pipeline stage and hands each step over as a header (the sequences' ids, starts,
counts, the step's StepLayout over the cache (block tables, or dense slots), and the rows to sample) plus its
inputs. With one stage (`LocalStage`) the step runs at once
and its tokens wait in a local queue. With pp > 1 (`FirstStage` on stage 0, `serve` on the others) the header
travels down the pipeline with the activations; every stage runs its layers over the same block tables (its own
pool, as large as stage 0's: replica.py agrees the size), and the last stage samples and returns the tokens to
stage 0, while the scheduler already plans and sends the next micro-batch. Commit points travel down the same
channel as steps ({"commit": True}), so every stage reaches the world collective of a commit
(generate/rounds.BatchRounds.end) after the same steps; {"stop": True} ends a stage.

Shape legend: S=sequences in a step, T=its tokens, D=hidden, V=vocab.
"""

from __future__ import annotations

import time
from collections import deque

from ..runner import Runner


class StageStep:
    """One stage's share of a step from its header, on any stage: its layers over the header's block tables, and on
    the last stage the samples of the header's "sample" rows. Finished sequences go to `finished` (the last
    stage's results, until committed)."""

    def __init__(self, runner: Runner, cache, seqs: list, times, graphs=None, prompt_logits: dict | None = None):
        self.runner, self.cache, self.times, self.graphs = runner, cache, times, graphs
        self.prompt_logits = prompt_logits                # optional {prompt index: logits [V] of its first token}
        self.by_id = {s.index: s for s in seqs}
        self.finished: list = []                          # [(prompt index, generated ids, finish_reason)]

    def __call__(self, header: dict, inputs: dict):
        """-> the reply to stage 0 on the last stage ({"ids", "tokens", "finish"} of the sampled rows), else the
        activations [T, D] for the next stage."""
        layout = header["layout"]                         # the first stage's StepLayout (paged, or dense slots)
        out = self.runner.step(self.cache, layout, inputs, self.graphs)
        return self._sample(header, out) if self.runner.model.stage.is_last else out

    def _sample(self, header: dict, logits) -> dict:
        rows = header["sample"]
        seqs = [self.by_id[header["ids"][row]] for row in rows]
        if seqs:                                          # (an empty lockstep step has none)
            logits = self.runner.model.ops.to_host(logits)[rows]                  # [samples, V]
            if self.prompt_logits is not None:
                self.prompt_logits.update((s.index, row.copy()) for s, row in zip(seqs, logits) if not s.generated)
            self.runner.sample(seqs, logits)
        done = [s for s in seqs if s.finish_reason is not None]
        Runner.account(done, self.times)
        self.finished += [(s.index, s.generated, s.finish_reason) for s in done]
        return {"ids": [s.index for s in seqs], "tokens": [s.generated[-1] for s in seqs],
                "finish": [s.finish_reason for s in seqs]}

    def take_finished(self) -> list:
        taken, self.finished = self.finished, []
        return taken


class LocalStage(StageStep):
    """pp = 1: a launched step runs at once, its layers and its samples (StageStep's work, called without a frame
    of its own); its reply waits for `receive`."""

    def __init__(self, runner: Runner, cache, seqs: list, times, graphs=None, prompt_logits: dict | None = None):
        super().__init__(runner, cache, seqs, times, graphs, prompt_logits)
        self.replies: deque = deque()

    def launch(self, header: dict, tokens) -> None:
        logits = self.runner.step(self.cache, header["layout"], {"tokens": tokens}, self.graphs)
        self.replies.append(self._sample(header, logits))

    def receive(self) -> dict:
        return self.replies.popleft()

    def close(self) -> None:
        """(one stage: nothing in flight)"""


class FirstStage:
    """Stage 0 of pp > 1: a launched step runs this stage's layers and goes down the pipeline (`link`, a
    comm.pipeline.StageLink); `receive` waits for the oldest step's tokens from the last stage."""

    def __init__(self, stage_step: StageStep, link):
        self.stage_step, self.link, self.runner = stage_step, link, stage_step.runner

    def launch(self, header: dict, tokens) -> None:
        self.link.send_to_next_stage(header, self.stage_step(header, {"tokens": tokens}))

    def receive(self) -> dict:
        t0 = time.perf_counter()
        reply, _ = self.link.recv_from_last_stage()
        self.stage_step.times.wait_s += time.perf_counter() - t0
        return reply

    def close(self) -> None:
        self.link.send_to_next_stage({"stop": True})
        self.link.flush()


def serve(stage_step: StageStep, link, end_round=None) -> list:
    """A stage after the first: run the steps stage 0 sends, in order, until it says stop; at each commit point
    call end_round(the results finished since the last one: the last stage's, else none). Returns the results
    not handed to end_round (all of them without it) on the last stage, [] elsewhere."""
    is_last = stage_step.runner.model.stage.is_last
    while True:
        t0 = time.perf_counter()
        header, x = link.recv_from_prev_stage()
        stage_step.times.wait_s += time.perf_counter() - t0
        if header.get("stop") or header.get("commit"):
            if not is_last:
                link.send_to_next_stage(header)
            if header.get("stop"):
                link.flush()
                return stage_step.take_finished()
            if end_round is not None:
                end_round(stage_step.take_finished())
            continue
        out = stage_step(header, {"x": x})
        if is_last:
            link.send_to_first_stage(out)
        else:
            link.send_to_next_stage(header, out)
