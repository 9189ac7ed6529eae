"""The quantized KV cache and top-k sparse decode attention of the CUDA backend, with no GPU.

1. The kernels (kv_quant.cu, decode_attention_quant.cu) on the CPU emulator against quant/kv.py and
   kv_attention.py: appended cache bytes equal quantize_rows exactly, dequantized rows equal dequantize_rows
   exactly, decode attention within float32 summation-order tolerance; outputs and caches poisoned before launch.
2. backend/cupy_kv.py (what CupyOps.attention runs for a QuantizedKV cache or top-k) end to end over NumPy arrays:
   `EmuOps` stands in for CupyOps with xp = numpy and its kernels on the emulator (kernels=True) or none (the plain
   array path), held to NumpyOps.attention for decode, prefill and top-k, int8 and int4, MHA and GQA, ragged starts.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend import cupy_kv
from hpcinfer.backend.cupy_ops import CupyOps
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate
from hpcinfer.quant.formats import QuantError
from hpcinfer.quant.kv import QuantizedKV, dequantize_rows, kv_format, quantize_rows

from emu_ops import EmulatedKernelOps

F32, F16 = np.float32, np.float16
OPS = NumpyOps()
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
N, LMAX, HD = 4, 24, 64


class EmuOps(EmulatedKernelOps):
    """CupyOps' interface as cupy_kv.py uses it, over NumPy: kernels on the CPU emulator (or none), the float
    attention (prefill over the scratch cache) from NumpyOps."""

    name = "cupy"
    _rows = CupyOps._rows
    _decode_indices = CupyOps._decode_indices
    _check_cache = staticmethod(CupyOps._check_cache)

    @staticmethod
    def _f32(a):
        return a.astype(F32, copy=False)

    def _grid(self, work: int, block: int) -> int:
        return max(1, min(-(-work // block), 3))          # few blocks: the grid-stride loops wrap

    def attention(self, *args, **kwargs):
        return OPS.attention(*args, **kwargs)


def _poison_cache(fmt, kv_heads):
    """A QuantizedKV whose every byte is garbage (q 0xA5, scale and min NaN) until written."""
    cache = QuantizedKV.zeros(OPS, fmt, (N, kv_heads, LMAX, HD))
    cache.q[:] = 0xA5
    cache.scale[:] = np.nan
    cache.min[:] = np.nan
    return cache


def _filled(rng, fmt, kv_heads, slots, starts):
    """(cache_k, cache_v) with rows 0..start-1 of each slot quantized from random data, the rest finite garbage
    (NaN would poison the reference itself: it reads rows 0..L-1 of every sequence and masks them afterwards)."""
    caches = []
    for spread in (2.0, 1.0):
        cache = _poison_cache(fmt, kv_heads)
        cache[:] = rng.standard_normal((N, kv_heads, LMAX, HD)).astype(F32) * 50
        for slot, start in zip(slots, starts):
            rows = rng.standard_normal((kv_heads, start, HD)).astype(F32) * spread
            rows[:, :, :fmt.group] += rng.standard_normal((kv_heads, start, 1)).astype(F32)   # per-group offsets
            cache[slot, :, :start] = rows
        caches.append(cache)
    return caches


def _copy(cache):
    return cache.map(np.copy)


def _same_bytes(a: QuantizedKV, b: QuantizedKV):
    for x, y in zip(a.parts(), b.parts()):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _step_inputs(rng, step, H, Hkv):
    T = step.num_tokens
    return (rng.standard_normal((T, H, HD)).astype(F32), rng.standard_normal((T, Hkv, HD)).astype(F32) * 2,
            rng.standard_normal((T, Hkv, HD)).astype(F32))


# ---- 1. the kernels on the emulator ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, group", [("int8", 32), ("int4", 64), ("int4", 32), ("int8", 64)])
@pytest.mark.parametrize("Hkv", [1, 3])
@needs_emulator
def test_emulated_quantize_append_is_bit_exact(mode, group, Hkv):
    rng = np.random.default_rng(7)
    fmt = kv_format(mode, group, HD)
    slots, starts, counts = [2, 0, 3], [5, 0, 20], [3, 4, 1]
    step = StepLayout.build(slots, starts, counts)
    k = rng.standard_normal((step.num_tokens, Hkv, HD)).astype(F32) * 3
    v = rng.standard_normal((step.num_tokens, Hkv, HD)).astype(F32) / 100
    k[1, 0, :group] = 0.75                                             # a constant group: scale 0
    k[2, -1, group:2 * group] = -1e-3                                  # and a negative one
    v[0, 0, 0] = 6e4                                                   # near the float16 limit
    cache_k, cache_v = _poison_cache(fmt, Hkv), _poison_cache(fmt, Hkv)
    ref_k, ref_v = _copy(cache_k), _copy(cache_v)
    for s in range(step.num_seqs):
        a, b = step.token_range(s)
        ref_k[slots[s], :, starts[s]:starts[s] + b - a] = k[a:b].transpose(1, 0, 2)
        ref_v[slots[s], :, starts[s]:starts[s] + b - a] = v[a:b].transpose(1, 0, 2)
    status = np.zeros(1, np.int32)
    emulate.build("kv_quant", {"T_ACT": "float", "KV_BITS": fmt.bits, "BLOCK": 32}).launch(
        "kv_quantize_append", (max(counts), len(slots)), (32,), k, v, *cache_k.parts(), *cache_v.parts(),
        np.array(slots, np.int64), np.array(starts, np.int64), np.asarray(step.offsets, np.int64), Hkv, HD, fmt.group,
        LMAX, Hkv * HD, Hkv * HD, status)
    _same_bytes(cache_k, ref_k)                       # written rows equal quantize_rows, the poison elsewhere kept
    _same_bytes(cache_v, ref_v)
    assert status[0] == 0


@needs_emulator
def test_emulated_quantize_append_flags_float16_overflow():
    fmt = kv_format("int8", 64, HD)
    k = np.zeros((1, 1, HD), F32)
    k[0, 0, 0] = -1e6                                                  # min below float16's range
    with pytest.raises(QuantError):
        quantize_rows(k, fmt)
    cache_k, cache_v, status = _poison_cache(fmt, 1), _poison_cache(fmt, 1), np.zeros(1, np.int32)
    emulate.build("kv_quant", {"T_ACT": "float", "KV_BITS": 8, "BLOCK": 32}).launch(
        "kv_quantize_append", (1, 1), (32,), k, k.copy(), *cache_k.parts(), *cache_v.parts(), np.zeros(1, np.int64),
        np.zeros(1, np.int64), np.array([0, 1], np.int64), 1, HD, 64, LMAX, HD, HD, status)
    assert status[0] == 1


@pytest.mark.parametrize("mode, group", [("int8", 32), ("int4", 64), ("int4", 32)])
@needs_emulator
def test_emulated_dequantize_rows_is_bit_exact(mode, group):
    rng = np.random.default_rng(3)
    fmt, Hkv = kv_format(mode, group, HD), 2
    cache = QuantizedKV.zeros(OPS, fmt, (N, Hkv, LMAX, HD))
    cache[:] = rng.standard_normal((N, Hkv, LMAX, HD)).astype(F32) * 4
    R = 50
    src = rng.integers(0, N * Hkv * LMAX, R).astype(np.int64)
    dst = rng.permutation(R + 7)[:R].astype(np.int64)                  # scattered into a bigger buffer
    out = np.full((R + 7, HD), np.nan, F32)
    module = emulate.build("kv_quant", {"T_ACT": "float", "KV_BITS": fmt.bits, "BLOCK": 64})
    module.launch("kv_dequantize_rows", (3,), (64,), *cache.parts(), src, dst, out, R, HD, fmt.group)
    flat = [a.reshape(-1, a.shape[-1])[src] for a in cache.parts()]
    ref = dequantize_rows(*flat, fmt)
    np.testing.assert_array_equal(out[dst], ref)
    assert np.isnan(np.delete(out, dst, axis=0)).all()                 # nothing else written
    out2 = np.full((R, HD), np.nan, F32)
    module.launch("kv_dequantize_rows", (2,), (64,), *cache.parts(), src, None, out2, R, HD, fmt.group)
    np.testing.assert_array_equal(out2, ref)


DECODE_CASES = [
    # mode, group, H, Hkv, slots, starts, chunks, rotary_dim, defines
    ("int8", 32, 4, 4, [1, 3, 0], [0, 9, 20], 1, 0, {}),                   # MHA, a first token, ragged
    ("int4", 64, 6, 2, [2, 0], [13, 2], 3, 0, {"NWARPS": 2}),              # GQA, split and combined in one launch
    ("int4", 32, 8, 1, [3], [17], 5, 32, {"NWARPS": 8}),                   # MQA, rotary fused (half the dims)
    ("int8", 4, 2, 1, [0, 2], [22, 5], 2, 64, {}),                         # groups of 4: a load spans two
]


@pytest.mark.parametrize("mode, group, H, Hkv, slots, starts, chunks, rotary_dim, defines", DECODE_CASES)
@needs_emulator
def test_emulated_decode_attention_quant(mode, group, H, Hkv, slots, starts, chunks, rotary_dim, defines):
    """decode_attention_quant (one launch, C chunks combined by the last block; q and k rotated on the fly when
    rotary_dim > 0) against NumpyOps.rotary then NumpyOps.attention: the output within float32 summation order,
    the new rows stored bit for bit as quantize_rows stores them, the workspace filled, the counters back to 0."""
    rng = np.random.default_rng(11)
    fmt = kv_format(mode, group, HD)
    step = StepLayout.build(slots, starts, [1] * len(slots))
    cache_k, cache_v = _filled(rng, fmt, Hkv, slots, starts)
    S = len(slots)
    qkv = rng.standard_normal((S, (H + 2 * Hkv) * HD)).astype(F32)
    ld, scale = qkv.shape[1], 1.0 / np.sqrt(HD)
    q = qkv[:, :H * HD].reshape(S, H, HD)
    k = qkv[:, H * HD:(H + Hkv) * HD].reshape(S, Hkv, HD)
    v = qkv[:, (H + Hkv) * HD:].reshape(S, Hkv, HD)
    angles = rng.uniform(0, 2 * np.pi, (S, max(1, rotary_dim // 2)))
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    if rotary_dim:
        rot = OPS.rotary(np.concatenate([q, k], axis=1), cos, sin, rotary_dim)
        q, k = rot[:, :H], rot[:, H:]
    ref_k, ref_v = _copy(cache_k), _copy(cache_v)
    ref = OPS.attention(q, k, v, ref_k, ref_v, step, scale)
    out, status = np.full((S, H * HD), np.nan, F32), np.zeros(1, np.int32)
    part = np.full((S, H, chunks, 2 + HD), np.nan, F32) if chunks > 1 else None
    counters = np.zeros(S * Hkv, np.int32) if chunks > 1 else None
    rope = (cos, sin, rotary_dim) if rotary_dim else (None, None, 0)
    d = {"T_ACT": "float", "KV_BITS": fmt.bits, "HEAD_DIM": HD, "GROUP": H // Hkv, **defines}
    emulate.build("decode_attention_quant", d).launch(
        "decode_attention_quant", (Hkv, S, chunks), (32, d.get("NWARPS", 4)), qkv, qkv[:, H * HD:],
        qkv[:, (H + Hkv) * HD:], *cache_k.parts(), *cache_v.parts(), np.array(slots, np.int64),
        np.array(starts, np.int64), *rope, out, part, counters, H, Hkv, HD, fmt.group, LMAX, ld, ld, ld, H * HD,
        scale, status)
    assert np.isfinite(out).all() and status[0] == 0
    if chunks > 1:
        assert not np.isnan(part).any() and not counters.any()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    _same_bytes(cache_k, ref_k)
    _same_bytes(cache_v, ref_v)


# ---- 2. cupy_kv.py end to end over NumPy -------------------------------------------------------------------------
E2E = [
    # mode, group, H, Hkv, slots, starts, counts
    ("int8", 32, 4, 4, [1, 3, 0], [0, 9, 20], [1, 1, 1]),                  # decode, MHA
    ("int4", 64, 6, 2, [2, 0, 3], [13, 2, 7], [1, 1, 1]),                  # decode, GQA
    ("int4", 32, 6, 2, [2, 0, 3], [0, 5, 11], [4, 1, 6]),                  # prefill: a fresh and two continued
    ("int8", 64, 4, 4, [3, 1], [3, 0], [9, 2]),                            # prefill, MHA
]


@pytest.mark.parametrize("kernels", [True, False], ids=["emulated-kernels", "plain-arrays"])
@pytest.mark.parametrize("mode, group, H, Hkv, slots, starts, counts", E2E)
@needs_emulator
def test_cupy_kv_attention_matches_numpy(kernels, mode, group, H, Hkv, slots, starts, counts):
    rng = np.random.default_rng(5)
    fmt = kv_format(mode, group, HD)
    step = StepLayout.build(slots, starts, counts)
    cache_k, cache_v = _filled(rng, fmt, Hkv, slots, starts)
    q, k, v = _step_inputs(rng, step, H, Hkv)
    ref_k, ref_v = _copy(cache_k), _copy(cache_v)
    ref = OPS.attention(q, k, v, ref_k, ref_v, step, 0.125)
    ops = EmuOps(kernels)
    out = cupy_kv.attention(ops, q, k, v, cache_k, cache_v, step, 0.125)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    _same_bytes(cache_k, ref_k)
    _same_bytes(cache_v, ref_v)
    if kernels:
        expected = {"decode_attention_quant"} if step.is_decode else {"kv_quantize_append"}
        assert expected <= set(ops.launched)
    else:
        assert not ops.launched


TOPK = [
    # mode (None: float cache), group, H, Hkv, slots, starts, topk
    (None, 0, 6, 2, [3, 0, 2], [20, 6, 13], 0.3),
    ("int8", 32, 4, 4, [1, 3], [9, 0], 0.5),
    ("int4", 64, 6, 2, [3, 0, 2], [20, 6, 13], 0.25),
]


@pytest.mark.parametrize("kernels", [True, False], ids=["emulated-kernels", "plain-arrays"])
@pytest.mark.parametrize("mode, group, H, Hkv, slots, starts, topk", TOPK)
@needs_emulator
def test_cupy_kv_top_k_matches_numpy(kernels, mode, group, H, Hkv, slots, starts, topk):
    rng = np.random.default_rng(9)
    step = StepLayout.build(slots, starts, [1] * len(slots))
    if mode is None:
        cache_k = rng.standard_normal((N, Hkv, LMAX, HD)).astype(F32)
        cache_v = rng.standard_normal((N, Hkv, LMAX, HD)).astype(F32)
        copy = np.copy
    else:
        fmt = kv_format(mode, group, HD)
        cache_k, cache_v = _filled(rng, fmt, Hkv, slots, starts)
        copy = _copy
    q, k, v = _step_inputs(rng, step, H, Hkv)
    ref_k, ref_v = copy(cache_k), copy(cache_v)
    ref = OPS.attention(q, k, v, ref_k, ref_v, step, 0.125, topk=topk)
    dense = OPS.attention(q, k, v, copy(cache_k), copy(cache_v), step, 0.125)
    out = cupy_kv.attention(EmuOps(kernels), q, k, v, cache_k, cache_v, step, 0.125, topk=topk)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert not np.allclose(out, dense, atol=1e-3)                     # top-k did drop positions
    if mode is None:
        np.testing.assert_array_equal(cache_k, ref_k)
        np.testing.assert_array_equal(cache_v, ref_v)
    else:
        _same_bytes(cache_k, ref_k)
        _same_bytes(cache_v, ref_v)


@pytest.mark.parametrize("mode, group", [("int8", 64), ("int4", 32), ("int4", 8)])
def test_array_quantize_matches_quant_kv(mode, group):
    """cupy_kv's plain-array quantize / dequantize (run here with xp = numpy) are bit-exact with quant/kv.py,
    float16 rounding edge cases included."""
    rng = np.random.default_rng(1)
    fmt = kv_format(mode, group, HD)
    x = rng.standard_normal((5, 3, HD)).astype(F32) * np.array([1e-6, 1, 300, 6e4 / 4, 1e-3], F32)[:, None, None]
    x[0, 0, :group] = 0.0
    x[1, 1, :group] = -2.5
    x[2, 2, :group] = np.float32(65504.0)
    ref = quantize_rows(x, fmt)
    got = cupy_kv.quantize_rows(np, x, fmt)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    np.testing.assert_array_equal(cupy_kv.dequantize_rows(np, *ref, fmt), dequantize_rows(*ref, fmt))
    with pytest.raises(QuantError):
        cupy_kv.quantize_rows(np, np.full((1, HD), -1e6, F32), fmt)


def test_prefix_rows():
    seq, head, pos = cupy_kv._prefix_rows(np.array([2, 0, 3]), 2)
    assert list(zip(seq, head, pos)) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                         (2, 0, 0), (2, 0, 1), (2, 0, 2), (2, 1, 0), (2, 1, 1), (2, 1, 2)]


# ---- 3. CupyOps.attention on the fake cupy (tests/helpers/emu_cupy/: device arrays, kernels on the emulator) ---------
FAKE = [
    # mode (None: float cache), group, H, Hkv, slots, starts, counts, topk
    ("int4", 32, 6, 2, [2, 0, 3], [0, 5, 11], [4, 1, 6], 0.0),             # prefill
    ("int8", 64, 6, 2, [2, 0, 3], [13, 2, 7], [1, 1, 1], 0.0),             # decode
    ("int4", 64, 4, 4, [3, 1], [20, 9], [1, 1], 0.3),                      # decode, top-k
    (None, 0, 6, 2, [3, 0, 2], [20, 6, 13], [1, 1, 1], 0.3),               # top-k over a float cache
]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "plain-cupy"])
@pytest.mark.parametrize("mode, group, H, Hkv, slots, starts, counts, topk", FAKE)
@needs_emulator
def test_cupy_ops_attention_on_fake_cupy(monkeypatch, kernels, mode, group, H, Hkv, slots, starts, counts, topk):
    emu = pytest.importorskip("emu_cupy", reason="tests/helpers/emu_cupy/ (the CPU fake of cupy) is not there")
    emu.install(monkeypatch)
    ops = CupyOps(device=0, kernels=kernels)
    rng = np.random.default_rng(4)
    step = StepLayout.build(slots, starts, counts)
    if mode is None:
        host_k, host_v = (rng.standard_normal((N, Hkv, LMAX, HD)).astype(F32) for _ in range(2))
        dev_k, dev_v = ops.asarray(host_k), ops.asarray(host_v)
        host = ops.to_host
    else:
        host_k, host_v = _filled(rng, kv_format(mode, group, HD), Hkv, slots, starts)
        dev_k, dev_v = (c.map(ops.asarray) for c in (host_k, host_v))
        host = lambda c: c.map(ops.to_host)                                # noqa: E731
    q, k, v = _step_inputs(rng, step, H, Hkv)
    ref = OPS.attention(q, k, v, host_k, host_v, step, 0.125, topk=topk)
    out = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), dev_k, dev_v, step, 0.125, topk=topk)
    np.testing.assert_allclose(ops.to_host(out), ref, rtol=2e-5, atol=2e-5)
    if mode is None:
        np.testing.assert_array_equal(host(dev_k), host_k)
        np.testing.assert_array_equal(host(dev_v), host_v)
    else:
        _same_bytes(host(dev_k), host_k)
        _same_bytes(host(dev_v), host_v)


def test_cuda_graphs_refuse_top_k(tmp_path):
    """A captured decode step cannot take top-k's kept counts from the host; a quantized cache is fine."""
    from hpcinfer.config import load_config
    from hpcinfer.errors import ConfigError

    def config(model, generate):
        path = tmp_path / "job.toml"
        path.write_text(f'[model]\npreset = "tiny-dense"\n{model}\n[generate]\nprompts = "p.jsonl"\n'
                        f'output = "o.jsonl"\n{generate}\n[runtime]\nbackend = "cupy"\ncuda_graphs = true\n')
        return str(path)

    with pytest.raises(ConfigError, match="top-k"):
        load_config(config("", "attention_topk = 0.25"))
    assert load_config(config('kv_cache = "int4"', "attention_topk = 1.0")).model.kv_cache == "int4"
