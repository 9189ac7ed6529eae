"""The step runner: one per rank, the role nano-vllm's ModelRunner plays (ARCHITECTURE.md, "Runner").

It holds the model (with its weight source: resident, or streamed by offload/tiers.WeightTiers) and its KV store
(`kv_store` builds it, generate/kv_store.py; `close` frees it), and does what every schedule does the same way:
  - `sequences`: the Sequence records of a batch's prompts (each seeded by its prompt's index);
  - `prompt_inputs` / `decode_inputs`: a group of sequences as one packed step (starts, counts, token ids);
  - `step`: this stage's share of one step (embedding, its layers, the LM head on the last stage), eagerly or
    from a CUDA graph, timed (StepTimes.busy_s: the one place a step's compute time is recorded);
  - `sample`: one token per sequence from the logits, the same on every tp rank, recorded in the sequences;
  - `account`: the tokens of a finished batch in the run's StepTimes.
The schedules (generate/schedules/) are loops over these. Shape legend: T=tokens of a step, S=sequences, V=vocab.
"""

from __future__ import annotations

import time

import numpy as np

from ..comm.mappings import broadcast_from_tp_root
from ..model.transformer import Decoder
from ..offload.budget import kv_format_of
from .engine import GenerationParams, Sequence, StepTimes, record_token
from . import kv_store
from .sampling import SamplingParams, sample, sequence_rng


class Runner:
    """One rank's model and the run-long state its steps share. `on_sample()` (optional) runs when logits are
    about to be sampled on the last stage (the fault injector's sampling point, faults.py)."""

    def __init__(self, model, params: GenerationParams, on_sample=None):
        self.model, self.params = model, params
        self.eos = set() if params.ignore_eos else set(model.arch.eos_token_ids)
        self.store = None                      # the KV store of the run (kv_store), freed by close()
        self.times = StepTimes()               # where `step` records its time (the schedule running it sets it)
        self.on_sample = on_sample

    @classmethod
    def load(cls, config, ckpt, ops, groups, stage, weights=None, quantize=None, after_block=None,
             on_sample=None) -> "Runner":
        """This rank's Decoder built whole for a [generate] job (its stage's layers, the KV cache format and top-k
        attention of the config, the weight source `weights`: blocks -> offload tiers, or None) and loaded from
        `ckpt` (quantized as `quantize`, a quant.storage.LoadQuant; `after_block(weights)` -> the hook run after each
        block, or None), then the runner around it. Nothing changes the model afterwards."""
        model = Decoder(ops, groups, ckpt.arch, config.model.dtype, stage, config.moe.capacity_factor,
                        kv_format=kv_format_of(config, ckpt.arch), attention_topk=config.generate.attention_topk,
                        weights=weights)
        hook = after_block(model.weights) if after_block is not None else None
        model.load(ckpt, after_block=hook, quantize=quantize)
        return cls(model, generation_params(config), on_sample)

    # ---- sequences ---------------------------------------------------------------------------------------------
    def sequences(self, prompts: list, indices: list) -> list[Sequence]:
        """A Sequence per prompt: its capacity bounded by the model's positions, its generator by its index."""
        arch, p = self.model.arch, self.params
        return [Sequence(i, list(prompt), min(len(prompt) + p.max_new_tokens, arch.max_positions),
                         sequence_rng(p.seed, i)) for i, prompt in zip(indices, prompts)]

    @staticmethod
    def prompt_inputs(seqs: list) -> tuple[list, list, np.ndarray]:
        """(starts, counts, token ids [T]) of the prompt step of `seqs`."""
        tokens = np.array([t for s in seqs for t in s.prompt], dtype=np.int64)
        return [0] * len(seqs), [len(s.prompt) for s in seqs], tokens

    @staticmethod
    def decode_inputs(seqs: list) -> tuple[list, list, np.ndarray]:
        """(starts, counts, token ids [S]) of the next decode step of `seqs`: each feeds its last token."""
        tokens = np.array([s.generated[-1] for s in seqs], dtype=np.int64)
        return [s.length - 1 for s in seqs], [1] * len(seqs), tokens

    def kv_store(self, blocks: int, block_size: int, running: int, longest: int, offload=None,
                 largest_step: int = 1):
        """The run's KV store (generate/kv_store.build; the arguments are its), replacing any earlier one."""
        self.close()
        self.store = kv_store.build(self.model, blocks, block_size, running, longest, offload, largest_step)
        return self.store

    # ---- one step ----------------------------------------------------------------------------------------------
    def step(self, cache, layout, inputs: dict, graphs=None):
        """This stage's share of one step over `cache`: inputs {"tokens": ids [T]} on the first stage, {"x": [T, D]}
        after it -> logits [S, V] on the last stage, else activations [T, D] (device arrays). A decode step replays
        its CUDA graph when `graphs` (generate/graphs.PagedDecodeGraphs) applies to it. Its time goes to
        self.times.busy_s."""
        t0 = time.perf_counter()
        cache.prepare(layout)
        if graphs is not None and graphs.applies(layout):
            out = graphs(layout, inputs)
        else:
            out = self.forward(cache, inputs, layout)
        self.times.busy_s += time.perf_counter() - t0
        return out

    def forward(self, cache, inputs: dict, layout):
        """The stage's share of one step, eagerly or under capture (what a decode graph records): [embedding],
        its layers, [final norm + LM head]."""
        model = self.model
        x = model.embed_tokens(inputs["tokens"], layout) if "tokens" in inputs else model.ops.asarray(inputs["x"])
        x = model.run_layers(x, layout, cache)
        return model.logits(x, layout) if model.stage.is_last else x

    def sample(self, seqs: list, logits) -> list[int]:
        """One token per sequence from logits [S, V] (host or device), broadcast from tp rank 0 so that every tp
        rank holds the same, recorded in `seqs` (EOS, max_new_tokens, positions: finish_reason)."""
        logits = self.model.ops.to_host(logits)
        if self.on_sample is not None:
            self.on_sample()
        chosen = sample(logits, self.params.sampling, [s.rng for s in seqs])
        chosen = broadcast_from_tp_root(chosen, self.model.tp).tolist()
        now = time.perf_counter()
        for seq, token in zip(seqs, chosen):
            record_token(seq, token, self.eos, self.params.max_new_tokens)
            seq.first_token_s = seq.first_token_s or now
            seq.finish_s = now if seq.finish_reason is not None else None
        return chosen

    @staticmethod
    def account(seqs: list, times: StepTimes) -> list:
        """Count a finished batch's tokens and latencies; [(generated ids, finish_reason)] in its order."""
        times.prompt_tokens += sum(len(s.prompt) for s in seqs)
        times.generated_tokens += sum(len(s.generated) for s in seqs)
        for s in seqs:
            if s.first_token_s is not None:
                times.ttft_s.append(s.first_token_s - times.start_s)
            if s.finish_s is not None and len(s.generated) > 1:
                times.token_latency_s.append((s.finish_s - s.first_token_s) / (len(s.generated) - 1))
        return [(s.generated, s.finish_reason) for s in seqs]

    def close(self) -> None:
        """The run is done: free its KV store."""
        self.store = None


def generation_params(config) -> GenerationParams:
    """What the [generate] section asks of every sequence."""
    g = config.generate
    return GenerationParams(g.max_new_tokens, SamplingParams(g.temperature, g.top_k, g.top_p), g.seed, g.ignore_eos)
