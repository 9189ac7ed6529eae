"""The zig-zag schedule with a quantized KV cache at tp = 2 under MPI (tests/offload/test_offload_kv_quant.py at one
rank): each rank holds its 2 of the 4 KV heads, quantized, in host memory through the staging buffers, and the ranks
generate exactly the tokens of the row schedule with the same KV mode and layout, which are those of one rank."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mpi_helpers import world
from offload_models import window_positions
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups, MPIGroup
from hpcinfer.config import OffloadSection
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules import run_block
from hpcinfer.model.transformer import Decoder
from hpcinfer.quant.kv import kv_format
from hpcinfer.runtime import _weight_tiers

pytestmark = pytest.mark.mpi(min_size=2)

PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11, 4, 7)
MAX_NEW = 5
HOST = dict(weights_gpu=0, weights_cpu=100, num_gpu_batches=4)
ZIGZAG = dict(HOST, cache_gpu=0, cache_cpu=100, schedule="zigzag")


def run(mode: str, keys: dict, tp: int):
    """Every rank of a tp group of `tp` ranks generates the prompts under [offload] `keys`, KV cache `mode`."""
    comm = world()
    groups = Groups(tp=MPIGroup(comm.Split(color=comm.Get_rank() // tp, key=comm.Get_rank()), "tp"))
    src = PresetSource("tiny-dense", PRESETS["tiny-dense"])
    ops, off = NumpyOps(), OffloadSection(**keys)
    model = Decoder(ops, groups, src.arch, "float32")
    model.weights = _weight_tiers(types.SimpleNamespace(offload=off), model, ops, comm.Get_rank())
    model.load(src, after_block=model.weights.place)
    model.set_attention(kv_format(mode, 64, src.arch.head_dim))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENGTHS]
    times = StepTimes()
    out = run_block(Runner(model, GenerationParams(MAX_NEW, ignore_eos=True)), prompts, list(range(len(prompts))), times, ScheduleParams(), off)
    model.weights.close()
    return out, times


@pytest.mark.parametrize("mode", ("int8", "int4"))
def test_zigzag_quantized_cache_at_tp2_gives_the_row_schedules_tokens(mode):
    if world().Get_size() % 2:
        pytest.skip("tp = 2 needs an even number of ranks")
    zig, times = run(mode, ZIGZAG, 2)
    row, _ = run(mode, HOST, 2)
    assert zig == row
    assert zig == run(mode, HOST, 1)[0]                                  # the one-rank answer
    row_bytes = {"int8": 16 + 4, "int4": 8 + 4}[mode]                    # head_dim 16, one group per row
    # each rank moves its 2 KV heads: layers * (K, V) * heads * row bytes * the positions of each batch's windows
    loads, stores = window_positions(PROMPT_LENGTHS, MAX_NEW)
    assert (times.kv_bytes_to_device, times.kv_bytes_to_host) == (4 * 2 * 2 * row_bytes * loads,
                                                                  4 * 2 * 2 * row_bytes * stores)
    all_tokens = world().allgather(zig)
    assert all(t == zig for t in all_tokens)
