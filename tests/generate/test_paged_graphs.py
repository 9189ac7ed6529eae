"""CUDA graphs of the continuous schedule's decode steps (generate/graphs.PagedDecodeGraphs, issue 21): a decode
step over the paged KV cache is padded to batch_bucket(S) rows and captured once per (padded rows, KV bucket), its
block tables, lengths and positions in the graph's device buffers (cupy_graphs.PagedDeviceStep); prefill and mixed
steps stay eager.

Checked on the CPU stand-in of cupy (tests/helpers/emu_cupy/: any host <-> device copy during a capture raises,
replays rerun what was recorded with the buffers' new contents): the continuous schedule's tokens with graphs on
equal those with graphs off and NumPy's, for a GPT-2-like and a Llama-like GQA model, over running sets of 1 to 3
sequences (3 padded to 4) that cross the 64-position KV bucket, with one capture per key and every later decode step
replayed; the padding rows write only the cache's spare block (every other pool row as the eager step leaves it,
over a poisoned pool, across replays with other tables); keys that call cuBLAS run eagerly, on their real rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_graphs import tiny_models

from hpcinfer.backend.cupy_graphs import PagedDeviceStep, batch_bucket, fixed_width, kv_bucket
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.comm.group import Groups
from hpcinfer.config import load_config
from hpcinfer.generate.engine import GenerationParams, StepTimes
from hpcinfer.generate.graphs import pad_step, paged_decode_graphs
from hpcinfer.generate.paged_cache import PagedKVCache
from hpcinfer.generate.runner import Runner
from hpcinfer.config import batching_mode, unsupported
from hpcinfer.generate.schedules.continuous import ContinuousParams, run_continuous
from hpcinfer.model.transformer import Decoder

# 5 prompts over a running set of 3 (decode steps of 3 sequences: padded to 4; of 2 and 1 as the queue runs dry);
# 50 and 61 cross the first KV bucket (64) while decoding; step_tokens 16 chunks them (mixed steps)
PROMPT_LENGTHS, NEW_TOKENS, BATCH, STEP_TOKENS = (50, 9, 61, 30, 5), 8, 3, 16


def prompts_for(vocab: int, lengths=PROMPT_LENGTHS) -> list:
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def run(model, prompts, cuda_graphs: bool):
    """The continuous schedule over a pool of 16-position blocks -> (tokens in prompt order, the graphs or None,
    the layout of every step the runner ran, the layout of every forward pass, the run's StepTimes)."""
    runner = Runner(model, GenerationParams(NEW_TOKENS, ignore_eos=True))
    cache = PagedKVCache(model.ops, model.num_local_layers, 40, model.kv_heads_local, 16, model.arch.head_dim)
    steps, forwards, out = [], [], {}
    step, forward = runner.step, runner.forward
    runner.step = lambda cache, layout, inputs, graphs=None: steps.append(layout) or step(cache, layout, inputs, graphs)
    runner.forward = lambda cache, inputs, layout: forwards.append(layout) or forward(cache, inputs, layout)
    graphs = paged_decode_graphs(runner, cache, cuda_graphs)      # (after the spies: it keeps runner.forward)

    def after_step(finished):
        out.update({s.index: s.generated for s in finished})
        return False

    times = StepTimes()
    run_continuous(runner, prompts, list(range(len(prompts))), times, ContinuousParams(BATCH, STEP_TOKENS),
                   cache, after_step, graphs=graphs)
    return [out[i] for i in range(len(prompts))], graphs, steps, forwards, times


def decode_keys(steps) -> set:
    """(padded rows, KV bucket) of the pure decode steps among `steps`."""
    return {(batch_bucket(s.num_seqs), kv_bucket(int(s.starts.max()) + 1)) for s in steps if s.is_decode}


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
def test_continuous_tokens_with_graphs_equal_eager_and_numpy(emu_cupy, name):
    from hpcinfer.backend.cupy_ops import CupyOps

    source = tiny_models()[name]
    prompts = prompts_for(source.arch.vocab_size)
    want, *_ = run(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, False)
    model = Decoder(CupyOps(device=0, kernels=True), Groups(), source.arch).load(source)
    eager, none, *_ = run(model, prompts, False)
    got, graphs, steps, _, run_times = run(model, prompts, True)
    assert none is None and eager == want and got == want
    decode = [s for s in steps if s.is_decode and s.num_seqs]
    keys = decode_keys(decode)
    assert {s.num_seqs for s in decode} == {1, 2, 3} and (4, 128) in keys and (4, 64) in keys  # padded; 2 buckets
    assert any(not s.is_decode for s in steps) and not any(graphs.applies(s) for s in steps if not s.is_decode)
    assert sorted(graphs.graph.captured) == sorted(keys) and graphs.captures == len(keys)      # once per key
    assert graphs.steps == len(decode) > len(keys)                 # every decode step here; mixed ones eager
    assert (graphs.replays, graphs.eager_steps) == (len(decode), 0)
    counted = (len(keys), len(decode), 0)
    assert (run_times.graph_captures, run_times.graph_replays, run_times.graph_eager_steps) == counted  # recorded
    graphs.record(run_times)                                       # nothing new: adds nothing
    assert (run_times.graph_captures, run_times.graph_replays, run_times.graph_eager_steps) == counted
    graphs.close()


def test_padding_rows_write_only_the_spare_block(emu_cupy):
    """Three sequences decode through a graph (3 rows padded to 4: capture, then replays with the sequences in
    another order and their tables grown into new blocks) and through the eager step on a copy of the cache: the
    same logits; every pool row outside the spare block as the eager step leaves it (the unwritten rows of a pool
    poisoned with NaN stay NaN); in the spare block, only position 0 (the padding row's) was written."""
    from hpcinfer.backend.cupy_ops import CupyOps

    source = tiny_models()["llama-like"]
    ops = CupyOps(device=0, kernels=True)
    model = Decoder(ops, Groups(), source.arch).load(source)
    runner = Runner(model, GenerationParams(1))
    caches = [PagedKVCache(ops, model.num_local_layers, 12, model.kv_heads_local, 4, source.arch.head_dim)
              for _ in range(2)]                                    # [0]: through the graphs, [1]: eager
    lengths = [5, 9, 3]
    prompts = prompts_for(source.arch.vocab_size, lengths)
    for cache in caches:
        for pool in cache.k + cache.v:
            pool.fill(np.nan)
        for s, n in enumerate(lengths):
            cache.tables.grow(s, n)
        runner.forward(cache, {"tokens": np.concatenate(prompts)}, cache.layout([0, 1, 2], [0, 0, 0], lengths))
    graphs = paged_decode_graphs(runner, caches[0], True)
    rng = np.random.default_rng(5)
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        starts = [lengths[s] for s in order]
        for cache in caches:
            for s in order:
                cache.tables.grow(s, lengths[s] + 1)
        tokens = rng.integers(0, source.arch.vocab_size, size=3)
        got = graphs(caches[0].layout(order, starts, [1] * 3), {"tokens": tokens})
        want = runner.forward(caches[1], {"tokens": tokens}, caches[1].layout(order, starts, [1] * 3))
        np.testing.assert_allclose(ops.to_host(got), ops.to_host(want), rtol=1e-5, atol=1e-5)
        for s in order:
            lengths[s] += 1
        spare = caches[0].spare_block
        for graphed, eager in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            graphed, eager = ops.to_host(graphed), ops.to_host(eager)
            np.testing.assert_allclose(graphed[:spare], eager[:spare], rtol=1e-6, atol=1e-6)   # NaN where NaN
            assert np.isfinite(graphed[spare, :, 0]).all() and np.isnan(graphed[spare, :, 1:]).all()
            assert np.isnan(eager[spare]).all()
    assert list(graphs.graph.captured) == [(4, 64)] and (graphs.captures, graphs.replays) == (1, 3)
    assert max(len(t) for t in caches[0].tables.tables.values()) == 3              # tables of several blocks
    graphs.close()


def test_keys_that_call_cublas_run_eagerly_on_their_real_rows(emu_cupy):
    """The plain-CuPy path calls cuBLAS in every decode step: each key's first step runs padded as the warm-up,
    is refused capture, and every later step of that key runs eagerly without the padding rows. Same tokens."""
    from hpcinfer.backend.cupy_ops import CupyOps

    source = tiny_models()["gpt2-like"]
    prompts = prompts_for(source.arch.vocab_size)
    want, *_ = run(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, False)
    model = Decoder(CupyOps(device=0, kernels=False), Groups(), source.arch).load(source)
    got, graphs, steps, forwards, _ = run(model, prompts, True)
    assert got == want
    decode = [s for s in steps if s.is_decode and s.num_seqs]
    keys = decode_keys(decode)
    assert graphs.captures == 0 and graphs.replays == 0 and graphs.eager_steps == len(decode)
    assert sorted(graphs.graph.eager_keys) == sorted(keys)
    warm_ups = [f for f in forwards if isinstance(f, PagedDeviceStep)]
    assert len(warm_ups) == len(keys) and all(f.num_seqs == batch_bucket(f.num_seqs) for f in warm_ups)
    assert any(s.num_seqs == 3 for s in decode)                    # a key whose warm-up ran a padding row
    eager = [f for f in forwards if f.is_decode and not isinstance(f, PagedDeviceStep)]
    assert len(eager) == len(decode) - len(keys)
    assert all(any(f is s for s in decode) for f in eager)          # the scheduler's own (unpadded) layouts


def test_pad_step_and_the_buckets():
    step = StepLayout.paged([[3, 7, -1], [5, -1, -1], [0, 1, 2]], 4, [6, 2, 9], [1, 1, 1])
    padded = pad_step(step, batch_bucket(3), spare_block=12)
    np.testing.assert_array_equal(padded.tables, [[3, 7, -1], [5, -1, -1], [0, 1, 2], [12, -1, -1]])
    np.testing.assert_array_equal(padded.starts, [6, 2, 9, 0])
    assert padded.is_decode and padded.block_size == 4
    np.testing.assert_array_equal(padded.flat_slots(), [30, 22, 9, 48])          # the padding row: spare, row 0
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    np.testing.assert_array_equal(fixed_width(padded.tables, 4), [[3, 7, -1, -1], [5, -1, -1, -1], [0, 1, 2, -1],
                                                                  [12, -1, -1, -1]])
    np.testing.assert_array_equal(fixed_width(padded.tables, 2), [[3, 7], [5, -1], [0, 1], [12, -1]])


def test_numpy_backend_gets_no_paged_graphs():
    source = tiny_models()["gpt2-like"]
    model = Decoder(NumpyOps(), Groups(), source.arch).load(source)
    runner = Runner(model, GenerationParams(1))
    cache = PagedKVCache(model.ops, model.num_local_layers, 4, model.kv_heads_local, 16, source.arch.head_dim)
    assert paged_decode_graphs(runner, cache, True) is None and paged_decode_graphs(runner, cache, False) is None


def test_a_quantized_pool_runs_eagerly_and_says_so(emu_cupy, caplog):
    """Its blocks are gathered through host-made indices (paged_attention.through_dense): not captured."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.quant.kv import kv_format

    source = tiny_models()["gpt2-like"]
    model = Decoder(CupyOps(device=0), Groups(), source.arch).load(source)
    runner, hd = Runner(model, GenerationParams(1)), source.arch.head_dim
    cache = PagedKVCache(model.ops, model.num_local_layers, 4, model.kv_heads_local, 16, hd)
    assert paged_decode_graphs(runner, cache, True) is not None
    cache = PagedKVCache(model.ops, model.num_local_layers, 4, model.kv_heads_local, 16, hd, kv_format("int8", 16, hd))
    with caplog.at_level("WARNING", logger="hpcinfer"):
        assert paged_decode_graphs(runner, cache, True) is None
    assert "over the int8 KV pool run eagerly" in caplog.text


def test_cuda_graphs_no_longer_keep_a_job_off_continuous_batching(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\ncheckpoint = "m.h5"\n\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n')
    config = load_config(str(path), ["runtime.cuda_graphs=true", "runtime.backend='cupy'"])
    assert unsupported(config) == [] and batching_mode(config) == "continuous"


def test_a_later_stage_replays_from_received_activations(emu_cupy):
    """pp = 2 by hand, as the continuous schedule's stages run (schedules/continuous_stages.StageStep): each stage
    its own pool over the same block tables and its own paged graphs; stage 1 gets stage 0's activations [S, D]
    (padded to the graph's rows with the token ids' zeros), from the host (MPI) or the device (NCCL). Its logits
    equal one eager stage's over 3 decode steps of 3 sequences (one key: captured, then replayed)."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.parallel.stages import StageSpec

    source = tiny_models()["llama-like"]
    arch, ops = source.arch, CupyOps(device=0, kernels=True)
    models = [Decoder(ops, Groups(), arch).load(source)]
    models += [Decoder(ops, Groups(), arch, stage=StageSpec(s, 2, 2 * s, 2 * s + 2)).load(source) for s in (0, 1)]
    runners = [Runner(m, GenerationParams(1)) for m in models]
    caches = [PagedKVCache(ops, m.num_local_layers, 12, m.kv_heads_local, 4, arch.head_dim) for m in models]
    lengths = [5, 9, 3]
    prompts = prompts_for(arch.vocab_size, lengths)
    for cache in caches:
        for s, n in enumerate(lengths):
            cache.tables.grow(s, n)
    layout = caches[0].layout([0, 1, 2], [0, 0, 0], lengths)
    want = runners[0].forward(caches[0], {"tokens": np.concatenate(prompts)}, layout)
    x = runners[1].forward(caches[1], {"tokens": np.concatenate(prompts)}, layout)
    runners[2].forward(caches[2], {"x": x}, layout)
    graphs = [paged_decode_graphs(r, c, True) for r, c in zip(runners[1:], caches[1:])]
    for j in range(3):
        tokens = np.argmax(ops.to_host(want), axis=-1)
        for cache in caches:
            for s in range(3):
                cache.tables.grow(s, lengths[s] + j + 1)
        layout = caches[0].layout([0, 1, 2], [n + j for n in lengths], [1, 1, 1])
        want = runners[0].forward(caches[0], {"tokens": tokens}, layout)
        x = graphs[0](layout, {"tokens": tokens})
        assert x.shape == (3, arch.hidden_size)
        got = graphs[1](layout, {"x": ops.to_host(x) if j % 2 else x.copy()})
        np.testing.assert_allclose(ops.to_host(got), ops.to_host(want), rtol=1e-5, atol=1e-5)
    assert [(g.captures, g.replays) for g in graphs] == [(1, 3), (1, 3)]
