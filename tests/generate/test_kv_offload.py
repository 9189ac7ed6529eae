"""KV-cache offload (generate/kv_cache.py) and early stopping, through the one-stage executor `generate_batch`.

One tiny llama_mha model (2 layers, 4 KV heads of 16: 512 bytes of K+V per token and layer) is converted once per
module. 8 prompts of mixed lengths run in micro-batches with and without offload: tokens must not change, the
device-side KV bytes must stay under the threshold at every step, and bytes must really move both ways.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import save_tiny_model  # noqa: E402

from hpcinfer.api import load_model  # noqa: E402
from hpcinfer.checkpoint.hf import convert_hf  # noqa: E402
from hpcinfer.errors import ConfigError  # noqa: E402
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes  # noqa: E402
from hpcinfer.generate.schedules.pipeline import generate_batch  # noqa: E402
from hpcinfer.generate.kv_cache import KVCache, KVOffload, plan_offload  # noqa: E402
from hpcinfer.quant.kv import kv_bytes_per_token  # noqa: E402
from hpcinfer.generate.sampling import SamplingParams  # noqa: E402
from hpcinfer.parallel.micro_batches import micro_batches

PROMPT_LENGTHS = (5, 5, 12, 1, 9, 3, 16, 7)     # prompt 1 is a copy of prompt 0: micro-batch {0, 1} stops whole
MAX_NEW = 8
N = len(PROMPT_LENGTHS)
LAYERS, KV_HEADS, HEAD_DIM = 2, 4, 16
MAX_LEN = max(PROMPT_LENGTHS) + MAX_NEW           # every capacity is below the model's 128 positions
PER_SEQ_LAYER = kv_bytes_per_token(KV_HEADS, HEAD_DIM, 1) * MAX_LEN     # 512 * 24 bytes
FULL_CACHE = N * LAYERS * PER_SEQ_LAYER


def threshold_for(pool_slots: int) -> int:
    """Room for every sequence in the layer kept on the device plus `pool_slots` sequences in the pooled one."""
    return (N * (LAYERS - 1) + pool_slots) * PER_SEQ_LAYER


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_offload")
    ckpt = root / "tiny.h5"
    arch = convert_hf(save_tiny_model("llama_mha", root / "hf"), str(ckpt))
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    return load_model(str(ckpt))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    out = [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENGTHS]
    out[1] = list(out[0])
    return out


def run(model, prompts, prompt_mb=4, gen_mb=4, offload=None, ignore_eos=True, sampling=SamplingParams(),
        seed=0):
    times = StepTimes()
    results = generate_batch(model, prompts, list(range(len(prompts))),
                             GenerationParams(MAX_NEW, sampling, seed, ignore_eos), times,
                             ScheduleParams(prompt_mb, gen_mb, offload))
    return results, times


@pytest.fixture(scope="module")
def baseline(model, prompts):
    """Greedy, no offload, EOS ignored: [(tokens, finish_reason)]."""
    results, times = run(model, prompts)
    assert times.kv_bytes_to_host == times.kv_bytes_to_device == 0
    assert all(len(tokens) == MAX_NEW for tokens, _ in results)
    return results


@pytest.fixture
def prepared(monkeypatch):
    """Record every KVCache.prepare call: what the cache held on the device once the micro-batch had its slots."""
    calls = []
    original = KVCache.prepare

    def recording(self, seqs):
        original(self, seqs)
        seqs = [int(s) for s in seqs]
        slots = [int(self.slot_of[s]) for s in seqs]
        calls.append({"seqs": seqs, "slots": slots, "nbytes": self.nbytes, "pooled": set(self.pooled),
                      "capacity": self.capacity, "resident": int((self.slot_of >= 0).sum()),
                      "shapes": [a.shape[0] for a in self.k + self.v]})

    monkeypatch.setattr(KVCache, "prepare", recording)
    return calls


# ------------------------------------------------------------------------------------------------- planning

def test_plan_offload_by_hand():
    """4 layers starting at global layer 2, 8 sequences of 24 positions (12,288 bytes per sequence and layer).
    parity 1 pools global layers 3 and 5 = local 1 and 3; the other two keep 8 sequences each (196,608 bytes), so a
    threshold of 300,000 leaves (300,000 - 196,608) // (2 * 12,288) = 4 pool slots."""
    pooled, capacity = plan_offload(4, 2, 8, KV_HEADS, MAX_LEN, HEAD_DIM, KVOffload(300_000, 1), 2)
    assert (pooled, capacity) == ({1, 3}, 4)
    pooled, capacity = plan_offload(4, 2, 8, KV_HEADS, MAX_LEN, HEAD_DIM, KVOffload(300_000, 0), 2)
    assert (pooled, capacity) == ({0, 2}, 4)
    assert plan_offload(4, 2, 8, KV_HEADS, MAX_LEN, HEAD_DIM, None, 2) == (set(), 8)
    full = 8 * 4 * PER_SEQ_LAYER
    assert plan_offload(4, 2, 8, KV_HEADS, MAX_LEN, HEAD_DIM, KVOffload(full, 1), 2) == (set(), 8)
    with pytest.raises(ConfigError, match="kv_offload_threshold = 300000 bytes"):
        plan_offload(4, 2, 8, KV_HEADS, MAX_LEN, HEAD_DIM, KVOffload(300_000, 1), 5)


@pytest.mark.parametrize("parity", [0, 1])
def test_the_forcing_threshold_leaves_two_pool_slots(parity):
    assert plan_offload(LAYERS, 0, N, KV_HEADS, MAX_LEN, HEAD_DIM, KVOffload(threshold_for(2), parity), 2) == \
        ({parity}, 2)


# --------------------------------------------------------------------------------------------- offload on

OFFLOAD_CASES = {          # (prompt micro-batches, gen micro-batches, pool slots = the largest micro-batch)
    "4-4": (4, 4, 2),
    "hybrid-2-4": (2, 4, 4),
    "hybrid-4-2": (4, 2, 4),
    "8-8": (8, 8, 1),
}


@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("prompt_mb, gen_mb, slots", OFFLOAD_CASES.values(), ids=OFFLOAD_CASES.keys())
def test_offload_gives_the_same_tokens_and_stays_under_the_threshold(model, prompts, baseline, prepared, parity,
                                                                     prompt_mb, gen_mb, slots):
    """(a) same tokens; (b) at every step the device KV bytes are <= the threshold, at most `slots` sequences
    hold a pool slot, every sequence of the step has one (distinct), and bytes went both ways."""
    threshold = threshold_for(slots)
    assert threshold < FULL_CACHE
    results, times = run(model, prompts, prompt_mb, gen_mb, KVOffload(threshold, parity))
    assert results == baseline

    assert prepared, "KVCache.prepare was never called"
    for call in prepared:
        assert call["nbytes"] <= threshold
        assert call["pooled"] == {i for i in range(LAYERS) if i % 2 == parity}    # only this rank's parity
        assert call["capacity"] == slots and call["resident"] <= slots
        assert all(slot >= 0 for slot in call["slots"]) and len(set(call["slots"])) == len(call["slots"])
        # the pooled layer has `slots` rows, the other one a row per sequence (K then V arrays)
        assert call["shapes"] == [slots if i % 2 == parity else N for i in range(LAYERS)] * 2
    assert max(call["resident"] for call in prepared) == slots
    assert times.kv_bytes_to_host > 0 and times.kv_bytes_to_device > 0
    assert times.kv_peak_device_bytes <= threshold
    # a sequence's pooled K+V is PER_SEQ_LAYER bytes: whole sequences move
    assert times.kv_bytes_to_host % PER_SEQ_LAYER == 0 and times.kv_bytes_to_device % PER_SEQ_LAYER == 0
    assert times.kv_bytes_to_device <= times.kv_bytes_to_host          # only what went out comes back


@pytest.mark.parametrize("parity", [0, 1])
def test_a_threshold_below_one_micro_batch_is_a_config_error(model, prompts, parity):
    """(c) 4 micro-batches of 2 sequences, room for 1 in the pool."""
    threshold = threshold_for(1)
    with pytest.raises(ConfigError, match=f"kv_offload_threshold = {threshold} bytes") as info:
        run(model, prompts, 4, 4, KVOffload(threshold, parity))
    assert "micro-batch of 2 sequences" in str(info.value)
    with pytest.raises(ConfigError, match="kv_offload_threshold = 1000 bytes"):
        run(model, prompts, 4, 4, KVOffload(1000, parity))            # not even the resident layer fits


@pytest.mark.parametrize("threshold", [FULL_CACHE, FULL_CACHE + 1, 10 * FULL_CACHE])
def test_a_threshold_above_the_full_cache_pools_nothing(model, prompts, baseline, prepared, threshold):
    """(d)"""
    results, times = run(model, prompts, 4, 4, KVOffload(threshold, 0))
    assert results == baseline
    assert prepared and all(call["pooled"] == set() and call["nbytes"] == FULL_CACHE for call in prepared)
    assert times.kv_bytes_to_host == times.kv_bytes_to_device == 0
    assert times.kv_peak_device_bytes == FULL_CACHE


@pytest.mark.parametrize("parity", [0, 1])
def test_sampling_with_offload_gives_the_same_tokens(model, prompts, baseline, parity):
    """(e) every sequence owns its generator, so moving its KV cache around changes nothing."""
    sampling = SamplingParams(temperature=0.8, top_k=20)
    plain, _ = run(model, prompts, 4, 4, None, sampling=sampling, seed=3)
    offloaded, times = run(model, prompts, 4, 4, KVOffload(threshold_for(2), parity), sampling=sampling, seed=3)
    assert offloaded == plain
    assert plain != baseline                                         # it did sample
    assert times.kv_bytes_to_host > 0


# ------------------------------------------------------------------------------------ early stopping (EOS)

def truncated(results, eos: set):
    """What greedy decoding gives when generation stops at the first token in `eos` (kept, reason "stop")."""
    out = []
    for tokens, _ in results:
        stop = next((k for k, t in enumerate(tokens) if t in eos), None)
        out.append((tokens, "length") if stop is None else (tokens[:stop + 1], "stop"))
    return out


@pytest.fixture(scope="module")
def eos_case(model, baseline):
    """The model with three more EOS tokens, taken from the greedy run: the 3rd token of prompts 0 and 1
    (identical, so gen micro-batch {0, 1} stops whole after 3 tokens), the 1st of prompt 3 (it stops in the prompt
    phase, its micro-batch partner goes on) and the 5th of prompt 4. The checkpoint's own EOS (2) also counts:
    prompt 6 generates it as its 3rd token. Other sequences may stop wherever one of these tokens comes up."""
    extra = {baseline[0][0][2], baseline[3][0][0], baseline[4][0][4]}
    eos = {*model.arch.eos_token_ids, *extra}
    stopping = copy.copy(model)
    stopping.arch = dataclasses.replace(model.arch, eos_token_ids=tuple(sorted(eos)))
    expected = truncated(baseline, eos)
    lengths = [len(tokens) for tokens, _ in expected]
    # the scenario this module's prompts give (checked, so a change of weights or prompts shows here)
    assert lengths[0] == lengths[1] == 3 and lengths[3] == 1 and lengths[4] == 5, lengths
    assert "length" in {reason for _, reason in expected}, expected
    mixed = [g for g in micro_batches(N, 4) if len({lengths[s] for s in g}) > 1]
    assert len(mixed) >= 2, "some micro-batches should hold a sequence that stops before the other"
    return stopping, expected


@pytest.mark.parametrize("prompt_mb, gen_mb", [(1, 1), (4, 4), (2, 4), (4, 2), (8, 8)])
def test_sequences_stop_at_eos_inside_micro_batches(eos_case, prompts, prepared, prompt_mb, gen_mb):
    """Each sequence stops at its own EOS; the static policy's steps (generate/schedules/continuous.py) hold the
    prompts in steps of at most N / prompt_mb sequences, then only running sequences, at most N / gen_mb a step,
    one step per generated token after the first of each (a finished sequence leaves)."""
    stopping, expected = eos_case
    results, times = run(stopping, prompts, prompt_mb, gen_mb, ignore_eos=False)
    assert results == expected
    assert times.generated_tokens == sum(len(tokens) for tokens, _ in expected)
    prompt_steps = -(-N // -(-N // prompt_mb))
    sizes = [len(call["seqs"]) for call in prepared]
    assert sum(sizes[:prompt_steps]) == N and max(sizes[:prompt_steps]) <= -(-N // prompt_mb)
    assert max(sizes[prompt_steps:]) <= -(-N // gen_mb)
    assert sum(sizes[prompt_steps:]) == sum(len(tokens) - 1 for tokens, _ in expected)


@pytest.mark.parametrize("parity", [0, 1])
def test_eos_with_offload(eos_case, prompts, prepared, parity):
    stopping, expected = eos_case
    threshold = threshold_for(2)
    results, times = run(stopping, prompts, 4, 4, KVOffload(threshold, parity), ignore_eos=False)
    assert results == expected
    assert all(call["nbytes"] <= threshold for call in prepared)
    assert times.kv_bytes_to_host > 0


def test_eos_ignored_runs_to_max_new_tokens(eos_case, prompts, baseline):
    stopping, _ = eos_case
    results, _ = run(stopping, prompts, 4, 4, ignore_eos=True)
    assert results == baseline
