"""ZeRO-Inference's row schedule for offloaded weights: each GPU batch of a block runs through all its token steps
before the next one starts, every layer streamed in for every step of every GPU batch (the baseline FlexGen's
zig-zag block schedule improves on: generate/schedules/zigzag.py). A GPU batch is the pipeline schedule's batch on
one stage under the scheduler's static policy; the tiers' memory counter holds its KV cache and activations while it runs."""

from __future__ import annotations

from ...offload.sizes import ACT_ITEMSIZE, kv_token_bytes
from ...parallel.micro_batches import micro_batches
from ..engine import ScheduleParams
from ..runner import Runner
from .pipeline import run_batch


def run_block_rows(runner: Runner, prompts: list, indices: list, times, schedule: ScheduleParams, policy) -> list:
    """[(generated ids, finish_reason)] of the block's prompts, GPU batch after GPU batch, each under the
    scheduler's static policy (schedules/pipeline.run_batch)."""
    model, memory = runner.model, runner.model.weights.memory
    outputs = []
    for group in micro_batches(len(prompts), policy.num_gpu_batches):
        members = [prompts[i] for i in group]
        memory.hold("device", "KV cache", _row_cache_bytes(model, members, runner.params.max_new_tokens))
        memory.hold("device", "activations", sum(map(len, members)) * model.arch.hidden_size * ACT_ITEMSIZE)
        outputs += run_batch(runner, members, [indices[i] for i in group], times, schedule)
        memory.hold("device", "KV cache", 0)
        memory.hold("device", "activations", 0)
    return outputs


def _row_cache_bytes(model, prompts: list, max_new_tokens: int) -> int:
    """Bytes of the KV cache run_batch allocates for these prompts: every local layer, every sequence, the
    longest sequence's positions (offload/sizes.kv_token_bytes, the budget's rule)."""
    arch = model.arch
    max_len = max(min(len(p) + max_new_tokens, arch.max_positions) for p in prompts)
    return kv_token_bytes(arch, model.tp.size, model.kv_format) * max_len * len(prompts) * model.num_local_layers
