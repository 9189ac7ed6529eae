"""No pageable copy on the offload hot path (issue 32): the cupy stand-in logs every host <-> device copy whose host
memory is not pinned (tests/helpers/emu_cupy/pageable.py: CUDA stages such a copy synchronously, and it overlaps
nothing), and each offload decode loop of tiny-dense (streamed weights from host and disk, the zig-zag schedule with
its KV and activations in host memory, CPU attention delegation) makes exactly the pageable copies of the same
schedule with everything on the device: the step's own inputs and sampled outputs, which the runner moves
(generate/), and nothing the offload adds. CPU delegation adds only the int64 row indices of its gathers.
Also: the copy engine reuses its pinned staging buffers, and moves each direction on its own stream.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import emu_cupy as emu
import kernel_emulator as emulate
from emu_cupy import pageable
from offload_models import build, generate, make_prompts, offload, preset

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")

ZIGZAG = dict(schedule="zigzag", num_gpu_batches=2)
ON_DEVICE = {"row": None, "zigzag": dict(weights_gpu=100, weights_cpu=0, **ZIGZAG)}
PLACEMENTS = {"host": ("row", dict(weights_gpu=25, weights_cpu=75, prefetch_layers=1)),
              "disk": ("row", dict(weights_gpu=0, weights_cpu=50, prefetch_layers=2)),
              "zigzag-kv-host": ("zigzag", dict(weights_gpu=50, weights_cpu=50, cache_gpu=0, cache_cpu=100, **ZIGZAG)),
              "zigzag-act-host": ("zigzag", dict(weights_gpu=50, weights_cpu=50, act_gpu=0, act_cpu=100, **ZIGZAG)),
              "cpu-attention": ("zigzag", dict(weights_gpu=50, weights_cpu=50, cache_gpu=0, cache_cpu=100,
                                               cpu_attention=True, **ZIGZAG))}


def pageable_copies(tmp_path, keys: dict | None) -> collections.Counter:
    """The pageable copies of a tiny-dense run on the stand-in, as (direction, bytes, what, dtype kind) counts.
    The kernels are off (plain CuPy: seconds instead of minutes on the emulator); the copies of the offload paths
    (the copy engine, CPU delegation) do not depend on them, and both runs of a comparison make the same choice."""
    with emu.installed():
        from hpcinfer.backend.cupy_ops import CupyOps

        off = offload(tmp_path, **keys) if keys is not None else None
        model = build(preset("tiny-dense"), off, CupyOps(device=0, kernels=False))
        with pageable.watch() as made:
            generate(model, make_prompts()[:4], off)
    return collections.Counter(dataclass_tuple(m) for m in made)


def dataclass_tuple(copy: pageable.PageableCopy) -> tuple:
    return copy.direction, copy.nbytes, copy.what, copy.kind


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """schedule -> the pageable copies of its run with everything on the device (made once, when first asked)."""
    made: dict = {}

    def reference(schedule: str) -> collections.Counter:
        if schedule not in made:
            made[schedule] = pageable_copies(tmp_path_factory.mktemp(schedule), ON_DEVICE[schedule])
            assert made[schedule], "the runner's step inputs are pageable copies: the log sees them"
        return made[schedule]

    return reference


def added_by(tmp_path, references, placement: str) -> collections.Counter:
    schedule, keys = PLACEMENTS[placement]
    return pageable_copies(tmp_path / placement, keys) - references(schedule)


@pytest.mark.parametrize("placement", [p for p in PLACEMENTS if p != "cpu-attention"])
def test_offload_adds_no_pageable_copy(tmp_path, references, placement):
    assert not added_by(tmp_path, references, placement)


def test_cpu_delegation_adds_only_its_row_indices(tmp_path, references):
    """q, k, v go down and the outputs come up through pinned buffers; the int64 row indices of its gathers
    (kv_attention.split_attention) are the only pageable copies it adds."""
    added = added_by(tmp_path, references, "cpu-attention")
    assert added and all(d == pageable.HOST_TO_DEVICE and kind == "i" for d, _, _, kind in added), added


def test_a_pageable_copy_in_the_loop_is_caught(tmp_path, references, monkeypatch):
    """The check can fail: CPU delegation through ops.to_host / ops.asarray (pageable, as before issue 32)."""
    from hpcinfer.backend import cupy_attention

    def pageable_host_attention(ops, q, k, v, cache_k, cache_v, step, scale, topk):
        host = [ops.to_host(a) for a in (q, k, v)]
        return ops.asarray(ops.host_ops.attention(*host, cache_k, cache_v, step, scale, topk))

    monkeypatch.setattr(cupy_attention, "host_attention", pageable_host_attention)
    added = added_by(tmp_path, references, "cpu-attention")
    assert any(kind == "f" for *_, kind in added)


def test_the_stand_in_logs_pageable_copies_sync_or_async(emu_cupy):
    import cupyx

    cp = emu_cupy
    stream = cp.cuda.Stream(non_blocking=True)
    pinned = cupyx.zeros_pinned((8,), np.float32)
    with pageable.watch() as made:
        d = cp.asarray(pinned)                                   # pinned: not logged
        d.get(out=cupyx.empty_pinned((8,), np.float32))
        d.set(pinned[:8], stream=stream)
        stream.synchronize()
        cp.asarray(np.ones(8, np.float32))                       # pageable: each logged
        d.get()
        d.set(np.ones(8, np.float32))
        float(d[0])
        d[np.arange(2)]
    assert [(m.direction, m.what) for m in made] == [
        (pageable.HOST_TO_DEVICE, "cupy.asarray"), (pageable.DEVICE_TO_HOST, "ndarray.get()"),
        (pageable.HOST_TO_DEVICE, "ndarray.set()"), (pageable.DEVICE_TO_HOST, "float(device array)"),
        (pageable.HOST_TO_DEVICE, "a host index array")]
    assert [m.nbytes for m in made] == [32, 32, 32, 4, 16]


def test_staging_buffers_are_reused_and_each_direction_has_its_stream(emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    copies = CupyOps(device=0).copy_engine()
    assert copies.h2d is not copies.d2h and copies.h2d.non_blocking and copies.d2h.non_blocking
    layer = [np.ones((64, 64), np.float32), np.arange(10, dtype=np.int64)]       # pageable: staged
    first = copies.upload(layer, pinned=False)
    second = copies.upload(layer, pinned=False)                  # the first copy has not run: a second buffer
    assert copies.pool.allocated == 2
    for upload in (first, second):
        got = upload.arrays()
        assert np.array_equal(got[0].get(), layer[0]) and np.array_equal(got[1].get(), layer[1])
    for _ in range(3):                                           # their copies ran: reused, none pinned anew
        copies.upload(layer, pinned=False).arrays()
    assert copies.pool.allocated == 2
    device = emu_cupy.full((4, 4), 3.0, dtype=np.float32)
    with copies.fetched([device, device[:, :2]]) as (whole, half):
        assert np.all(whole == 3.0) and half.shape == (4, 2) and emu._state.is_pinned(whole)
    assert copies.pool.allocated == 2                            # fetched took a free buffer too
