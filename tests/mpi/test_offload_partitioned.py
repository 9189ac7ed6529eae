"""Partitioned fetch (`[offload] partitioned_fetch`, offload/partition.py) under MPI, every rank one data-parallel
replica of the tiny-dense preset on one node (runtime._fetch_group groups them all).

What must hold, at every world size N the suite runs (2 and 4; at 4 also tp = 2 x dp = 2, below):
- each rank generates exactly the tokens of its own run without offload, although the ranks run different prompts
  for different numbers of steps (a rank that ends first keeps joining fetch rounds until the others end);
- each rank keeps only its 1/N part of a streamed layer (host store or file) and reads only that part per round;
  every rank makes the same number of rounds (the all-gather assembles each layer on all of them).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.comm.mesh import build_mesh
from hpcinfer.config import OffloadSection
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules import run_block
from hpcinfer.model.transformer import Decoder
from hpcinfer.offload import partition
from hpcinfer.runtime import _weight_tiers

pytestmark = pytest.mark.mpi(min_size=2)


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def source(quantize: str = "none") -> PresetSource:
    src = PresetSource("tiny-dense", dataclasses.replace(PRESETS["tiny-dense"]))
    if quantize != "none":
        from hpcinfer.quant.storage import configure

        configure(src, quantize, 64)
    return src


def build(src, off=None, mesh=None, groups=None) -> Decoder:
    """The model on this rank (groups: its tp group for a tensor-parallel mesh; none: the whole model)."""
    ops = NumpyOps()
    model = Decoder(ops, groups or Groups(), src.arch, "float32")
    if off is not None:
        model.weights = _weight_tiers(types.SimpleNamespace(offload=off), model, ops, mesh.world.rank, mesh)
    model.load(src, after_block=model.weights.place if model.weights is not None else None)
    return model


def work_of(rank: int) -> tuple[list, GenerationParams]:
    """Rank-dependent prompts and lengths: the ranks run different numbers of token steps."""
    rng = np.random.default_rng(100 + rank)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in rng.integers(1, 12, size=2 + rank % 3)]
    return prompts, GenerationParams(3 + 2 * rank, ignore_eos=True)


def generate(model, prompts, params, off=None):
    times = StepTimes()
    if off is not None:
        out = run_block(Runner(model, params), prompts, list(range(len(prompts))), times, ScheduleParams(), off)
        model.weights.close()
    else:
        out = generate_batch(model, prompts, list(range(len(prompts))), params, times)
    return out


CASES = {
    "host-row-prefetch1": dict(weights_gpu=0, weights_cpu=100),
    "host-row-prefetch0": dict(weights_gpu=25, weights_cpu=75, prefetch_layers=0),
    "disk-zigzag-prefetch2": dict(weights_gpu=0, weights_cpu=0, prefetch_layers=2, schedule="zigzag",
                                  num_gpu_batches=2),
    "mixed-zigzag-int4": dict(weights_gpu=25, weights_cpu=25, schedule="zigzag", num_gpu_batches=2),
}


@pytest.mark.parametrize("name", CASES)
def test_partitioned_fetch_gives_each_replica_its_own_tokens_reading_1_over_n(name, tmp_path, monkeypatch):
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = build_mesh(comm, 1, 1, n)                                   # dp = N on one node
    src = source("int4" if name.endswith("int4") else "none")
    prompts, params = work_of(rank)
    reference = generate(build(src), prompts, params)
    disk = comm.bcast(str(tmp_path / "disk") if rank == 0 else None)
    off = OffloadSection(**CASES[name], disk_dir=disk, partitioned_fetch=True)

    rounds = []
    gather = partition.LayerImage.gather
    monkeypatch.setattr(partition.LayerImage, "gather",
                        lambda self, buffer, working: rounds.append(self.part) or gather(self, buffer, working))
    model = build(src, off, mesh)
    tiers = model.weights
    assert tiers.group is not None and tiers.group.size == n
    streamed = [i for i, t in enumerate(tiers.tiers) if t != "device"]
    for i in streamed:                                                 # this rank holds 1/N of each layer
        image = tiers.images[i]
        assert image.part * n >= tiers.layer_bytes[i]
        assert image.part <= tiers.layer_bytes[i] / n + partition.ALIGN * len(image.specs)
        held = image.host.nbytes if image.host is not None else np.load(image.path, mmap_mode="r").nbytes
        assert held == image.part + 1                                   # the part and its flag byte
    assert tiers.host == {} and tiers.disk == {}                      # no whole copy anywhere
    assert all(getattr(h, k) is None for i in streamed for h, k in tiers.tensors[i])

    out = generate(model, prompts, params, off)
    assert out == reference
    counts = comm.allgather(len(rounds))
    assert len(set(counts)) == 1, counts                               # every rank made the same rounds
    assert tiers.bytes_from_host + tiers.bytes_from_disk == sum(rounds)      # only its part, each round
    assert (tiers.bytes_from_disk > 0) == ("disk" in tiers.tiers)
    # a token step fetches every streamed layer (row: once per GPU batch), and the prefetch wraps past the last
    # step into the first layers of a step that never comes; the rounds are the longest rank's reads, then the
    # one round in which every rank says it has ended
    own = params.max_new_tokens * len(streamed) * (off.num_gpu_batches if off.schedule == "row" else 1)
    own += min(off.prefetch_layers, len(streamed) - 1)
    assert len(rounds) == max(comm.allgather(own)) + 1
    assert tiers.device_bytes == tiers.layer_bytes[0] * tiers.tiers.count("device")


@pytest.mark.mpi(min_size=4)
def test_tensor_parallel_ranks_fetch_with_the_replicas_of_their_own_tp_rank(tmp_path, monkeypatch):
    """tp = 2 x dp = 2 on one node, weights in host memory and on disk: each tp rank shares its shard's fetch with
    the other replicas' ranks of the same tp rank only (never with its tp partner, whose shard is another), keeps
    1/dp of its shard, and the tokens are those of the same tp = 2 mesh without offload."""
    comm = world()
    rank, tp = comm.Get_rank(), 2
    if comm.Get_size() != 4:
        pytest.skip("the tp = 2 x dp = 2 mesh needs exactly 4 ranks")
    mesh = build_mesh(comm, tp, 1, comm.Get_size())                    # pp = 1, dp = 2, one node
    pp_i, dp_i, tp_i = mesh.coords
    groups = Groups(tp=mesh.tp)
    src = source()
    prompts, params = work_of(dp_i)                                    # both tp ranks of a replica: the same work
    reference = generate(build(src, groups=groups), prompts, params)
    disk = comm.bcast(str(tmp_path / "disk") if rank == 0 else None)
    off = OffloadSection(weights_gpu=0, weights_cpu=50, prefetch_layers=1, disk_dir=disk, partitioned_fetch=True)

    rounds = []
    gather = partition.LayerImage.gather
    monkeypatch.setattr(partition.LayerImage, "gather",
                        lambda self, buffer, working: rounds.append(self.part) or gather(self, buffer, working))
    model = build(src, off, mesh, groups)
    tiers = model.weights
    coords = comm.allgather(mesh.coords)
    same_tp = [r for r, (p, _, t) in enumerate(coords) if (p, t) == (pp_i, tp_i)]
    assert sorted(tiers.group.comm.allgather(rank)) == same_tp and len(same_tp) == mesh.shape.dp
    assert set(tiers.tiers) == {"host", "disk"} and sorted(tiers.images) == list(range(len(tiers.tiers)))
    for i, image in tiers.images.items():                             # 1/dp of this rank's tp shard
        assert image.part * mesh.shape.dp >= tiers.layer_bytes[i]
        assert image.part <= tiers.layer_bytes[i] / mesh.shape.dp + partition.ALIGN * len(image.specs)

    out = generate(model, prompts, params, off)
    assert out == reference
    assert tiers.bytes_from_host > 0 and tiers.bytes_from_disk > 0
    assert tiers.bytes_from_host + tiers.bytes_from_disk == sum(rounds)      # only its part, each round
    own = params.max_new_tokens * len(tiers.tiers) + min(off.prefetch_layers, len(tiers.tiers) - 1)
    assert len(rounds) == max(tiers.group.comm.allgather(own)) + 1    # the longer replica's reads, then the end
