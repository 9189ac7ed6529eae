"""A small Python API over the same model code, for tests, notebooks and benchmarks.

    model = load_model("model.h5")                     # one process, NumPy backend (or pass groups= for tp)
    logits = prompt_logits(model, [[1, 2, 3], [4, 5]])  # [S, V]: each prompt's last-position logits
    tokens = generate(model, prompts, max_new_tokens=8)  # greedy, ignoring EOS: generated ids per prompt
"""

from __future__ import annotations

import numpy as np

from .backend.interface import StepLayout
from .backend.ops import make_ops
from .checkpoint.format import open_checkpoint
from .comm.group import Groups
from .generate.engine import GenerationParams, StepTimes
from .generate.kv_cache import KVCache
from .generate.sampling import SamplingParams
from .generate.schedules.pipeline import generate_batch
from .model.transformer import Decoder
from .quant.storage import load_quant


def load_model(path: str, groups: Groups | None = None, dtype: str = "float32", backend: str = "numpy",
               quantize: str = "none", group_size: int | None = None, embedding: str = "int8",
               cpu_kernels: str = "auto") -> Decoder:
    """quantize: "int8" | "int4" | "asym8" quantizes a float checkpoint (or a --keep-quantized one) while loading;
    group_size None: the source's block grid, else 64; embedding: int4's embedding / LM head at 8 bits ("int8") or
    int4 ("same") (docs/quantization.md); cpu_kernels: `[runtime] cpu_kernels` (auto | numba | numpy)."""
    with open_checkpoint(path) as ckpt:
        quant = load_quant(ckpt, quantize, group_size, embedding)
        return Decoder(make_ops(backend, cpu_kernels=cpu_kernels), groups or Groups(), ckpt.arch, dtype).load(ckpt, quantize=quant)


def prompt_logits(model: Decoder, prompts: list) -> np.ndarray:
    """Prefill all prompts as one packed step; logits [S, V] float32 at each prompt's last position."""
    arch = model.arch
    cache = KVCache(model.ops, arch.num_layers, len(prompts), model.kv_heads_local,
                    max(len(p) for p in prompts), arch.head_dim, kv_format=model.kv_format)
    step = StepLayout.build(range(len(prompts)), [0] * len(prompts), [len(p) for p in prompts])
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    return model.ops.to_host(model.forward(tokens, step, cache))


def generate(model: Decoder, prompts: list, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             seed: int = 0, ignore_eos: bool = True) -> list:
    """Generated token ids of each prompt (one batch)."""
    params = GenerationParams(max_new_tokens, sampling, seed, ignore_eos)
    results = generate_batch(model, [list(p) for p in prompts], list(range(len(prompts))), params, StepTimes())
    return [tokens for tokens, _ in results]
