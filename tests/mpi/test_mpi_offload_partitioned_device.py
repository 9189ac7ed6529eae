"""Partitioned fetch gathered on the device (`[offload] partitioned_fetch` on the CuPy backend, offload/partition.py):
each rank copies only its 1/N part of a streamed layer to the device, the fetch group all-gathers the parts there,
and the layer's arrays are device views of the assembled image. Run on the CPU stand-in for cupy
(tests/helpers/emu_cupy/), which has no NCCL: the runs are built as runtime._run builds them under [runtime] comm =
"nccl" (runtime._weight_tiers), with comm/nccl_group.StagedMPIGroup standing in for NcclGroup around the MPI fetch group
(device arrays in, device arrays out), so the code path is the NCCL one and only the transport differs.

What must hold, at every world size N the suite runs (2 and 4), every rank one data-parallel replica of tiny-dense:
- each rank's tokens equal its NumPy run with partitioned fetch (gathered in host memory) and without offload;
- every all-gather of a round takes a device array of one part (P + 1 bytes: the part and its flag byte), the
  only weight bytes each rank copies to the device are those parts, and bytes_from_host / _disk count them;
and, in one process, that the image split and assembled on device arrays gives back each array (bfloat16 as the
CuPy backend's uint16 bits) and the "still working" flags.
"""

from __future__ import annotations

import threading
import types

import ml_dtypes
import numpy as np
import pytest

import emu_cupy as emu
from test_offload_partitioned import source, world
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.comm.group import Groups
from hpcinfer.comm.mesh import build_mesh
from hpcinfer.config import OffloadSection
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules import run_block
import kernel_emulator as emulate
from hpcinfer.model.transformer import Decoder
from hpcinfer import runtime
from hpcinfer.offload.partition import LayerImage

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")


# ------------------------------------------------------------------------------------- one process: the image

class _LoopGroup:
    """A fetch group of N members in one process: rank `rank`'s all_gather stacks its own buffer with the
    others' (device arrays only, as a device group's)."""

    def __init__(self, cp, size: int, rank: int):
        self.cp, self.size, self.rank = cp, size, rank
        self.others: list = []                                   # every member's device buffer [P + 1]

    def all_gather(self, x):
        assert isinstance(x, self.cp.ndarray), "the parts must be gathered as device arrays"
        return self.cp.stack([x if r == self.rank else b for r, b in enumerate(self.others)])    # [N, P + 1]


@pytest.mark.parametrize("n", [2, 3])
def test_image_split_and_assembled_on_device_gives_back_every_array(n):
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((3, 5)).astype(np.float32), rng.integers(-8, 8, 7).astype(np.int8),
              rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16), rng.standard_normal(1).astype(np.float16)]
    with emu.installed() as cp:
        groups = [_LoopGroup(cp, n, r) for r in range(n)]
        images = [LayerImage.build(arrays, g, "host", None) for g in groups]
        buffers = [cp.asarray(image.read_mine()) for image in images]                    # each [P + 1]
        for g in groups:
            g.others = buffers
        for r, working in ((0, False), (n - 1, True)):
            for b in buffers:
                b[-1] = 0
            anyone, got = images[r].gather(buffers[r], working)
            assert anyone == working
            assert all(isinstance(a, cp.ndarray) for a in got)
            for want, a in zip(arrays, got):
                bits = want.view(np.uint16) if want.dtype == ml_dtypes.bfloat16 else want
                assert a.dtype == bits.dtype and a.shape == want.shape
                np.testing.assert_array_equal(cp.asnumpy(a), bits)


# ---------------------------------------------------------------------------------- under MPI: whole runs

def work_of(rank: int) -> tuple[list, GenerationParams]:
    """Rank-dependent prompts and lengths (few tokens: the emulator is slow); the ranks end at different steps."""
    rng = np.random.default_rng(300 + rank)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in rng.integers(1, 6, size=2)]
    return prompts, GenerationParams(2 + rank % 2, ignore_eos=True)


def build(ops, src, off=None, mesh=None, comm="mpi") -> Decoder:
    """The model as runtime._run builds it, with its [runtime] comm resolved to `comm`."""
    model = Decoder(ops, Groups(), src.arch, "float32")
    if off is not None:
        model.weights = runtime._weight_tiers(types.SimpleNamespace(offload=off), model, ops, mesh.world.rank,
                                              mesh, comm)
    model.load(src, after_block=model.weights.place if model.weights is not None else None)
    return model


def tokens(model, prompts, params, off=None) -> list:
    times, ids = StepTimes(), list(range(len(prompts)))
    if off is None:
        out = generate_batch(model, prompts, ids, params, times)
    else:
        out = run_block(Runner(model, params), prompts, ids, times, ScheduleParams(), off)
        model.weights.close()
    return [t for t, _ in out]


CASES = {
    "mixed-row-prefetch1": dict(weights_gpu=25, weights_cpu=25, prefetch_layers=1),
    "host-zigzag-int4": dict(weights_gpu=0, weights_cpu=100, schedule="zigzag", num_gpu_batches=2),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", CASES)
def test_device_gather_gives_numpys_tokens_and_moves_only_this_ranks_part(name, tmp_path, monkeypatch):
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = build_mesh(comm, 1, 1, n)                                   # dp = N on one node
    src = source("int4" if name.endswith("int4") else "none")
    prompts, params = work_of(rank)
    disk = comm.bcast(str(tmp_path) if rank == 0 else None)

    def off(where):
        return OffloadSection(**CASES[name], disk_dir=f"{disk}/{where}", partitioned_fetch=True)

    plain = tokens(build(NumpyOps(), src), prompts, params)
    model = build(NumpyOps(), src, off("numpy"), mesh)
    assert not model.weights.gather_on_device
    on_host = tokens(model, prompts, params, off("numpy"))

    with emu.installed() as cp:
        from hpcinfer.backend.cupy_ops import CupyOps
        from hpcinfer.comm.nccl_group import StagedMPIGroup

        monkeypatch.setattr(runtime, "NcclGroup", StagedMPIGroup)     # the emulator has no NCCL
        ops = CupyOps(device=0)
        model = build(ops, src, off("cupy"), mesh, comm="nccl")
        tiers, group = model.weights, model.weights.group
        assert isinstance(group, StagedMPIGroup) and group.size == n and tiers.gather_on_device
        gathered, uploads = [], []                     # what the rounds all-gather and upload, and on which thread
        all_gather, upload = group.all_gather, tiers.copies.upload
        group.all_gather = lambda x: gathered.append((x, threading.current_thread())) or all_gather(x)
        tiers.copies.upload = lambda hs, pinned=True: (uploads.extend((h, threading.current_thread()) for h in hs)
                                                       or upload(hs, pinned))
        got = tokens(model, prompts, params, off("cupy"))

        parts = {tiers.images[i].part + 1 for i in tiers.streamed}
        assert gathered and all(isinstance(x, cp.ndarray) and x.dtype == np.uint8 for x, _ in gathered)
        assert {x.size for x, _ in gathered} <= parts                 # one part and its flag, on the device
        # each round uploads this rank's part only, through the copy engine (pinned memory, the copy stream);
        # with prefetch, up to prefetch_layers parts more (uploaded ahead of rounds that never came)
        ahead = tiers.prefetch_layers
        assert len(gathered) <= len(uploads) <= len(gathered) + ahead and {u.size for u, _ in uploads} <= parts
        # the rounds (collective) run on the main thread in program order; with prefetch, the uploads ahead of
        # them on a prefetch thread (all but, at most, the first streamed layer's when nothing came before it)
        main = threading.main_thread()
        assert all(t is main for _, t in gathered)
        on_threads = sum(t is not main for _, t in uploads)
        assert on_threads >= len(uploads) - 1 and on_threads > 0 if ahead else on_threads == 0
        assert emu._state.pageable_async_copies == 0 and emu._state.async_copies >= len(uploads)
        assert all(getattr(h, k) is None for i in tiers.streamed for h, k in tiers.tensors[i])    # released
    assert got == on_host == plain
    assert tiers.bytes_from_host + tiers.bytes_from_disk == sum(u.size - 1 for u, _ in uploads)
    assert (tiers.bytes_from_disk > 0) == ("disk" in tiers.tiers)
    assert len(set(comm.allgather(len(gathered)))) == 1                # every rank made the same rounds
