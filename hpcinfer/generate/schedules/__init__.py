"""The scheduler and the offload schedules, over the step runner (generate/runner.py):

  continuous.py  the scheduler: which sequences run in the next step, continuous or static (a policy of it),
                 through the pipeline stages (continuous_stages.py), MoE replicas in lockstep
  pipeline.py    one batch under the static policy (generate_batch: api.py, benchmarks, tests)
  rows.py        ZeRO-Inference's row schedule over offloaded weights: its GPU batches one after another, each
                 under the static policy
  zigzag.py      FlexGen's zig-zag block schedule, the one loop of its own (its order differs: layer by layer
                 over every GPU batch of a block)

`run_block` picks the offload schedule for a block of prompts.
"""

from __future__ import annotations

from ...metrics import held_weight_bytes
from .rows import run_block_rows
from .zigzag import run_block_zigzag


def run_block(runner, prompts: list, indices: list, times, schedule, offload) -> list:
    """[(generated ids, finish_reason)] of one offload block of prompts, its GPU batches zig-zag or row by row
    (`[offload] schedule`; the row schedule runs each GPU batch under `schedule`, an engine.ScheduleParams). The
    tiers' counter holds the embedding tables throughout the block."""
    model = runner.model
    model.weights.memory.hold("device", "embedding tables",
                              held_weight_bytes([model.embed, model.positions, model.final_norm, model.lm_head]))
    if offload.schedule == "zigzag":
        return run_block_zigzag(runner, prompts, indices, times, offload)
    return run_block_rows(runner, prompts, indices, times, schedule, offload)
