"""The inference pipeline schedule (DeepSpeed Inference, Fig. 2 and 3), as plain data, with no MPI.

A batch of S sequences is cut into prompt micro-batches for the prompt phase and, separately, into generation
micro-batches for the token phase (hybrid scheduling: the batch is re-grouped between the phases). Stage 0 feeds
the pipeline from a FIFO queue: every prompt micro-batch first, then each generation micro-batch whose tokens have
come back from the last stage, for as long as it has running sequences. So the pipeline stays full across token
steps and its bubble is paid once per batch, and a micro-batch whose sequences all stopped simply leaves the queue.

`simulate` plays that schedule with one time unit per (stage, micro-batch) step: the model of DeepSpeed's pipeline
the performance model (hpcinfer/perf/) is checked against. The scheduler (generate/schedules/continuous.py) runs
the static policy with the same step sizes but forms each decode micro-batch from the sequences whose tokens are
back, so its order is not this one step for step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    time: int                    # the time unit in which the stage computes this work item
    stage: int
    phase: str                   # "prompt" | "gen"
    micro_batch: int
    token_step: int              # 0 for the prompt phase; k for the k-th generated token fed back
    sequences: tuple             # the sequences it carries (running ones only)


def gen_ready_order(prompt_groups: list[range], gen_groups: list[range]) -> list[tuple[int, int]]:
    """(prompt micro-batch after which, gen micro-batch) pairs: a gen micro-batch can start once the last prompt
    micro-batch holding one of its sequences has produced its first tokens."""
    last_prompt_of = {}
    for p, group in enumerate(prompt_groups):
        for seq in group:
            last_prompt_of[seq] = p
    return [(max(last_prompt_of[s] for s in group), g) for g, group in enumerate(gen_groups)]


def simulate(stages: int, prompt_groups: list[range], gen_groups: list[range], new_tokens: dict) -> list[Event]:
    """Unit-time play of the schedule. new_tokens[seq] = tokens it generates (the first comes from the prompt
    phase; each later one needs one more pass through the pipeline). Returns events sorted by (time, stage)."""
    events = []
    free_at = [0] * stages                             # the first time unit each stage is free
    generated = {seq: 0 for seq in new_tokens}
    ready_at: dict[int, int] = {}                      # gen micro-batch -> time its tokens are back at stage 0
    queue: deque = deque()

    def run_through(phase, mb, step, seqs, start):
        t = start
        for stage in range(stages):
            t = max(t, free_at[stage])
            events.append(Event(t, stage, phase, mb, step, tuple(seqs)))
            free_at[stage] = t + 1
            t += 1
        return t                                        # the time the last stage's result is back at stage 0

    ready_pairs = gen_ready_order(prompt_groups, gen_groups)
    for p, group in enumerate(prompt_groups):
        done = run_through("prompt", p, 0, list(group), free_at[0])
        for seq in group:
            generated[seq] = 1
        for after, g in ready_pairs:
            if after == p:
                ready_at[g] = done
                queue.append(g)
    step_of = {g: 1 for g in range(len(gen_groups))}
    while queue:
        g = queue.popleft()
        running = [s for s in gen_groups[g] if generated[s] < new_tokens[s]]
        if not running:
            continue
        done = run_through("gen", g, step_of[g], running, max(free_at[0], ready_at[g]))
        for seq in running:
            generated[seq] += 1
        step_of[g] += 1
        ready_at[g] = done
        queue.append(g)
    return sorted(events, key=lambda e: (e.time, e.stage))


def bubble_fraction(events: list[Event], stages: int) -> float:
    """Idle stage-time units / all stage-time units, over the span of the whole schedule."""
    if not events:
        return 0.0
    span = max(e.time for e in events) + 1
    return 1.0 - len(events) / (span * stages)
