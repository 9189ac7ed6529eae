"""Continuous batching over the paged KV cache (generate/schedules/continuous.py, issue 21) on the NumPy backend:
the tokens of every prompt equal the static schedule's, greedy and sampled, whatever the admission order, with
prompts prefilled in chunks and sequences preempted when the pool runs out; a prompt the pool cannot hold alone
is a set-up error naming it; the replicas' shares and the commit points."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.config import ConfigError
from hpcinfer.generate.engine import GenerationParams, StepTimes
from hpcinfer.generate.paged_cache import PagedKVCache
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.sampling import SamplingParams
from hpcinfer.generate.slot_cache import SlotKVCache, SlotTables
from hpcinfer.generate.schedules.continuous import ContinuousParams, balanced_shares, run_continuous
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.generate.replica import CommitPoints
from hpcinfer.model.transformer import Decoder

ARCH = PRESETS["tiny-dense"]          # 4 layers, 4 heads of 16, 128 positions


@pytest.fixture(scope="module")
def model():
    return Decoder(NumpyOps(), Groups(), ARCH).load(PresetSource("tiny-dense", ARCH))


def prompts(n=11, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, ARCH.vocab_size, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def static(model, ps, params):
    return generate_batch(model, ps, list(range(len(ps))), params, StepTimes())


def continuous(model, ps, params, batch_size=3, step_tokens=7, blocks=None, block_size=4, order=None,
               micro_batches=1, store="paged"):
    """[(tokens, reason)] in prompt order, and the StepTimes of the run."""
    order = list(range(len(ps))) if order is None else order
    runner, times, out = Runner(model, params), StepTimes(), {}
    longest = max(min(len(p) + params.max_new_tokens, ARCH.max_positions) for p in ps)
    blocks = blocks or batch_size * -(-longest // block_size)
    shape = (model.ops, model.num_local_layers, blocks, model.kv_heads_local, block_size, ARCH.head_dim)
    cache = PagedKVCache(*shape) if store == "paged" else SlotKVCache(*shape, batch_size, longest)

    def after_step(finished):
        out.update({s.index: (s.generated, s.finish_reason) for s in finished})
        return False

    run_continuous(runner, [ps[i] for i in order], order, times,
                   ContinuousParams(batch_size, step_tokens, micro_batches), cache, after_step)
    assert cache.pool.free_blocks == cache.pool.num_blocks                      # every block given back
    return [out[i] for i in range(len(ps))], times


@pytest.fixture(scope="module")
def eos_model(model):
    """The same weights with an EOS token that the greedy answers hit at different steps: mixed stop lengths."""
    ps = prompts()
    greedy = static(model, ps, GenerationParams(12, ignore_eos=True))
    counts = {}
    for tokens, _ in greedy:
        for t in tokens[2:6]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    model.arch = dataclasses.replace(ARCH, eos_token_ids=(eos,))
    yield model
    model.arch = ARCH


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampled"])
def test_tokens_equal_static_batching(eos_model, sampling):
    ps, params = prompts(), GenerationParams(12, sampling, seed=5)
    want = static(eos_model, ps, params)
    assert len({len(t) for t, _ in want}) > 2 and {r for _, r in want} == {"stop", "length"}   # mixed stops
    got, times = continuous(eos_model, ps, params)
    assert got == want
    assert times.generated_tokens == sum(len(t) for t, _ in want) and len(times.ttft_s) == len(ps)
    assert times.occupancy_steps > 0 and times.occupancy_running == 3 * times.occupancy_steps   # full while waiting
    static_times = StepTimes()                                  # static: the batch's running sequences per step
    generate_batch(eos_model, ps, list(range(len(ps))), params, static_times)
    assert static_times.occupancy_steps == len(static_times.decode_s)
    assert 0 < static_times.occupancy_running < len(ps) * static_times.occupancy_steps    # some stopped early


def test_admission_order_and_chunk_size_do_not_change_tokens(eos_model):
    ps, params = prompts(), GenerationParams(10)
    want = static(eos_model, ps, params)
    order = list(range(len(ps)))[::-1]
    got, _ = continuous(eos_model, ps, params, batch_size=4, step_tokens=4, block_size=1, order=order)
    assert got == want


@pytest.mark.parametrize("micro_batches, store", [(1, "paged"), (3, "paged"), (1, "slots"), (3, "slots")])
def test_preemption_keeps_every_token(eos_model, micro_batches, store):
    """Also with several steps in flight (a pipeline's micro-batches; here on one stage, each step's tokens are
    taken back in launch order): a step plans only the sequences no step in flight holds, and preempts only those."""
    ps, params = prompts(), GenerationParams(12, SamplingParams(temperature=0.7), seed=2)
    want = static(eos_model, ps, params)
    longest = max(len(p) + 12 for p in ps)
    got, times = continuous(eos_model, ps, params, batch_size=4, step_tokens=16, block_size=4,
                            blocks=-(-longest // 4) + 2, micro_batches=micro_batches, store=store)
    assert times.preemptions > 0
    assert got == want
    assert 0 < times.kv_blocks_peak <= times.kv_blocks_total


def test_a_prompt_the_pool_cannot_hold_is_named(model):
    ps = [[1, 2, 3], list(range(60))]
    with pytest.raises(ConfigError, match=r"prompt 1: 70 positions .* raise \[schedule\] kv_cache_memory"):
        continuous(model, ps, GenerationParams(10), blocks=10, block_size=4)


def test_balanced_shares_split_predicted_work():
    lengths = [100, 10, 90, 20, 30, 80, 5, 60]
    shares = balanced_shares(lengths, 3)
    assert sorted(i for s in shares for i in s) == list(range(8)) and all(s == sorted(s) for s in shares)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths[i] for s in shares for i in s) and max(loads) <= 140
    assert balanced_shares([7], 2) == [[0], []]


def test_commit_points_call_end_round_the_same_number_of_times():
    calls = []

    def end_round(results):
        calls.append(sorted(i for i, _, _ in results))
        return False

    points = CommitPoints(share=list(range(5)), points=3, end_round=end_round)   # thresholds 2, 4, 5
    fin = lambda *ids: [type("S", (), {"index": i, "generated": [i], "finish_reason": "stop"}) for i in ids]
    assert not points.after_step(fin(0)) and calls == []
    assert not points.after_step(fin(1, 2)) and calls == [[0, 1, 2]]
    points.after_step(fin(3, 4))
    assert calls == [[0, 1, 2], [3, 4], []]                # the 4th and 5th finished at once: two points pass
    idle = CommitPoints(share=[], points=2, end_round=end_round)
    idle.finish()
    assert calls[-2:] == [[], []]                           # a replica with no share still takes part


def test_commit_points_stop_when_end_round_says_so():
    points = CommitPoints(share=list(range(4)), points=4, end_round=lambda results: True)
    fin = [type("S", (), {"index": 0, "generated": [], "finish_reason": "stop"})]
    assert points.after_step(fin) is True
    points.finish()                                          # no further end_round after a stop
    assert points.thresholds == [2, 3, 4]


def test_slot_tables_give_each_running_sequence_its_own_slot():
    """generate/slot_cache.SlotTables: the lowest free slot when a table starts, back when it is released; the
    block accounting is BlockTables'; more running sequences than slots is an error, not an overwrite."""
    from hpcinfer.generate.block_manager import BlockPool

    tables = SlotTables(BlockPool(10, 4), 2)
    tables.grow("a", 5)
    tables.grow("b", 1)
    tables.grow("a", 9)                                    # a grows: same slot
    assert tables.slot == {"a": 0, "b": 1} and tables.pool.used_blocks == 4
    with pytest.raises(RuntimeError, match="every slot"):
        tables.grow("c", 1)
    assert tables.release("a") == 3 and tables.slot == {"b": 1}
    tables.grow("c", 2)
    assert tables.slot["c"] == 0 and tables.pool.used_blocks == 2


def test_slot_store_orders_decode_rows_by_slot_and_a_new_one_last(model):
    """SlotKVCache.row_order: the scheduler sorts a step's decode rows by it, so that they read a view of the
    dense cache; a one-token prompt about to take its slot has none yet and comes after every slot."""
    cache = SlotKVCache(model.ops, model.num_local_layers, 8, model.kv_heads_local, 4, ARCH.head_dim, 3, 16)
    for seq in ("x", "y"):
        cache.tables.grow(seq, 3)
    cache.tables.release("x")
    cache.tables.grow("z", 3)                              # z takes slot 0 again
    assert [cache.row_order(s) for s in ("z", "y", "new")] == [0, 1, 3]


def test_tokens_equal_static_batching_with_compiled_kernels():
    """The same under `[runtime] cpu_kernels = "numba"` (backend/cpu_kernels: each token's projections sum in an
    order that does not depend on the step it is in, up to the crossover to BLAS)."""
    model = Decoder(NumpyOps(cpu_kernels="numba"), Groups(), ARCH).load(PresetSource("tiny-dense", ARCH))
    ps, params = prompts(), GenerationParams(12, ignore_eos=True)
    got, _ = continuous(model, ps, params)
    assert got == static(model, ps, params)
