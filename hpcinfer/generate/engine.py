"""The data of generation: what is asked (GenerationParams, ScheduleParams), what each sequence holds (Sequence,
record_token), and what was measured (StepTimes). The step runner is generate/runner.py, the schedules
generate/schedules/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import KVOffload
from .sampling import SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class ScheduleParams:
    prompt_micro_batches: int = 1    # micro-batches of the prompt phase (capped at the batch's sequences)
    gen_micro_batches: int = 1       # micro-batches of the token phase (the batch is re-grouped in between)
    kv_offload: KVOffload | None = None
    cuda_graphs: bool = False        # decode steps through CUDA graphs on the cupy backend (generate/graphs.py)


@dataclass
class Sequence:
    index: int                   # position of the prompt in the input (seeds its generator)
    prompt: list
    capacity: int                # prompt + tokens it may generate (bounded by the model's positions)
    rng: np.random.Generator
    generated: list = field(default_factory=list)
    finish_reason: str | None = None
    first_token_s: float | None = None    # time.perf_counter() when its first token was sampled
    finish_s: float | None = None         # ... and when it stopped

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


def record_token(seq: Sequence, token: int, eos: set, max_new_tokens: int) -> None:
    """Append a sampled token and decide whether the sequence stops (EOS, max_new_tokens, or out of positions)."""
    seq.generated.append(token)
    if token in eos:
        seq.finish_reason = "stop"
    elif len(seq.generated) >= max_new_tokens or seq.length >= seq.capacity:
        seq.finish_reason = "length"


@dataclass
class StepTimes:
    """What one rank measured over the batches it ran (summed over batches)."""
    prefill_s: float = 0.0       # prompt phase: batch start until the last prompt micro-batch left this stage
    decode_s: list = field(default_factory=list)   # per generation step of a micro-batch: send -> tokens back
    gen_phase_s: float = 0.0     # the rest of each batch
    busy_s: float = 0.0          # computing
    wait_s: float = 0.0          # blocked waiting for input from another stage
    prompt_tokens: int = 0
    generated_tokens: int = 0
    kv_bytes_to_host: int = 0
    kv_bytes_to_device: int = 0
    kv_peak_device_bytes: int = 0
    attention_bytes_to_host: int = 0       # [offload] cpu_attention: host rows' q, k, v down (NumPy: "down" =
    attention_bytes_to_device: int = 0     # to the host attention) and their outputs up
    act_bytes_to_host: int = 0             # zig-zag activations' host rows ([offload] act_gpu < 100)
    act_bytes_to_device: int = 0
    act_peak_device_bytes: int = 0         # their device rows + staging buffers, or the held hidden states
    weights_peak_device_bytes: int = 0     # offloaded weights: resident + streamed layers at the peak
    weights_bytes_from_host: int = 0
    weights_bytes_from_disk: int = 0
    graph_captures: int = 0      # [runtime] cuda_graphs: decode graphs captured (once per run and key)
    graph_replays: int = 0       # decode steps run from a captured graph
    graph_eager_steps: int = 0   # decode steps of keys a graph cannot capture (cuBLAS), run eagerly instead
    batching: str = "static"     # [schedule] batching as it ran: static or continuous
    start_s: float = field(default_factory=time.perf_counter)   # the replica's start: time to first token from it
    ttft_s: list = field(default_factory=list)            # per finished sequence: first token - start_s
    token_latency_s: list = field(default_factory=list)   # per sequence of >= 2 tokens: mean time between tokens
    occupancy_steps: int = 0     # steps that could have been full (static: every decode step; continuous: while
    occupancy_running: int = 0   # prompts wait) and the running sequences summed over them
    preemptions: int = 0         # continuous: sequences preempted when the KV pool ran out
    kv_blocks_total: int = 0     # continuous: the paged pool's blocks, the most in use, and the use summed over
    kv_blocks_peak: int = 0      # steps (mean = sum / samples)
    kv_blocks_sum: int = 0
    kv_block_samples: int = 0
