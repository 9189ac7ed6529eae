"""Loading needs no more host memory than the rank's own shard plus one tensor (issue 8), at every step.

A checkpoint of random weights (V=4096 D=256 L=4 F=1024, about 28 MB in float32) is loaded at tp=1 and as each rank
of tp=2 (a stand-in tp group: loading float weights does not communicate), and tracemalloc follows NumPy's
allocations: the peak above the baseline must stay within what the model holds afterwards (the shard) plus the
largest tensor. Cases cover the direct read (file dtype = compute dtype) and the cast (float32 file, float16 or
bfloat16 in memory), and a bfloat16 file.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from hpcinfer.arch import ModelArch, tensor_shapes
from hpcinfer.backend.ops import make_ops
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.checkpoint.writer import CheckpointWriter
from hpcinfer.comm.group import Groups
from hpcinfer.model.transformer import Decoder
from hpcinfer.parallel.layers import weight_dtype

ARCH = ModelArch(family="llama", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                 head_dim=32, intermediate_size=1024, max_positions=64, norm="rmsnorm", position="rotary",
                 rotary_dim=32, activation="silu", gated_mlp=True)


SLACK = 64 * 2**10        # Python and h5py objects made while reading (a few KB per tensor), not array data


class StandInTP:
    """rank `rank` of a tp group of `size` (loading float weights reads only .size and .rank)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("mem") / f"{request.param}.h5"
    rng = np.random.default_rng(0)
    with CheckpointWriter(str(path), ARCH, request.param) as writer:
        for name, shape in tensor_shapes(ARCH).items():
            writer.add(name, rng.standard_normal(shape, dtype=np.float32))
    return path, request.param


def _steps(model, num_layers: int) -> list[tuple[str, object]]:
    """(tensor-name prefix, part) in the order Decoder.load reads them."""
    steps = [("embed.tokens", model.embed), ("final_norm.", model.final_norm), ("lm_head.", model.lm_head)]
    for i, block in enumerate(model.blocks):
        steps += [(f"layers.{i}.attn_norm.", block.attn_norm), (f"layers.{i}.attn.", block.attn),
                  (f"layers.{i}.mlp_norm.", block.mlp_norm), (f"layers.{i}.mlp.", block.mlp)]
    return steps


def _tensor_bytes(prefix: str, dtype: str) -> int:
    """The largest tensor a step reads, in float32 (a cast reads it so) or the compute dtype."""
    itemsize = max(weight_dtype(dtype).itemsize, 4)
    return max(int(np.prod(s)) for n, s in tensor_shapes(ARCH).items() if n.startswith(prefix)) * itemsize


def load_measured(model, ckpt, dtype: str) -> tuple[int, list]:
    """Load part by part under tracemalloc: (bytes held after all, [(step, transient bytes, bound)]) where a
    step's transient is its peak above what is held once it is done."""
    gc.collect()
    tracemalloc.start()
    try:
        base, rows = tracemalloc.get_traced_memory()[0], []
        for prefix, part in _steps(model, ARCH.num_layers):
            tracemalloc.reset_peak()
            part.load(ckpt)
            held, peak = tracemalloc.get_traced_memory()
            rows.append((prefix, peak - held, _tensor_bytes(prefix, dtype)))
        return tracemalloc.get_traced_memory()[0] - base, rows
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("compute", ["file", "float16"])
@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 0), (2, 1)])
def test_each_step_holds_shard_plus_one_tensor(checkpoint, compute, tp, rank):
    path, file_dtype = checkpoint
    dtype = file_dtype if compute == "file" else compute
    with open_checkpoint(str(path)) as ckpt:
        model = Decoder(make_ops("numpy"), Groups(tp=StandInTP(tp, rank)), ckpt.arch, dtype)
        shard, steps = load_measured(model, ckpt, dtype)
    full = sum(int(np.prod(s)) for s in tensor_shapes(ARCH).values()) * weight_dtype(dtype).itemsize
    assert shard <= full // tp + full // 8, (shard, full)           # the rank holds its shard, not the model
    over = [(prefix, transient, bound) for prefix, transient, bound in steps if transient > bound + SLACK]
    assert not over, f"loading {over[0][0]}* needed {over[0][1]:,} B beyond the shard; one tensor is {over[0][2]:,} B"
    worst = max(steps, key=lambda s: s[1])
    print(f"tp={tp} rank={rank} file={file_dtype} compute={dtype}: shard {shard / 2**20:.2f} MiB of "
          f"{full / 2**20:.1f} MiB; largest transient {worst[1] / 2**20:.2f} MiB at {worst[0]}*")
