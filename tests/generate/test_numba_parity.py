"""A representative subset of the model and continuous-schedule parity tests under `[runtime] cpu_kernels = "numba"`
(the compiled attention, backend/compiled_attention.py): the same tokens as the NumPy reference, over the static
schedule's dense cache, the continuous schedule's paged pool and slot store (chunked prompts, preemption), and
with an int4 KV cache and top-k attention. Kept small: the full parity suite runs the numpy setting."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.cpu_kernels import NUMBA_ERROR
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.generate.engine import GenerationParams, StepTimes
from hpcinfer.generate.paged_cache import PagedKVCache
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.sampling import SamplingParams
from hpcinfer.generate.schedules.continuous import ContinuousParams, run_continuous
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.generate.slot_cache import SlotKVCache
from hpcinfer.model.transformer import Decoder
from hpcinfer.quant.kv import kv_format

pytestmark = pytest.mark.skipif(NUMBA_ERROR is not None, reason=f"numba does not import: {NUMBA_ERROR}")
ARCH = PRESETS["tiny-dense"]          # 4 layers, 4 heads of 16, 128 positions


@pytest.fixture(scope="module")
def model():
    return Decoder(NumpyOps(2, "numba"), Groups(), ARCH).load(PresetSource("tiny-dense", ARCH))


def prompts(n=7, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, ARCH.vocab_size, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def static(model, ps, params, kernels: str):
    model.ops.cpu_kernels = kernels
    try:
        return generate_batch(model, ps, list(range(len(ps))), params, StepTimes())
    finally:
        model.ops.cpu_kernels = "numba"


def continuous(model, ps, params, store, batch_size=3, step_tokens=7, block_size=4, blocks=None,
               whole_prompts=False):
    runner, times, out = Runner(model, params), StepTimes(), {}
    longest = max(min(len(p) + params.max_new_tokens, ARCH.max_positions) for p in ps)
    blocks = blocks or batch_size * -(-longest // block_size)
    shape = (model.ops, model.num_local_layers, blocks, model.kv_heads_local, block_size, ARCH.head_dim)
    cache = (PagedKVCache(*shape, kv_format=model.kv_format) if store == "paged" else
             SlotKVCache(*shape, batch_size, longest, kv_format=model.kv_format))

    def after_step(finished):
        out.update({s.index: (s.generated, s.finish_reason) for s in finished})
        return False

    run_continuous(runner, ps, list(range(len(ps))), times,
                   ContinuousParams(batch_size, step_tokens, whole_prompts=whole_prompts), cache, after_step)
    return [out[i] for i in range(len(ps))], times


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampled"])
def test_static_and_continuous_tokens_equal_the_numpy_reference(model, sampling):
    ps, params = prompts(), GenerationParams(10, sampling, seed=5, ignore_eos=True)
    want = static(model, ps, params, "numpy")
    assert static(model, ps, params, "numba") == want
    for store in ("paged", "slots"):                         # prompts in chunks of 7 tokens after cached ones
        got, _ = continuous(model, ps, params, store)
        assert got == want, store


def test_preemption_keeps_every_token(model):
    ps, params = prompts(), GenerationParams(12, SamplingParams(temperature=0.7), seed=2, ignore_eos=True)
    want = static(model, ps, params, "numpy")
    longest = max(len(p) + 12 for p in ps)
    got, times = continuous(model, ps, params, "paged", batch_size=4, step_tokens=16, blocks=-(-longest // 4) + 2)
    assert times.preemptions > 0
    assert got == want


@pytest.mark.parametrize("mode, topk", [("int4", 0.0), ("none", 0.5), ("int8", 0.4)])
def test_quantized_kv_and_top_k_tokens_equal_the_numpy_reference(model, mode, topk):
    model.set_attention(kv_format(mode, 64, ARCH.head_dim), topk)
    try:
        ps, params = prompts(), GenerationParams(10, seed=5, ignore_eos=True)
        want = static(model, ps, params, "numpy")
        assert static(model, ps, params, "numba") == want
        got, _ = continuous(model, ps, params, "paged", batch_size=len(ps), step_tokens=sum(map(len, ps)),
                            whole_prompts=True)
        assert got == want
    finally:
        model.set_attention(None, 0.0)
