"""CPU attention delegation on the cupy backend (FlexGen's `[offload] cpu_attention`) runs on the CupyOps' own host
NumpyOps, made with the rank's BLAS threads (`[runtime] threads` through make_ops), so a host cache's decode steps
split their sequences over those threads as a NumPy job's do (backend/numpy_decode.py). On the CPU stand-in."""

import numpy as np

from hpcinfer.backend import compiled_attention, cupy_attention, numpy_decode
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.backend.ops import make_ops


def test_host_attention_uses_the_ranks_threads(emu_cupy, monkeypatch):
    monkeypatch.setattr(numpy_decode, "MIN_PART_BYTES", 1)               # split however small the step
    ops = make_ops("cupy", 0, threads=3, cpu_kernels="numpy")          # NumPy's own split (numpy_decode.py)
    assert ops.host_ops.decode_attention.threads == 3
    parts = []
    rows = ops.host_ops.decode_attention._rows
    monkeypatch.setattr(ops.host_ops.decode_attention, "_rows", lambda p, *a: parts.append(p) or rows(p, *a))
    rng = np.random.default_rng(0)
    S, heads, kv_heads, hd, lmax = 4, 6, 2, 8, 16
    cache = [rng.standard_normal((S, kv_heads, lmax, hd), dtype=np.float32) for _ in range(2)]
    want_cache = [c.copy() for c in cache]
    q, k, v = (rng.standard_normal((S, h, hd), dtype=np.float32) for h in (heads, kv_heads, kv_heads))
    step = StepLayout.build(np.arange(S), [5, 9, 2, 11], [1] * S)
    got = cupy_attention.host_attention(ops, ops.asarray(q), ops.asarray(k), ops.asarray(v), *cache, step, 0.3, 0.0)
    want = NumpyOps(threads=1).attention(q, k, v, *want_cache, step, 0.3)
    np.testing.assert_array_equal(ops.to_host(got), want)
    assert sorted(parts) == [0, 1, 2]                                      # three threads took a block each


def test_host_attention_takes_the_compiled_kernels(emu_cupy, monkeypatch):
    """With cpu_kernels = numba (auto where it imports) the host NumpyOps runs backend/compiled_attention.py on the
    rank's threads; its result is the NumPy reference's within float32 rounding."""
    ops = make_ops("cupy", 0, threads=2, cpu_kernels="numba")
    assert ops.host_ops.cpu_kernels == "numba" and ops.host_ops.threads == 2
    calls = []
    attend = compiled_attention.attention
    monkeypatch.setattr(compiled_attention, "attention", lambda *a: calls.append(1) or attend(*a))
    rng = np.random.default_rng(1)
    S, heads, kv_heads, hd, lmax = 3, 4, 2, 8, 16
    cache = [rng.standard_normal((S, kv_heads, lmax, hd), dtype=np.float32) for _ in range(2)]
    want_cache = [c.copy() for c in cache]
    q, k, v = (rng.standard_normal((S, h, hd), dtype=np.float32) for h in (heads, kv_heads, kv_heads))
    step = StepLayout.build(np.arange(S), [5, 9, 2], [1] * S)
    got = cupy_attention.host_attention(ops, ops.asarray(q), ops.asarray(k), ops.asarray(v), *cache, step, 0.3, 0.0)
    want = NumpyOps(threads=1).attention(q, k, v, *want_cache, step, 0.3)
    np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-5)
    assert calls == [1]
