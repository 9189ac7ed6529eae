"""hpcinfer.api, the Python API the benchmarks in bench/ use: load_model takes a job's [model] KV keys and
[generate] attention_topk, and generate runs `hpcinfer run`'s default path (continuous batching) with the same
tokens as a static batch, filling the caller's StepTimes."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.api import generate, load_model
from hpcinfer.arch import tensor_shapes
from hpcinfer.checkpoint.presets import PRESETS, open_preset
from hpcinfer.checkpoint.writer import CheckpointWriter
from hpcinfer.config import ScheduleSection
from hpcinfer.generate.engine import StepTimes
from hpcinfer.generate.sampling import SamplingParams

ARCH = PRESETS["tiny-dense"]
STATIC = ScheduleSection(batching="static")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "tiny.h5"
    source = open_preset("tiny-dense")
    with CheckpointWriter(str(path), ARCH, "float32") as w:
        for name in tensor_shapes(ARCH):
            w.add(name, source.read(name))
    return str(path)


def prompts(n=7, seed=2):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, ARCH.vocab_size, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]


def test_load_model_takes_the_kv_keys_and_top_k(checkpoint):
    model = load_model(checkpoint, kv_cache="int8", kv_cache_group=8, attention_topk=0.5)
    assert (model.kv_format.mode, model.kv_format.group) == ("int8", 8)
    assert {b.attn.topk for b in model.blocks} == {0.5}
    plain = load_model(checkpoint)
    assert plain.kv_format is None and {b.attn.topk for b in plain.blocks} == {0.0}


@pytest.mark.parametrize("kv, topk", [("none", 0.0), ("int8", 0.5)])
def test_generate_runs_continuous_batching_with_static_tokens(checkpoint, kv, topk):
    model = load_model(checkpoint, kv_cache=kv, kv_cache_group=16, attention_topk=topk)
    ps, sampling = prompts(), SamplingParams(temperature=0.8, top_k=20)
    times = StepTimes()
    got = generate(model, ps, 6, sampling, seed=3, times=times)
    want = generate(model, ps, 6, sampling, seed=3, schedule=STATIC)
    assert got == want and all(len(t) == 6 for t in got)
    assert times.batching == "continuous" and len(times.decode_s) == 5 and times.prefill_s > 0
    assert times.generated_tokens == 6 * len(ps) and times.kv_peak_device_bytes > 0


def test_generate_chunks_prompts_by_max_batch_tokens(checkpoint):
    """Prompt steps of at most max_batch_tokens: more steps, the same greedy tokens."""
    model, ps = load_model(checkpoint), prompts()
    small, whole = StepTimes(), StepTimes()
    got = generate(model, ps, 4, schedule=ScheduleSection(max_batch_tokens=8), times=small)
    assert got == generate(model, ps, 4, times=whole) == generate(model, ps, 4, schedule=STATIC)
    tokens = sum(len(p) for p in ps)                                  # every step's launch is one pool sample
    assert whole.kv_block_samples < small.kv_block_samples and small.kv_block_samples >= -(-tokens // 8)
