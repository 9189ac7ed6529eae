"""One batch run to completion under the scheduler's static policy (DeepSpeed Inference's schedule): what api.py,
the benchmarks and tests call when they hand a list of prompts to a model.

There is no loop of its own: the batch's prompts enter the continuous scheduler (schedules/continuous.py) together,
are prefilled whole in `prompt_micro_batches` steps and decode in `gen_micro_batches` steps in flight down the
pipeline until the last of them ends (ContinuousParams.static_policy), over a KV store the runner builds for the
batch (generate/kv_store.py).
"""

from __future__ import annotations

from ..engine import GenerationParams, ScheduleParams, StepTimes
from ..graphs import paged_decode_graphs
from ..runner import Runner
from .continuous import ContinuousParams, run_sequences

BLOCK_SIZE = 16              # positions per KV block of a batch's store (its pool holds the whole batch)


def generate_batch(model, prompts: list, indices: list, params: GenerationParams, times: StepTimes,
                   schedule: ScheduleParams = ScheduleParams(), link=None, prompt_logits: dict | None = None,
                   lockstep=None, batch_size: int | None = None) -> list | None:
    """[(generated ids, finish_reason)] of prompts (token id lists, input indices `indices`) in prompt order on the
    last pipeline stage, None on the others; a runner of its own, closed after. `link` (comm.pipeline.StageLink)
    when pp > 1. `prompt_logits`: a dict the last stage fills with each prompt's last-position logits [V], by
    index (for checking layouts against each other). `lockstep`: the dp group, when MoE replicas step together; each holds its slice of a batch of
    `batch_size` sequences (possibly none)."""
    runner = Runner(model, params)
    try:
        return run_batch(runner, prompts, indices, times, schedule, link, lockstep, batch_size, prompt_logits)
    finally:
        runner.close()


def run_batch(runner: Runner, prompts: list, indices: list, times: StepTimes, schedule: ScheduleParams,
              link=None, lockstep=None, batch_size: int | None = None, prompt_logits=None) -> list | None:
    """generate_batch on a given runner (the row schedule runs each GPU batch so)."""
    seqs = runner.sequences(prompts, indices)
    running = max(1, len(seqs))
    steps = batch_size or running
    largest_step = -(-running // min(schedule.prompt_micro_batches, schedule.gen_micro_batches, steps))
    longest = max((s.capacity for s in seqs), default=1)
    cache = runner.kv_store(running * -(-longest // BLOCK_SIZE), BLOCK_SIZE, running, longest, schedule.kv_offload,
                            largest_step)
    policy = ContinuousParams.static_policy(running, min(schedule.gen_micro_batches, steps),
                                            min(schedule.prompt_micro_batches, steps))
    graphs = paged_decode_graphs(runner, cache, schedule.cuda_graphs)
    try:
        run_sequences(runner, seqs, times, policy, cache, lockstep=lockstep, graphs=graphs, link=link,
                      prompt_logits=prompt_logits)
    finally:
        if graphs is not None:
            graphs.close()
    cache.report(times)
    return [(s.generated, s.finish_reason) for s in seqs] if runner.model.stage.is_last else None
