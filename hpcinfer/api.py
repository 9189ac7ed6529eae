"""A small Python API over the same model code, for tests, notebooks and benchmarks (the repository's bench/).

    model = load_model("model.h5")                     # one process, NumPy backend (or pass groups= for tp)
    logits = prompt_logits(model, [[1, 2, 3], [4, 5]])  # [S, V]: each prompt's last-position logits
    tokens = generate(model, prompts, max_new_tokens=8)  # greedy, ignoring EOS: generated ids per prompt

load_model's arguments are the `[model]` keys of a job (and `[generate] attention_topk`); generate runs the path
`hpcinfer run` runs by default (continuous batching), with `[schedule]` keys as a config.ScheduleSection.
"""

from __future__ import annotations

import numpy as np

from .backend.interface import StepLayout
from .backend.ops import make_ops
from .checkpoint.format import open_checkpoint
from .comm.group import Groups
from .config import ScheduleSection
from .generate.engine import GenerationParams, ScheduleParams, StepTimes
from .generate.graphs import paged_decode_graphs
from .generate.kv_cache import KVCache
from .generate.replica import kv_pool_blocks
from .generate.runner import Runner
from .generate.sampling import SamplingParams
from .generate.schedules.continuous import ContinuousParams, run_sequences
from .generate.schedules.pipeline import generate_batch
from .model.transformer import Decoder
from .quant.kv import kv_format
from .quant.storage import load_quant


def load_model(path: str, groups: Groups | None = None, dtype: str = "float32", backend: str = "numpy",
               quantize: str = "none", group_size: int | None = None, embedding: str = "int8",
               kv_cache: str = "none", kv_cache_group: int = 64, attention_topk: float = 0.0,
               device: int = 0, cpu_kernels: str = "auto") -> Decoder:
    """quantize: "int8" | "int4" | "asym8" quantizes a float checkpoint (or a --keep-quantized one) while loading;
    group_size None: the source's block grid, else 64; embedding: int4's embedding / LM head at 8 bits ("int8") or
    int4 ("same") (docs/quantization.md). kv_cache, kv_cache_group: `[model] kv_cache` and `kv_cache_group`;
    attention_topk: `[generate] attention_topk`. device: the GPU of backend "cupy". cpu_kernels: `[runtime]
    cpu_kernels` (auto | numba | numpy)."""
    with open_checkpoint(path) as ckpt:
        quant = load_quant(ckpt, quantize, group_size, embedding)
        kv = kv_format(kv_cache, kv_cache_group, ckpt.arch.head_dim)
        kv_dtype = dtype if dtype in ("float16", "bfloat16") else "float32"     # [model] kv_dtype = "auto"
        ops = make_ops(backend, device, cpu_kernels=cpu_kernels, kv_dtype=kv_dtype)
        return Decoder(ops, groups or Groups(), ckpt.arch, dtype, kv_format=kv,
                       attention_topk=attention_topk).load(ckpt, quantize=quant)


def prompt_logits(model: Decoder, prompts: list) -> np.ndarray:
    """Prefill all prompts as one packed step; logits [S, V] float32 at each prompt's last position."""
    arch = model.arch
    cache = KVCache(model.ops, arch.num_layers, len(prompts), model.kv_heads_local,
                    max(len(p) for p in prompts), arch.head_dim, kv_format=model.kv_format)
    step = StepLayout.build(range(len(prompts)), [0] * len(prompts), [len(p) for p in prompts])
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    return model.ops.to_host(model.forward(tokens, step, cache))


def generate(model: Decoder, prompts: list, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             seed: int = 0, ignore_eos: bool = True, *, schedule: ScheduleSection = ScheduleSection(),
             cuda_graphs: bool = False, times: StepTimes | None = None) -> list:
    """Generated token ids of each prompt, as `hpcinfer run` generates them on one rank with every prompt in one
    running set (batch_size = the prompts): continuous batching over the paged KV store by default, or one static
    batch with `schedule.batching = "static"`. cuda_graphs: `[runtime] cuda_graphs`. `times` (a StepTimes), when
    given, collects the run's step timings (prefill_s, decode_s per step) and counters."""
    params = GenerationParams(max_new_tokens, sampling, seed, ignore_eos)
    times = StepTimes() if times is None else times
    prompts, indices = [list(p) for p in prompts], list(range(len(prompts)))
    if schedule.batching == "static":
        times.batching = "static"
        results = generate_batch(model, prompts, indices, params, times, ScheduleParams(cuda_graphs=cuda_graphs))
        return [tokens for tokens, _ in results]
    times.batching = "continuous"
    return _continuous(Runner(model, params), prompts, indices, times, schedule, cuda_graphs)


def _continuous(runner: Runner, prompts: list, indices: list, times: StepTimes, schedule: ScheduleSection,
                cuda_graphs: bool) -> list:
    """The prompts batched continuously, all of them running at once (replica.run_share on one rank)."""
    model, seqs = runner.model, runner.sequences(prompts, indices)
    running, longest = max(1, len(seqs)), max((s.capacity for s in seqs), default=1)
    exact = model.kv_format is not None or any(0 < b.attn.topk < 1 for b in model.blocks)   # as static steps
    params = ContinuousParams(running, schedule.step_tokens(running), whole_prompts=exact)
    cache = runner.kv_store(kv_pool_blocks(model, schedule, running, longest), schedule.kv_block_size, running,
                            longest, None, max(params.step_sequences, params.prompt_step_sequences))
    graphs = paged_decode_graphs(runner, cache, cuda_graphs)
    try:
        run_sequences(runner, seqs, times, params, cache, graphs=graphs)
    finally:
        if graphs is not None:
            graphs.close()
        runner.close()
    cache.report(times)
    return [s.generated for s in seqs]
