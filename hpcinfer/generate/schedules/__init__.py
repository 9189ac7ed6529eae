"""The schedules, each a loop over the step runner (generate/runner.py):

  pipeline.py  DeepSpeed Inference's inference schedule: prompt and generation micro-batches through the pipeline
               stages (one stage is the plain case), the KV cache resident or offloaded by layer parity
  zigzag.py    FlexGen's zig-zag block schedule over offloaded weights, KV rows and activations
  rows.py      ZeRO-Inference's row schedule over offloaded weights

`run_block` picks the one a job runs for a block of prompts.
"""

from __future__ import annotations

from ...metrics import held_weight_bytes
from .pipeline import run_batch
from .rows import run_block_rows
from .zigzag import run_block_zigzag


def run_block(runner, prompts: list, indices: list, times, schedule, offload, link=None, lockstep=None,
              batch_size: int | None = None) -> list | None:
    """[(generated ids, finish_reason)] of one block of prompts (None on a stage that does not sample): with
    `[offload]` active one block = one offload block, its GPU batches zig-zag or row by row; else the pipeline
    schedule. The tiers' counter holds the embedding tables throughout an offloaded block."""
    if not offload.active:
        return run_batch(runner, prompts, indices, times, schedule, link, lockstep=lockstep, batch_size=batch_size)
    model = runner.model
    model.weights.memory.hold("device", "embedding tables",
                              held_weight_bytes([model.embed, model.positions, model.final_norm, model.lm_head]))
    run = run_block_zigzag if offload.schedule == "zigzag" else run_block_rows
    return run(runner, prompts, indices, times, offload)
