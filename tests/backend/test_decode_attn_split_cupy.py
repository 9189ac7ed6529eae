"""Flash-decoding through CupyOps.attention on the CPU stand-in for cupy (tests/helpers/emu_cupy/, 132 SMs so a
small batch splits), against NumpyOps: a float32 cache, a quantized cache (int8, int4), and a decode step captured
in a CUDA graph (DecodeGraph) at short contexts then replayed at longer ones of the same KV bucket: the captured
chunk count stays, each sequence's chunks follow its own length on the device.
"""

from __future__ import annotations

import numpy as np
import pytest

import emu_cupy as emu
import kernel_emulator as emulate
from hpcinfer.backend import cupy_decode
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.quant.kv import QuantizedKV, kv_format

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")
F32 = np.float32
OPS = NumpyOps()
N, LMAX, H, HKV, HD, SCALE = 3, 64, 4, 2, 64, 0.25


@pytest.fixture
def gpu(monkeypatch):
    """CupyOps on the fake cupy with an H100's 132 SMs, and the chunk counts decode_splits chose (a list)."""
    emu.install(monkeypatch, sm_count=132)
    from hpcinfer.backend.cupy_ops import CupyOps

    chosen, choose = [], cupy_decode.decode_splits

    def spy(*args):
        chosen.append(choose(*args))
        return chosen[-1]
    monkeypatch.setattr(cupy_decode, "decode_splits", spy)
    return CupyOps(device=0), chosen


def _qkv(rng, S):
    """(q, k, v) [S, heads, HD] float32 host arrays."""
    return tuple(rng.standard_normal((S, heads, HD)).astype(F32) for heads in (H, HKV, HKV))


@pytest.mark.parametrize("starts", [[0, 40], [33, 5, 47]], ids=["lengths-1-41", "lengths-34-6-48"])
def test_split_decode_over_a_float_cache_matches_numpy(gpu, starts):
    ops, chosen = gpu
    rng, S = np.random.default_rng(1), len(starts)
    step = StepLayout.build(list(range(S))[::-1], starts, [1] * S)
    q, k, v = _qkv(rng, S)
    ref_k, ref_v = (rng.standard_normal((N, HKV, LMAX, HD)).astype(F32) for _ in range(2))
    cache_k, cache_v = ops.asarray(ref_k), ops.asarray(ref_v)
    want = OPS.attention(q, k, v, ref_k, ref_v, step, SCALE)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), cache_k, cache_v, step, SCALE)
    assert chosen == [(max(starts) + 1) // 16]                        # chunks of 16 positions at least: 2, 3
    np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ops.to_host(cache_k), ref_k)
    np.testing.assert_array_equal(ops.to_host(cache_v), ref_v)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_split_decode_over_a_quantized_cache_matches_numpy(gpu, mode):
    ops, chosen = gpu
    rng, starts = np.random.default_rng(2), [50, 0, 21]
    fmt = kv_format(mode, 32, HD)
    step = StepLayout.build([1, 2, 0], starts, [1, 1, 1])
    q, k, v = _qkv(rng, 3)
    refs = []
    for spread in (2.0, 1.0):
        cache = QuantizedKV.zeros(OPS, fmt, (N, HKV, LMAX, HD))
        cache[:] = rng.standard_normal((N, HKV, LMAX, HD)).astype(F32) * spread
        refs.append(cache)
    caches = [c.map(ops.asarray) for c in refs]
    want = OPS.attention(q, k, v, *refs, step, SCALE)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), *caches, step, SCALE)
    assert chosen == [3]                                            # 51 positions: 3 chunks of 17
    np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-5)
    for cache, ref in zip(caches, refs):
        for got_part, want_part in zip(cache.parts(), ref.parts()):
            np.testing.assert_array_equal(ops.to_host(got_part).view(np.uint8), want_part.view(np.uint8))


def test_a_captured_split_step_replays_at_longer_contexts(gpu):
    """Captured at lengths 4 and 21 (bucket 64: 4 chunks for the 4 blocks of 2 sequences x 2 KV heads), replayed
    at lengths up to 64 and with the sequences swapped: every step equals NumPy's, the cache too, and the key
    never ran eagerly (no host value steered the split)."""
    from hpcinfer.backend.cupy_graphs import DecodeGraph

    ops, chosen = gpu
    rng = np.random.default_rng(4)
    ref_k, ref_v = (rng.standard_normal((N, HKV, LMAX, HD)).astype(F32) for _ in range(2))
    cache_k, cache_v = ops.asarray(ref_k), ops.asarray(ref_v)

    def step_fn(inputs, step):
        qkv = inputs["qkv"]                                         # [S, (H + 2 Hkv) HD]
        q = qkv[:, :H * HD].reshape(-1, H, HD)
        k = qkv[:, H * HD:(H + HKV) * HD].reshape(-1, HKV, HD)
        v = qkv[:, (H + HKV) * HD:].reshape(-1, HKV, HD)
        return ops.attention(q, k, v, cache_k, cache_v, step, SCALE)

    graph = DecodeGraph(ops)
    for slots, starts in (([0, 2], [3, 20]), ([0, 2], [40, 63]), ([2, 0], [50, 33])):
        qkv = rng.standard_normal((2, (H + 2 * HKV) * HD)).astype(F32)
        q, k, v = (qkv[:, a * HD:b * HD].reshape(2, -1, HD) for a, b in ((0, H), (H, H + HKV), (H + HKV, H + 2 * HKV)))
        want = OPS.attention(q, k, v, ref_k, ref_v, StepLayout.build(slots, starts, [1, 1]), SCALE)
        got = graph(step_fn, {"qkv": qkv}, slots, starts)
        np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(ops.to_host(cache_k), ref_k)
        np.testing.assert_array_equal(ops.to_host(cache_v), ref_v)
    assert list(graph.captured) == [(2, 64)] and not graph.eager_keys
    assert chosen == [4, 4]                         # the warm-up and the capture (64 // 16); replays choose nothing
    graph.close()


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("starts, rotary_dim", [([0, 40], 64), ([33, 5, 47], 32)])
def test_rotary_is_fused_into_the_decode_kernel(gpu, monkeypatch, paged, starts, rotary_dim):
    """CupyOps.attention with rope on a decode step launches the decode kernel alone (q rotated as it is loaded, k as
    it is appended: no rotary kernel) and gives NumpyOps.attention's output and cache with the same rope."""
    from hpcinfer.backend.cupy_ops import CupyOps

    ops, _ = gpu
    launched, real = [], CupyOps._kernel
    monkeypatch.setattr(CupyOps, "_kernel", lambda self, name, function, **d: (
        lambda fn: (lambda *args: launched.append(function) or fn(*args)))(real(self, name, function, **d)))
    rng, S = np.random.default_rng(9), len(starts)
    q, k, v = _qkv(rng, S)
    angles = rng.uniform(0, 2 * np.pi, (S, rotary_dim // 2))
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    if paged:
        bs = 16
        tables = np.arange(S * (LMAX // bs), dtype=np.int32).reshape(S, -1)[::-1].copy()     # [S, 4] blocks
        step = StepLayout.paged(tables, bs, starts, [1] * S)
        ref_k, ref_v = (rng.standard_normal((S * LMAX // bs, HKV, bs, HD)).astype(F32) for _ in range(2))
    else:
        step = StepLayout.build(list(range(S))[::-1], starts, [1] * S)
        ref_k, ref_v = (rng.standard_normal((N, HKV, LMAX, HD)).astype(F32) for _ in range(2))
    cache_k, cache_v = ops.asarray(ref_k), ops.asarray(ref_v)
    want = OPS.attention(q, k, v, ref_k, ref_v, step, SCALE, rope=(cos, sin, rotary_dim))
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), cache_k, cache_v, step, SCALE,
                        rope=(ops.asarray(cos), ops.asarray(sin), rotary_dim))
    assert launched == ["paged_decode_attention" if paged else "decode_attention"]
    np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ops.to_host(cache_k), ref_k)
    np.testing.assert_array_equal(ops.to_host(cache_v), ref_v)


HALF_CASES = [   # dtype, kernels, paged, counts (1 each: a decode step; else a prefill)
    ("float16", True, False, [1, 1]), ("bfloat16", True, False, [1, 1, 1]), ("float16", True, True, [1, 1]),
    ("bfloat16", True, True, [3, 1]), ("float16", True, False, [4, 2]), ("bfloat16", False, False, [1, 1]),
    ("float16", False, True, [1, 1]), ("bfloat16", False, False, [3, 2]),
]


@pytest.mark.parametrize("dtype, kernels, paged, counts", HALF_CASES)
def test_a_half_precision_cache_matches_numpy(gpu, dtype, kernels, paged, counts):
    """A float16 or bfloat16 KV cache ([model] kv_dtype), dense or paged, decode or prefill, with the kernels
    (T_STORAGE) or plain CuPy: NumpyOps.attention over the same values gives the output (float32 sums in another
    order) and the same stored rows, bit for bit. The new k, v are values of the half type already (the reference,
    a float32 cache of the same values, then stores them exactly: NumPy's paged path keeps float32 pools)."""
    import ml_dtypes

    from hpcinfer.backend.cupy_ops import CupyOps

    _, _ = gpu
    ops = CupyOps(device=0, kernels=kernels)
    host_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    rng, S = np.random.default_rng(13), len(counts)
    starts = [37, 5, 20][:S]
    T = sum(counts)
    q, k, v = (rng.standard_normal((T, heads, HD)).astype(host_dtype).astype(F32) for heads in (H, HKV, HKV))
    if paged:
        bs = 16
        tables = rng.permutation(S * (LMAX // bs)).astype(np.int32).reshape(S, -1)
        step = StepLayout.paged(tables, bs, starts, counts)
        shape = (S * LMAX // bs, HKV, bs, HD)
    else:
        step = StepLayout.build(list(range(S))[::-1], starts, counts)
        shape = (N, HKV, LMAX, HD)
    halves = [rng.standard_normal(shape).astype(host_dtype) for _ in range(2)]
    cache_k, cache_v = (ops.asarray(h) for h in halves)
    ref_k, ref_v = (h.astype(F32) for h in halves)
    want = OPS.attention(q, k, v, ref_k, ref_v, step, SCALE)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), cache_k, cache_v, step, SCALE)
    assert cache_k.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)      # stored as it came
    np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ops.to_host(cache_k).view(np.uint16), ref_k.astype(host_dtype).view(np.uint16))
    np.testing.assert_array_equal(ops.to_host(cache_v).view(np.uint16), ref_v.astype(host_dtype).view(np.uint16))
