"""End to end on a GPU (make gpu-check's `e2e` step, docs/gpu.md): what only the whole program shows.

1. Greedy tokens of a dense preset (GPT-2-like, and a Llama-like one with GQA and rotary) equal between the CuPy
   backend and NumPy, eager and with CUDA graphs (the graphs captured, not only run eagerly); an MoE preset eager
   (MoE layers are never captured: config refuses them). The continuous schedule over the paged pool, eager and
   with its decode steps captured per (padded rows, KV bucket) (generate/graphs.PagedDecodeGraphs), gives them too.
2. NCCL: a one-rank communicator's all-reduce, eager and captured in a CUDA graph and replayed (a one-rank group of
   the runtime makes no communicator, so the test makes one: the only NCCL a one-GPU machine can run).
3. Two ranks sharing the GPU over `comm = "mpi"`, tp = 2: `hpcinfer run` writes the tokens of one rank.

GPU only; on the CPU stand-in (`-p emu_cupy`, the gpu-check rehearsal) 1 runs, 2 skips (no NCCL), 3 skips (the
stand-in lives in this process, not in the ranks mpiexec starts).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hpcinfer.backend.cupy_ops import gpu_available
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.model.transformer import Decoder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU visible to cupy "
                                                             "(cupy missing, or cupy.is_available() is False)")]

NEW_TOKENS = 8


def _emulated() -> bool:
    import cupy

    return bool(getattr(cupy, "_emulated", False))


def sources() -> dict:
    llama = dataclasses.replace(PRESETS["tiny-dense"], norm="rmsnorm", position="rotary", rotary_dim=16,
                                tied_embeddings=False, num_kv_heads=2, gated_mlp=True, activation="silu",
                                qkv_bias=False, out_bias=False, mlp_bias=False)
    return {"tiny-dense": PresetSource("tiny-dense", PRESETS["tiny-dense"]),
            "tiny-llama-gqa": PresetSource("tiny-llama-gqa", llama),
            "tiny-moe": PresetSource("tiny-moe", PRESETS["tiny-moe"])}


def generate(model, prompts, cuda_graphs: bool):
    times = StepTimes()
    out = generate_batch(model, prompts, list(range(len(prompts))), GenerationParams(NEW_TOKENS, ignore_eos=True),
                         times, ScheduleParams(1, 1, None, cuda_graphs))
    return [tokens for tokens, _ in out], times


@pytest.mark.parametrize("name, cuda_graphs", [("tiny-dense", False), ("tiny-dense", True),
                                               ("tiny-llama-gqa", False), ("tiny-llama-gqa", True),
                                               ("tiny-moe", False)])
def test_greedy_tokens_equal_numpy(name, cuda_graphs):
    from hpcinfer.backend.cupy_ops import CupyOps

    source = sources()[name]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, source.arch.vocab_size, size=n).tolist() for n in (5, 9, 3)]
    want, _ = generate(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, False)
    got, times = generate(Decoder(CupyOps(device=0), Groups(), source.arch).load(source), prompts, cuda_graphs)
    assert got == want
    if cuda_graphs:                      # every decode step from a graph: the kernels cover them all
        assert times.graph_captures >= 1 and times.graph_eager_steps == 0
        assert times.graph_replays == NEW_TOKENS - 1


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ["tiny-dense", "tiny-llama-gqa"])
def test_continuous_batching_on_the_gpu_gives_the_static_numpy_tokens(name, cuda_graphs):
    """The paged KV pool on the device (cuda_src/paged_attention.cu): chunked prompts, mixed steps, preemption; with
    graphs, every decode step from a graph (running sets of 1 to 3 sequences: padded to 1, 2 and 4 rows), none
    eager, each key captured once."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.generate.graphs import paged_decode_graphs
    from hpcinfer.generate.paged_cache import PagedKVCache
    from hpcinfer.generate.runner import Runner
    from hpcinfer.generate.schedules.continuous import ContinuousParams, run_continuous

    source = sources()[name]
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, source.arch.vocab_size, size=n).tolist() for n in (5, 30, 3, 17, 41, 9)]
    want, _ = generate(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, False)
    model = Decoder(CupyOps(device=0), Groups(), source.arch).load(source)
    got, times = {}, StepTimes()
    cache = PagedKVCache(model.ops, model.num_local_layers, 14, model.kv_heads_local, 4, source.arch.head_dim)
    runner = Runner(model, GenerationParams(NEW_TOKENS, ignore_eos=True))
    graphs = paged_decode_graphs(runner, cache, cuda_graphs)
    run_continuous(runner, prompts, list(range(6)), times, ContinuousParams(3, 8), cache,
                   lambda done: got.update({s.index: s.generated for s in done}), graphs=graphs)
    assert [got[i] for i in range(6)] == want
    assert times.preemptions > 0
    if cuda_graphs:
        assert graphs.eager_steps == 0 and graphs.replays == graphs.steps > graphs.captures >= 1
        assert graphs.captures == len(graphs.graph.captured)
        graphs.close()


def test_nccl_one_rank_all_reduce_eager_and_captured():
    import cupy as cp
    from cupy.cuda import nccl
    from mpi4py import MPI

    from hpcinfer.comm.group import MPIGroup
    from hpcinfer.comm.nccl_group import NcclGroup, nccl_available

    if not nccl_available():
        pytest.skip("the NCCL library does not load here (the CPU stand-in has none)")
    group = NcclGroup(MPIGroup(MPI.COMM_SELF, "self"))
    group.nccl = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)   # the runtime makes none for one rank
    x = cp.arange(12, dtype=cp.float32)
    np.testing.assert_array_equal(group.all_reduce(x.copy()).get(), np.arange(12, dtype=np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = group.all_reduce(x) * 2                                 # NCCL, then a CuPy kernel
        graph = stream.end_capture()
    for value in (3.0, -1.5):
        x.fill(value)
        graph.launch(stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(out.get(), np.full(12, 2 * value, dtype=np.float32))
    group.close()


def test_two_ranks_share_the_gpu_over_mpi_with_tp2(tmp_path, run_cli, repo_root):
    if _emulated():
        pytest.skip("the CPU stand-in of cupy lives in this process only, not in the ranks mpiexec starts")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "tokens": [5, 17, 200, 3]}\n{"id": "b", "tokens": [9, 8]}\n')
    tokens = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}.jsonl"
        config = tmp_path / f"job{n}.toml"
        config.write_text(f'[model]\npreset = "tiny-dense"\n\n[parallel]\ntp = {n}\n\n'
                          f'[generate]\nprompts = "{prompts}"\noutput = "{out}"\nmax_new_tokens = 8\n'
                          f'ignore_eos = true\n\n[runtime]\nbackend = "cupy"\ncomm = "mpi"\n')
        done = run_cli(["run", str(config)], n=n, timeout=300, cwd=repo_root)
        assert done.returncode == 0, done.stderr
        tokens[n] = [json.loads(line)["output_tokens"] for line in out.read_text().splitlines()]
    assert tokens[2] == tokens[1] and len(tokens[1]) == 2
