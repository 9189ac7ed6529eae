"""Quantized weights on the CUDA backend (issue 7): cuda_src/quant_gemv.cu and quant_dequant.cu run on the CPU
emulator (tests/helpers/kernel_emulator.py) against dequantize-then-matmul in float64, the quant layout's round trip,
and the CuPy-side wrappers (backend/cupy_quant.py) driven over NumPy arrays against NumpyOps.linear_q / embedding_q.

Tolerances. The kernels dequantize each weight as scale * q (+ min) in float32, the operations (and order) of
quant.formats.dequantize, so with the emulator's -ffp-contract=off the dequantized weights are bit-identical to the
reference's (quant_dequant is checked for exact equality). What remains is float32 accumulation of `in` products
(in any order, plus the bias add): |fl(y) - y| <= (in + 2) * u * (sum_k |w_k x_k| + |bias|) with u = 2^-24, the
standard bound for a recursive or pairwise float sum; the GEMV tests assert exactly that bound per element,
against the float64 product of the same dequantized weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend import cupy_quant
from hpcinfer.backend.cupy_ops import CupyOps, gpu_available
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate
from hpcinfer.kernels import layout
from hpcinfer.quant.formats import dequantize, quantize

from emu_ops import EmulatedKernelOps


F32 = np.float32
U = 2.0 ** -24
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")


@pytest.fixture
def rng():
    return np.random.default_rng()


def _weight(rng, out, n_in, mode, group):
    w = rng.standard_normal((out, n_in)).astype(F32) / np.sqrt(n_in)
    return quantize(w, mode, group)


def _device(qt):
    return cupy_quant.to_device(qt, np)                       # the device form, over NumPy arrays


def _bound_close(y, x, qt, bias):
    """y [T, O] against x @ dequantize(qt).T + bias in float64, within (in + 2) u (|W| |x| + |bias|)."""
    w = dequantize(qt).astype(np.float64)
    x64 = x.astype(np.float64)
    b = np.zeros(w.shape[0]) if bias is None else bias.astype(np.float64)
    ref = x64 @ w.T + b
    bound = (w.shape[1] + 2) * U * (np.abs(x64) @ np.abs(w).T + np.abs(b))
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    assert np.isfinite(y).all(), "an output left unwritten (NaN poison)"
    err = np.abs(y - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound.flat[err.argmax()]:.3g}"


# ---- layout ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, n_bytes", [(np.int8, 50), (np.uint8, 48), (np.uint8, 7)])
def test_quant_pack_round_trip(rng, dtype, n_bytes):
    q = rng.integers(-128 if dtype == np.int8 else 0, 128, (5, n_bytes)).astype(dtype)
    scale, minimum = rng.random((5, 3)).astype(F32), rng.random((5, 3)).astype(F32)
    qp, st, mt = layout.quant_pack(q, scale, minimum)
    assert qp.shape == (-(-n_bytes // 16), 5, 16) and qp.dtype == dtype and st.shape == (3, 5)
    assert np.array_equal(qp[1, 2], q[2, 16:32]) if n_bytes >= 32 else True   # vector kv of row c: bytes kv*16..
    assert not qp.reshape(-1, 5, 16).transpose(1, 0, 2).reshape(5, -1)[:, n_bytes:].any()   # zero padding
    q2, s2, m2 = layout.quant_unpack(qp, n_bytes, st, mt)
    assert np.array_equal(q2, q) and np.array_equal(s2, scale) and np.array_equal(m2, minimum)
    assert layout.quant_pack(q, scale)[2] is None


def test_device_form_defines():
    rng = np.random.default_rng(0)
    cases = {("int8", 64): {"QBITS": 8, "QSIGNED": 1, "HAS_MIN": 0, "GROUP": 0},
             ("int4", 64): {"QBITS": 4, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 64},
             ("asym8", 32): {"QBITS": 8, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 32},
             ("q8_0", 32): {"QBITS": 8, "QSIGNED": 1, "HAS_MIN": 0, "GROUP": 32},
             ("int4", 16): None}                                 # 16 < 32 elements of a 4-bit vector: array path
    for (mode, group), want in cases.items():
        dq = _device(_weight(rng, 8, 128, mode, group))
        assert dq.defines() == want, (mode, group)
        assert dq.nbytes == dq.q.nbytes + dq.scale.nbytes + (0 if dq.min is None else dq.min.nbytes)


# ---- the kernels on the emulator --------------------------------------------------------------------------------
# (mode, group, out, in): out not a multiple of the 32-row tile; in not a multiple of the vector (per-row scales)
FORMATS = [("int8", 0, 40, 50), ("int4", 32, 37, 96), ("int4", 64, 33, 128), ("int4", 128, 20, 256),
           ("asym8", 32, 35, 64), ("q8_0", 32, 9, 64), ("asym8", 50, 9, 50)]
GEMV_CASES = [(*f, T) for f in FORMATS for T in (1, 3)] + [
    ("int4", 64, 33, 128, 16), ("int8", 0, 40, 50, 16), ("asym8", 32, 35, 64, 16)]


def _launch_gemv(dq, x, ldx, bias, T, splits=1, max_tokens=None, x_vec=True, warps=4, rows=1):
    out, n_in = dq.shape
    d = {"T_STORAGE": "float", **dq.defines(), "MAX_TOKENS": max_tokens or T, "HAS_BIAS": int(bias is not None),
         "X_VEC": int(x_vec), "WARPS": warps, "ROWS": rows, "UNROLL": 2}
    module = emulate.build("quant_gemv", d)
    y = np.full((T, out), np.nan, F32)
    partial = np.full((splits, T, out), np.nan, F32)
    module.launch("quant_gemv", (-(-out // (32 * rows)), splits), (32, warps), x, dq.q, dq.scale, dq.min, bias, y,
                  partial, T, n_in, out, ldx, out)
    if splits > 1:
        module.launch("quant_gemv_reduce", (-(-T * out // 256),), (256,), partial, bias, y, T, out, splits, out)
    return y


@pytest.mark.parametrize("mode, group, out, n_in, T", GEMV_CASES)
@needs_emulator
def test_emulated_quant_gemv(rng, mode, group, out, n_in, T):
    qt = _weight(rng, out, n_in, mode, group or n_in)
    dq = _device(qt)
    ldx = -(-n_in // 4) * 4 + 4                                # rows a multiple of 16 bytes apart (X_VEC=1)
    xb = rng.standard_normal((T, ldx)).astype(F32)
    bias = rng.standard_normal(out).astype(F32) if T != 3 else None
    y = _launch_gemv(dq, xb, ldx, bias, T, max_tokens=16 if T == 3 else None)
    _bound_close(y, xb[:, :n_in], qt, bias)


@pytest.mark.parametrize("mode, group, options", [("int4", 32, {"splits": 3, "x_vec": False}),
                                                  ("int8", 0, {"splits": 2, "warps": 2, "rows": 2}),
                                                  ("asym8", 32, {"x_vec": False, "rows": 2})])
@needs_emulator
def test_emulated_quant_gemv_splits_and_options(rng, mode, group, options):
    out, n_in, T = 70, 192, 2
    qt = _weight(rng, out, n_in, mode, group or n_in)
    ldx = n_in + 3 if not options.get("x_vec", True) else n_in  # odd stride: element-wise x loads (X_VEC=0)
    xb = rng.standard_normal((T, ldx)).astype(F32)
    bias = rng.standard_normal(out).astype(F32)
    y = _launch_gemv(_device(qt), xb, ldx, bias, T, **options)
    _bound_close(y, xb[:, :n_in], qt, bias)


@needs_emulator
def test_emulated_quant_gemv_too_many_tokens_writes_nothing(rng):
    qt = _weight(rng, 8, 32, "int4", 32)
    x = rng.standard_normal((3, 32)).astype(F32)
    y = _launch_gemv(_device(qt), x, 32, None, 3, max_tokens=2)
    assert np.isnan(y).all()


@pytest.mark.parametrize("mode, group, out, n_in", FORMATS)
@needs_emulator
def test_emulated_quant_dequant(rng, mode, group, out, n_in):
    qt = _weight(rng, out, n_in, mode, group or n_in)
    dq = _device(qt)
    full = dequantize(qt)
    module = emulate.build("quant_dequant", {"T_STORAGE": "float", **dq.defines(), "BLOCK": 64})
    rows = np.array([out - 1, 0, 3, 3, out // 2], np.int64)     # unordered, repeated: an embedding gather
    ldt = n_in + 5
    tile = np.full((len(rows), ldt), np.nan, F32)
    module.launch("quant_dequant", (2,), (64,), dq.q, dq.scale, dq.min, rows, tile, len(rows), 0, n_in, out, ldt)
    assert np.array_equal(tile[:, :n_in], full[rows])          # bit-identical: same float32 operations
    assert np.isnan(tile[:, n_in:]).all()                       # nothing written past `in`
    r0, R = 1, min(out - 1, 7)                                  # rows = null: a block of rows from r0
    tile = np.full((R, n_in), np.nan, F32)
    module.launch("quant_dequant", (1,), (64,), dq.q, dq.scale, dq.min, None, tile, R, r0, n_in, out, n_in)
    assert np.array_equal(tile, full[r0:r0 + R])


# ---- the wrappers (backend/cupy_quant.py) over NumPy arrays, kernels on the emulator ----------------------------
class _EmulatorOps(EmulatedKernelOps):
    """Just what cupy_quant asks of a CupyOps, with xp = numpy and each kernel launched on the emulator (kernels=
    False: the plain-array path)."""

    _sm_count = 4

    def _f32(self, a):
        return a if a.dtype == F32 else a.astype(F32)

    _rows = CupyOps._rows
    _grid = CupyOps._grid


@pytest.mark.parametrize("kernels", [True, False])
@needs_emulator
def test_wrappers_match_numpy_ops(rng, kernels):
    ops, ref = _EmulatorOps(kernels), NumpyOps()
    qt = _weight(rng, 45, 128, "int4", 64)
    dq = cupy_quant.to_device(qt, np)
    bias = rng.standard_normal(45).astype(F32)
    for T in (1, 5, 20):                                        # 20 > 16: the tiled path
        x = rng.standard_normal((T, 128)).astype(F32)
        y = cupy_quant.linear_q(ops, x, dq, bias) if T != 20 else cupy_quant.tiled_linear(ops, x, dq, bias, 16)
        _bound_close(y, x, qt, bias)
        np.testing.assert_allclose(y, ref.linear_q(x, qt, bias), rtol=1e-5, atol=1e-5)
    if not kernels:
        assert cupy_quant.gemv(ops, x[:2], dq, None) is None          # no kernel: linear_q takes the tiled path
    ids = np.array([3, 0, 44, 3])
    assert np.array_equal(cupy_quant.embedding_q(ops, dq, ids), ref.embedding_q(qt, ids))
    if kernels:
        assert {"quant_gemv", "quant_dequant"} <= set(ops.launched)
    assert cupy_quant.linear_q(ops, np.zeros((0, 128), F32), dq).shape == (0, 45)


@needs_emulator
def test_wrapper_gemv_with_splits(rng):
    ops = _EmulatorOps()
    qt = _weight(rng, 40, 50, "int8", 64)
    x = rng.standard_normal((3, 50)).astype(F32)
    y = cupy_quant.gemv(ops, x, cupy_quant.to_device(qt, np), None, splits=2)
    assert ops.launched == ["quant_gemv", "quant_gemv_reduce"]
    _bound_close(y, x, qt, None)


def test_array_path_for_groups_the_kernel_cannot_read(rng):
    ops = _EmulatorOps(kernels=True)                            # a g16 4-bit weight: no kernel is even built
    qt = _weight(rng, 12, 64, "int4", 16)
    x = rng.standard_normal((2, 64)).astype(F32)
    _bound_close(cupy_quant.linear_q(ops, x, qt), x, qt, None)   # a host QuantizedTensor: uploaded per call
    assert ops.launched == []


# ---- CupyOps itself on the fake cupy of tests/helpers/emu_cupy/ (kernels on the emulator) ----------------------------
@pytest.mark.parametrize("mode, group, out, n_in", [("int8", 0, 40, 50), ("int4", 64, 33, 128)])
@pytest.mark.parametrize("kernels", [True, False])
@needs_emulator
def test_cupy_ops_on_emulated_cupy_match_numpy_ops(emu_cupy, rng, mode, group, out, n_in, kernels):
    ops, ref = CupyOps(device=0, kernels=kernels), NumpyOps()
    qt = _weight(rng, out, n_in, mode, group or n_in)
    dq = ops.prepare_quantized(qt)
    assert isinstance(dq, cupy_quant.DeviceQuantizedTensor) and isinstance(dq.q, emu_cupy.ndarray)
    bias = rng.standard_normal(out).astype(F32)
    for T in (1, 3, 17):                                         # 17 > 16: dequantized tiles + matmul
        x = rng.standard_normal((T, n_in)).astype(F32)
        y = ops.to_host(ops.linear_q(ops.asarray(x), dq, ops.asarray(bias) if T != 3 else None))
        _bound_close(y, x, qt, bias if T != 3 else None)
        np.testing.assert_allclose(y, ref.linear_q(x, qt, bias if T != 3 else None), rtol=1e-5, atol=1e-5)
    ids = np.array([out - 1, 0, 2, 2])
    assert np.array_equal(ops.to_host(ops.embedding_q(dq, ids)), ref.embedding_q(qt, ids))
    ran = cupy_quant.gemv(ops, ops.asarray(x[:2]), dq, None)                    # the kernel path, not a fallback
    assert (ran is not None) == kernels


# ---- on a GPU --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU visible to cupy")
@pytest.mark.parametrize("mode, group", [("int8", 64), ("int4", 64), ("q4_1", 32), ("asym8", 64), ("q8_0", 32)])
def test_cupy_linear_q_matches_numpy(rng, mode, group):
    ops, ref = CupyOps(0), NumpyOps()
    qt = _weight(rng, 300, 576, mode, group) if mode != "q4_1" else _weight(rng, 300, 576, "int4", 32)
    dq = ops.prepare_quantized(qt)
    bias = rng.standard_normal(300).astype(F32)
    for T in (1, 3, 16, 40):
        x = rng.standard_normal((T, 576)).astype(F32)
        y = ops.to_host(ops.linear_q(ops.asarray(x), dq, ops.asarray(bias)))
        np.testing.assert_allclose(y, ref.linear_q(x, qt, bias), rtol=1e-4, atol=1e-4)
    ids = np.array([5, 0, 299, 5])
    np.testing.assert_allclose(ops.to_host(ops.embedding_q(dq, ids)), ref.embedding_q(qt, ids), rtol=1e-6,
                               atol=1e-6)                        # scale * q + min may be one fused multiply-add


# ---- a quantized model end to end on the fake cupy ---------------------------------------------------------------
@pytest.mark.parametrize("mode, group", [("int8", 64), ("int4", 32)])
@pytest.mark.parametrize("kernels", [True, False])
@needs_emulator
def test_quantized_tiny_model_generates_numpys_tokens_on_emulated_cupy(emu_cupy, mode, group, kernels):
    """tiny-dense quantized at load ([model] quantize): every projection, the embedding and the LM head go through
    CupyOps.linear_q / embedding_q on the fake; logits and greedy tokens equal the NumPy backend's."""
    from hpcinfer.api import generate, prompt_logits
    from hpcinfer.checkpoint.presets import PRESETS, open_preset
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.transformer import Decoder
    from hpcinfer.quant.storage import configure

    def load(ops):
        ckpt = open_preset("tiny-dense")
        configure(ckpt, mode, group)
        return Decoder(ops, Groups(), PRESETS["tiny-dense"]).load(ckpt)

    prompts = [[1, 2, 3, 4, 5], [200, 7], [42] * 11]
    cpu, gpu = load(NumpyOps()), load(CupyOps(device=0, kernels=kernels))
    assert any(isinstance(getattr(layer, "qw", None), cupy_quant.DeviceQuantizedTensor)
               for layer in _layers(gpu)), "the weights were not quantized on the device"
    want, got = prompt_logits(cpu, prompts), prompt_logits(gpu, prompts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert generate(gpu, prompts, 6) == generate(cpu, prompts, 6)


def _layers(model):
    """Every object reachable from the model's blocks that holds a weight (for the quantized-weights check)."""
    found, stack, seen = [], [model], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        found.append(obj)
        for value in vars(obj).values():
            stack.extend(value if isinstance(value, list) else [value])
    return found
