"""backend/cupy_paged.py on the CPU stand-in for cupy (fixture `emu_cupy`; its kernels run on the emulator):
cupy_paged.attention equals backend/paged_attention.attention (NumpyOps, the spec) for decode (one pass and
flash-decoding), prefill and mixed steps over block tables scattered through a NaN-poisoned pool (-1 padded, as
BlockTables makes them), with the kernels and with plain CuPy, on the kernels' shapes and on the ones they leave
to the fallbacks (group 16, head dim 160); the pools equal the spec's after the append. A decode step as a CUDA
graph gives it (cupy_graphs.PagedDeviceStep) is read from its device buffers only (its host fields another step's),
with the flash-decoding chunk count of its KV bucket; past the kernel bounds its host values take the fallback.
End to end: a tiny-dense
Decoder on CupyOps through the continuous schedule gives the NumPy tokens (paged steps routed to cupy_paged in the
test, as CupyOps.attention does once wired)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend import cupy_paged, paged_attention
from hpcinfer.backend.cupy_graphs import PagedDeviceStep, kv_bucket
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.generate.block_manager import BlockPool, BlockTables
import kernel_emulator as emulate

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")
F32, SCALE = np.float32, 0.25

STEPS = {   # (starts, counts): positions cached before the step, new tokens
    "decode": ([0, 5, 17, 8], [1, 1, 1, 1]),            # only the new row; partial last blocks; several blocks
    "prefill": ([0, 0], [6, 9]),
    "mixed": ([6, 0, 11], [1, 7, 3]),                   # a decode token, a prompt, a prompt's later chunk
    "long-decode": ([47, 3, 0], [1, 1, 1]),             # long enough to split on many SMs (flash-decoding)
}


def paged_step(rng, starts, counts, bs, Hkv, hd, spare=3):
    """(step, pool_k, pool_v): tables grown in turn (each sequence's blocks scattered among the others'), the
    cached rows (positions < start) random, every other pool row NaN."""
    tables = BlockTables(BlockPool(num_blocks=sum(-(-(a + n) // bs) for a, n in zip(starts, counts)) + spare,
                                   block_size=bs))
    for length in range(1, max(a + n for a, n in zip(starts, counts)) + 1):
        for s, (a, n) in enumerate(zip(starts, counts)):
            if length <= a + n:
                tables.grow(s, length)
    pools = np.full((2, tables.pool.num_blocks, Hkv, bs, hd), np.nan, F32)
    for s, a in enumerate(starts):
        paged_attention.paged_append(pools[0], pools[1], tables.slots(s, 0, a),
                                     *rng.standard_normal((2, a, Hkv, hd)).astype(F32))
    return StepLayout.paged(tables.table_array(list(range(len(starts)))), bs, starts, counts), pools[0], pools[1]


def qkv_views(rng, T, H, Hkv, hd):
    """q [T, H, hd], k, v [T, Hkv, hd]: views into one fused qkv row, as the model passes them."""
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(F32)
    return (qkv[:, :H * hd].reshape(T, H, hd), qkv[:, H * hd:(H + Hkv) * hd].reshape(T, Hkv, hd),
            qkv[:, (H + Hkv) * hd:].reshape(T, Hkv, hd))


def check_against_numpy(cp, ops, kind, bs, H, Hkv, hd, seed=0, device=None):
    """device(cp, step) -> the step cupy_paged gets (a PagedDeviceStep), or None: the host step."""
    rng = np.random.default_rng(seed)
    step, pool_k, pool_v = paged_step(rng, *STEPS[kind], bs, Hkv, hd)
    q, k, v = qkv_views(rng, step.num_tokens, H, Hkv, hd)
    dev_k, dev_v = cp.asarray(pool_k), cp.asarray(pool_v)
    given = step if device is None else device(cp, step)
    got = cupy_paged.attention(ops, *(ops.asarray(a) for a in (q, k, v)), dev_k, dev_v, given, SCALE)
    # NumPy's paged path reads whole blocks and masks the scores (its pools only ever hold model rows): give it
    # the pools with the poison zeroed; the device side must not read the poison at all
    clean_k, clean_v = np.nan_to_num(pool_k, nan=0.0), np.nan_to_num(pool_v, nan=0.0)
    want = paged_attention.attention(NumpyOps(), q, k, v, clean_k, clean_v, step, SCALE)
    paged_attention.paged_append(pool_k, pool_v, step.flat_slots(), k, v)
    got = ops.to_host(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for dev, host in ((dev_k, pool_k), (dev_v, pool_v)):                 # the same rows appended, NaN elsewhere
        np.testing.assert_array_equal(ops.to_host(dev).view(np.uint32), host.view(np.uint32))


@pytest.fixture(params=["kernels", "plain-cupy"])
def ops(request, emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    return CupyOps(device=0, kernels=request.param == "kernels")


@pytest.mark.parametrize("kind", sorted(STEPS))
@pytest.mark.parametrize("bs, H, Hkv, hd", [(4, 4, 2, 16), (1, 2, 2, 8), (16, 8, 1, 32)])
def test_paged_attention_equals_numpy(emu_cupy, ops, kind, bs, H, Hkv, hd):
    check_against_numpy(emu_cupy, ops, kind, bs, H, Hkv, hd)


@pytest.mark.parametrize("H, Hkv, hd", [(16, 1, 8), (2, 1, 160)], ids=["group16", "hd160"])
def test_shapes_past_the_kernel_bounds_take_the_fallback(emu_cupy, ops, H, Hkv, hd):
    for kind in ("decode", "mixed"):
        check_against_numpy(emu_cupy, ops, kind, 4, H, Hkv, hd, seed=1)
    check_against_numpy(emu_cupy, ops, "decode", 4, H, Hkv, hd, seed=1, device=device_step)   # its host values


def device_step(cp, step, kv_len=None):
    """The PagedDeviceStep a graph of `step`'s key captures (kv_len: its KV bucket), holding `step`'s values."""
    return PagedDeviceStep.upload(cp, step, kv_len or kv_bucket(int(step.starts.max()) + 1))


def stale_device_step(cp, step, kv_len=None):
    """As a replayed graph sees `step`: a PagedDeviceStep of its key made from another step (starts 0, the tables
    in reverse order: its host fields), then loaded with `step`'s values. Only its device buffers are right."""
    other = StepLayout.paged(step.tables[::-1], step.block_size, np.zeros_like(step.starts), step.counts)
    made = device_step(cp, other, kv_len or kv_bucket(int(step.starts.max()) + 1))
    made.load(step)
    return made


@pytest.mark.parametrize("kind, kv_len, chunks", [
    ("decode", None, None),                   # 18 positions at most, bucket 64: one pass at 0 SMs
    ("long-decode", None, 3),                 # eager: 48 positions, 3 chunks (test_decode_runs_the_paged_kernels_alone)
    ("long-decode", 64, 4),                   # the graph's: its bucket's 64 positions
    ("long-decode", 128, 8),
])
def test_a_device_step_decodes_from_its_buffers_split_by_its_bucket(emu_cupy, monkeypatch, kind, kv_len, chunks):
    """The paged decode kernel reads the tables (as wide as the bucket's blocks) and lengths of a PagedDeviceStep's
    device buffers, not its host fields, and flash-decoding cuts the bucket's positions, not the longest
    length's (a captured grid must hold at every replay): the spec's numbers and appended rows either way."""
    from hpcinfer.backend.cupy_ops import CupyOps

    grids, real = [], CupyOps._kernel

    def spy(self, name, function, **defines):
        fn = real(self, name, function, **defines)
        return lambda *args: grids.append((function, args[0])) or fn(*args)
    monkeypatch.setattr(CupyOps, "_kernel", spy)
    ops = CupyOps(device=0)
    ops._sm_count = 0 if chunks is None else 132
    device = None if kv_len is None and chunks == 3 else (lambda cp, step: stale_device_step(cp, step, kv_len))
    check_against_numpy(emu_cupy, ops, kind, 4, 4, 2, 16, device=device)
    want = 1 if chunks is None else chunks
    assert [(f, tuple(grid)[2]) for f, grid in grids] == [("paged_decode_attention", want)]   # one launch


@pytest.mark.parametrize("sms, kind, want", [
    (0, "decode", ["paged_decode_attention"]),                               # unknown device: one pass
    (132, "long-decode", ["paged_decode_attention"]),     # 48 positions: 3 chunks, combined in the same launch
], ids=["one-pass", "flash-decoding"])
def test_decode_runs_the_paged_kernels_alone(emu_cupy, monkeypatch, sms, kind, want):
    from hpcinfer.backend.cupy_ops import CupyOps

    launched, real = [], CupyOps._kernel

    def spy(self, name, function, **defines):
        fn = real(self, name, function, **defines)
        return lambda *args: launched.append(function) or fn(*args)
    monkeypatch.setattr(CupyOps, "_kernel", spy)
    ops = CupyOps(device=0)
    ops._sm_count = sms
    check_against_numpy(emu_cupy, ops, kind, 4, 4, 2, 16)
    assert launched == want                                                  # the append fused: no gather


def test_an_empty_step_returns_no_rows(emu_cupy, ops):
    step = StepLayout.paged(np.zeros((0, 0), np.int32), 4, [], [])
    pool = emu_cupy.zeros((2, 1, 4, 8), dtype=F32)
    out = cupy_paged.attention(ops, *(emu_cupy.zeros((0, n, 8), F32) for n in (2, 1, 1)), pool, pool, step, SCALE)
    assert out.shape == (0, 16)


# ---- end to end: the continuous schedule on CupyOps --------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_continuous_schedule_on_cupy_gives_the_numpy_tokens(emu_cupy, monkeypatch, kv_dtype):
    """The continuous schedule over CupyOps (paged decode kernel, rotary fused; a float32 pool, and the float16
    pool [model] kv_dtype gives a float16 model by default) gives NumpyOps' tokens (its pool float32)."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.checkpoint.presets import PRESETS, PresetSource
    from hpcinfer.comm.group import Groups
    from hpcinfer.generate.engine import GenerationParams, StepTimes
    from hpcinfer.generate.paged_cache import PagedKVCache
    from hpcinfer.generate.runner import Runner
    from hpcinfer.generate.schedules.continuous import ContinuousParams, run_continuous
    from hpcinfer.model.transformer import Decoder

    dense, kinds = CupyOps.attention, set()

    def routed(self, q, k, v, cache_k, cache_v, step, scale, topk=0.0, rope=None):   # CupyOps.attention's wiring
        if step.is_paged:
            kinds.add(step.is_decode)
            assert cache_k.dtype == np.dtype(kv_dtype)
            return cupy_paged.attention(self, q, k, v, cache_k, cache_v, step, scale, rope=rope)
        return dense(self, q, k, v, cache_k, cache_v, step, scale, topk, rope)

    monkeypatch.setattr(CupyOps, "attention", routed)
    arch = PRESETS["tiny-dense"]
    prompts = [[1, 2, 3, 4, 5], [200, 7], [42] * 11, [9, 8, 7]]

    def tokens(ops):
        model = Decoder(ops, Groups(), arch).load(PresetSource("tiny-dense", arch))
        cache = PagedKVCache(ops, model.num_local_layers, 16, model.kv_heads_local, 4, arch.head_dim)
        out = {}

        def after_step(finished):
            out.update({s.index: s.generated for s in finished})
            return False

        run_continuous(Runner(model, GenerationParams(5, ignore_eos=True)), prompts, list(range(len(prompts))),
                       StepTimes(), ContinuousParams(2, 6), cache, after_step)
        return [out[i] for i in range(len(prompts))]

    assert tokens(CupyOps(device=0, kv_dtype=kv_dtype)) == tokens(NumpyOps())
    assert kinds == {True, False}                                          # decode steps and prefill / mixed ones


def test_the_step_goes_down_once_for_every_layer(emu_cupy, ops):
    rng = np.random.default_rng(2)
    step, pool_k, pool_v = paged_step(rng, *STEPS["mixed"], 4, 2, 8)
    q, k, v = (ops.asarray(a) for a in qkv_views(rng, step.num_tokens, 2, 2, 8))
    layers = [(emu_cupy.asarray(pool_k), emu_cupy.asarray(pool_v)) for _ in range(2)]
    first = cupy_paged.attention(ops, q, k, v, *layers[0], step, SCALE)
    uploads = dict(ops._paged_step[1])                                   # paged_attention.step_memo
    second = cupy_paged.attention(ops, q, k, v, *layers[1], step, SCALE)
    assert sorted(uploads) == [("device", "gather"), ("device", "slots")]
    assert all(ops._paged_step[1][name] is arrays for name, arrays in uploads.items())     # not uploaded again
    np.testing.assert_array_equal(ops.to_host(first), ops.to_host(second))
