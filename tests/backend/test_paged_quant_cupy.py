"""Quantized KV pools and top-k over blocks on CuPy (cupy_paged.attention -> paged_attention.through_dense with
cupy_kv.attention), on the CPU stand-in for cupy (fixture `emu_cupy`; the kernels run on the emulator): the output
equals the NumPy spec's (backend/paged_attention.py) and the new rows are stored with the same bytes, with the
kernels and with plain CuPy, for decode, prefill and mixed steps at block sizes 1 and 4. The kernels launched are the
dense quantized cache's. End to end: tests/generate/test_continuous_quant_cupy.py."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend import cupy_paged, paged_attention
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.quant.kv import QuantizedKV, kv_format
import kernel_emulator as emulate
from test_paged_quant import SCALE, STEPS, arrays, case, fmt_of

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")


@pytest.fixture(params=["kernels", "plain-cupy"])
def ops(request, emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    return CupyOps(device=0, kernels=request.param == "kernels")


def on_device(cp, pool):
    return pool.map(cp.asarray) if isinstance(pool, QuantizedKV) else cp.asarray(pool)


@pytest.mark.parametrize("kind", sorted(STEPS))
@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("fmt_name, topk", [("int8", 0.0), ("int4", 0.0), ("int4", 0.5), ("float", 0.4)])
def test_cupy_paged_quantized_and_top_k_equal_numpy(emu_cupy, ops, kind, bs, fmt_name, topk):
    step, pools, _, q, k, v = case(kind, fmt_of(fmt_name), bs, seed=2)
    device = [on_device(emu_cupy, p) for p in pools]
    got = cupy_paged.attention(ops, *(ops.asarray(a) for a in (q, k, v)), *device, step, SCALE, topk)
    want = paged_attention.attention(NumpyOps(), q, k, v, *pools, step, SCALE, topk)
    np.testing.assert_allclose(ops.to_host(got), want, rtol=2e-5, atol=2e-6)
    for dev, host in zip(device, pools):                                     # the same bytes stored, nothing else
        for a, b in zip(arrays(dev), arrays(host)):
            np.testing.assert_array_equal(ops.to_host(a), b)


@pytest.mark.parametrize("kind, want", [
    ("decode", ["decode_attention_quant"]),                                # the dense quantized decode kernel
    ("prefill", ["kv_append", "prefill_attention", "kv_quantize_append"]),    # nothing cached yet: no dequantize
    ("mixed", ["kv_dequantize_rows", "kv_dequantize_rows", "kv_append", "prefill_attention", "kv_quantize_append"]),
])
def test_a_quantized_pool_runs_the_dense_quantized_kernels(emu_cupy, monkeypatch, kind, want):
    from hpcinfer.backend.cupy_ops import CupyOps

    launched, real = [], CupyOps._kernel

    def spy(self, name, function, **defines):
        fn = real(self, name, function, **defines)
        return None if fn is None else (lambda *args: launched.append(function) or fn(*args))
    monkeypatch.setattr(CupyOps, "_kernel", spy)
    ops = CupyOps(device=0)
    ops._sm_count = 0                                                        # one pass: no flash-decoding split
    step, pools, _, q, k, v = case(kind, fmt_of("int8"), 4, seed=3)
    cupy_paged.attention(ops, *(ops.asarray(a) for a in (q, k, v)), *(on_device(emu_cupy, p) for p in pools), step,
                         SCALE)
    assert launched == want
