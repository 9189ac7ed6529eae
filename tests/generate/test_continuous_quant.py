"""Continuous batching with the int8 / int4 KV formats in paged blocks and top-k attention over blocks (NumPy): the
tokens equal the static schedule's with the same settings, greedy and sampled, at block sizes 1 and 4, where the
continuous schedule's steps are the static schedule's (every prompt prefilled whole in one step, then decode steps:
the paged step gives the dense step's numbers). Where they are not (a prompt prefilled in chunks, a preempted
sequence's prompt + generated tokens recomputed in one prefill), the quantization and top-k are applied per step,
as the dense path applies them to that step; so with a quantized cache or top-k the scheduler feeds steps as static
does (ContinuousParams.whole_prompts): a prompt whole, a recomputed generated token one a step."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.generate.engine import GenerationParams, StepTimes
from hpcinfer.generate.paged_cache import PagedKVCache
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.slot_cache import SlotKVCache
from hpcinfer.generate.sampling import SamplingParams
from hpcinfer.generate.schedules.continuous import ContinuousParams, run_continuous
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.model.transformer import Decoder
from hpcinfer.quant.kv import kv_format

ARCH = PRESETS["tiny-dense"]          # 4 layers, 4 heads of 16, 128 positions
SETTINGS = {"int8": ("int8", 0.0), "int4": ("int4", 0.0), "topk": ("none", 0.5), "int4-topk": ("int4", 0.4)}
SAMPLING = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_k=20)}


@pytest.fixture(scope="module")
def model():
    return Decoder(NumpyOps(), Groups(), ARCH).load(PresetSource("tiny-dense", ARCH))


@pytest.fixture
def configured(model, request):
    """The model with the KV format and top-k of SETTINGS[request.param]; back to float and dense after."""
    mode, topk = SETTINGS[request.param]
    fmt = kv_format(mode, 64, ARCH.head_dim)
    yield model.set_attention(fmt, topk)
    model.set_attention(None, 0.0)


def prompts(n=9, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, ARCH.vocab_size, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def static(model, ps, params):
    return generate_batch(model, ps, list(range(len(ps))), params, StepTimes())


def continuous(model, ps, params, batch_size, step_tokens, block_size, blocks=None, whole_prompts=True,
               store="paged"):
    """[(tokens, reason)] in prompt order and the run's StepTimes, over a pool in the model's KV format."""
    runner, times, out = Runner(model, params), StepTimes(), {}
    longest = max(min(len(p) + params.max_new_tokens, ARCH.max_positions) for p in ps)
    blocks = blocks or batch_size * -(-longest // block_size)
    shape = (model.ops, model.num_local_layers, blocks, model.kv_heads_local, block_size, ARCH.head_dim)
    cache = (PagedKVCache(*shape, kv_format=model.kv_format) if store == "paged" else      # (NumPy's runtime store:
             SlotKVCache(*shape, batch_size, longest, kv_format=model.kv_format))        # generate/slot_cache.py)

    def after_step(finished):
        out.update({s.index: (s.generated, s.finish_reason) for s in finished})
        return False

    run_continuous(runner, ps, list(range(len(ps))), times,
                   ContinuousParams(batch_size, step_tokens, whole_prompts=whole_prompts), cache, after_step)
    assert cache.pool.free_blocks == cache.pool.num_blocks
    return [out[i] for i in range(len(ps))], times


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("configured", sorted(SETTINGS), indirect=True)
def test_tokens_equal_static_where_the_steps_are_static_ones(configured, sampling, block_size):
    ps, params = prompts(), GenerationParams(10, SAMPLING[sampling], seed=5, ignore_eos=True)
    want = static(configured, ps, params)
    got, times = continuous(configured, ps, params, batch_size=len(ps), step_tokens=sum(map(len, ps)),
                            block_size=block_size)
    assert times.preemptions == 0
    assert got == want


@pytest.mark.parametrize("configured", ["int4", "topk"], indirect=True)
def test_the_format_and_top_k_reach_the_paged_steps(configured):
    """The same run over a float, dense paged cache gives other tokens: the formats and top-k are not dropped."""
    ps, params = prompts(), GenerationParams(10, seed=5, ignore_eos=True)
    got, _ = continuous(configured, ps, params, batch_size=len(ps), step_tokens=sum(map(len, ps)), block_size=4)
    fmt, topk = configured.kv_format, configured.blocks[0].attn.topk
    configured.set_attention(None, 0.0)
    plain, _ = continuous(configured, ps, params, batch_size=len(ps), step_tokens=sum(map(len, ps)), block_size=4)
    configured.set_attention(fmt, topk)
    assert got != plain


@pytest.mark.parametrize("configured", ["int4", "int4-topk"], indirect=True)
def test_tokens_equal_static_with_a_small_step_budget(configured):
    """A budget below the prompts' lengths: each prompt still enters whole (the oldest one past the budget), as in
    the static schedule; fed in chunks instead, the int4 rows of a chunk would be quantized before the next chunk
    reads them, and the tokens differ."""
    ps, params = prompts(), GenerationParams(10, seed=5, ignore_eos=True)
    want = static(configured, ps, params)
    assert continuous(configured, ps, params, batch_size=4, step_tokens=4, block_size=1)[0] == want
    chunked, _ = continuous(configured, ps, params, batch_size=4, step_tokens=4, block_size=1, whole_prompts=False)
    assert chunked != want


@pytest.mark.parametrize("store", ["paged", "slots"])
@pytest.mark.parametrize("configured", ["topk", "int8", "int4-topk"], indirect=True)
def test_tokens_equal_static_with_preemption(configured, store):
    """A preempted sequence's prompt is recomputed whole and its generated tokens one a step, as static's decode
    steps computed them."""
    ps, params = prompts(), GenerationParams(10, SAMPLING["sampled"], seed=2, ignore_eos=True)
    longest = max(len(p) + 10 for p in ps)
    got, times = continuous(configured, ps, params, batch_size=4, step_tokens=16, block_size=4,
                            blocks=-(-longest // 4) + 2, store=store)
    assert times.preemptions > 0
    assert got == static(configured, ps, params)
