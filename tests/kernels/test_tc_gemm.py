"""The tensor-core small-batch GEMM (cuda_src/tc_gemm.cu) on the CPU kernel emulator, against its NumPy twin.

The emulator (tests/helpers/cuda_emu.h) runs mma.sync.m16n8k16, ldmatrix and cp.async on the fragment layouts of
the PTX ISA, so a wrong fragment index, swizzle, stage, tail or split shows here as a wrong number; the hardware's
summation order inside an mma differs from the emulator's (k order), so results are compared with a tolerance, and
the run-to-run determinism of a split-K launch is compared bit for bit. Outputs start as NaN (an element left
unwritten fails). The emulator primitives themselves are checked first, element by element, against their
documented layouts.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate

EMU_SKIP = emulate.unavailable()
pytestmark = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
F32 = np.float32
OPS = NumpyOps()
BF16 = ml_dtypes.bfloat16
_ACT = {1: "gelu", 2: "gelu_tanh", 3: "relu", 4: "silu"}


@pytest.fixture
def rng():
    return np.random.default_rng()


# ---- the emulated primitives against their documented layouts ----------------------------------------------
PRIMITIVES = r"""
#include "tc_mma.cuh"
// a [32][4], b [32][2] registers per lane; c [32][4] in, d out.
extern "C" __global__ void mma_probe(const unsigned* a, const unsigned* b, float* c) {
    const int l = threadIdx.x;
    unsigned ra[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
    unsigned rb[2] = {b[2 * l], b[2 * l + 1]};
    float rc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    tc_mma(rc, ra, rb, storage_t());
    for (int i = 0; i < 4; ++i) c[4 * l + i] = rc[i];
}
// m [4][8][8] 16-bit matrices in global memory: copied to shared memory by cp.async (one group per matrix, waited
// in order), then read back by ldmatrix x1 / x2 / x4 (mode 1, 2, 4; trans = mode >= 8) into r [32][4].
extern "C" __global__ void ldmatrix_probe(const unsigned short* m, unsigned* r, int mode) {
    __shared__ __align__(16) unsigned short s[4][8][8];
    const int l = threadIdx.x;
    for (int j = 0; j < 4; ++j) {
        if (l < 8) tc_cp_async16(&s[j][l][0], m + (j * 8 + l) * 8, 16);
        tc_cp_async_commit();
    }
    tc_cp_async_wait<0>();
    __syncthreads();
    unsigned out[4] = {0, 0, 0, 0};
    const unsigned short* row = &s[l / 8][l % 8][0];
    if (mode == 1) { unsigned o[1]; emu::ldmatrix(o, 1, false, row); out[0] = o[0]; }
    if (mode == 2) { unsigned o[2]; tc_ldmatrix_x2(o, row); out[0] = o[0]; out[1] = o[1]; }
    if (mode == 4) tc_ldmatrix_x4(out, row);
    if (mode == 12) tc_ldmatrix_x4_trans(out, row);
    for (int i = 0; i < 4; ++i) r[4 * l + i] = out[i];
}
// cp.async lands only at the wait that retires its group: v[0] read before any wait, v[1] after wait_group 1 (the
// first of two groups done), v[2] after wait_group 0.
extern "C" __global__ void async_probe(const float* src, float* v) {
    __shared__ __align__(16) float s[8];
    const int l = threadIdx.x;
    if (l == 0) {
        s[0] = -1.0f; s[4] = -1.0f;
        tc_cp_async16(&s[0], src, 16);
        tc_cp_async_commit();
        tc_cp_async16(&s[4], src + 4, 16);
        tc_cp_async_commit();
        v[0] = s[0];
        tc_cp_async_wait<1>();
        v[1] = s[0]; v[3] = s[4];
        tc_cp_async_wait<0>();
        v[2] = s[4];
    }
}
"""


def _pack(lo, hi):
    """Two 16-bit arrays -> the 32-bit registers holding them, low half first."""
    return lo.view(np.uint16).astype(np.uint32) | (hi.view(np.uint16).astype(np.uint32) << 16)


@pytest.mark.parametrize("storage, dtype", [("__half", np.float16), ("__nv_bfloat16", BF16)])
def test_emulated_mma_follows_the_ptx_fragment_layout(rng, storage, dtype):
    A = rng.standard_normal((16, 16)).astype(dtype)
    B = rng.standard_normal((16, 8)).astype(dtype)
    C = rng.standard_normal((16, 8)).astype(F32)
    lane = np.arange(32)
    g, q = lane // 4, lane % 4
    a = np.stack([_pack(A[g, 2 * q], A[g, 2 * q + 1]), _pack(A[g + 8, 2 * q], A[g + 8, 2 * q + 1]),
                  _pack(A[g, 2 * q + 8], A[g, 2 * q + 9]), _pack(A[g + 8, 2 * q + 8], A[g + 8, 2 * q + 9])], 1)
    b = np.stack([_pack(B[2 * q, g], B[2 * q + 1, g]), _pack(B[2 * q + 8, g], B[2 * q + 9, g])], 1)
    c = np.stack([C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]], 1).astype(F32)
    module = emulate.build_source(PRIMITIVES, {"T_STORAGE": storage}, "tc-primitives")
    module.launch("mma_probe", (1,), (32,), np.ascontiguousarray(a), np.ascontiguousarray(b), c)
    D = A.astype(np.float64) @ B.astype(np.float64) + C
    want = np.stack([D[g, 2 * q], D[g, 2 * q + 1], D[g + 8, 2 * q], D[g + 8, 2 * q + 1]], 1)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [1, 2, 4, 12])
def test_emulated_ldmatrix_and_cp_async_follow_the_ptx_layout(rng, mode):
    m = rng.integers(0, 1 << 16, size=(4, 8, 8), dtype=np.uint16)
    r = np.zeros((32, 4), dtype=np.uint32)
    module = emulate.build_source(PRIMITIVES, {"T_STORAGE": "__half"}, "tc-primitives")
    module.launch("ldmatrix_probe", (1,), (32,), m, r, mode)
    lane = np.arange(32)
    count, trans = mode % 8, mode >= 8
    for j in range(4):
        if j >= count:
            assert not r[:, j].any()
            continue
        if trans:
            want = _pack(m[j, 2 * (lane % 4), lane // 4], m[j, 2 * (lane % 4) + 1, lane // 4])
        else:
            want = _pack(m[j, lane // 4, 2 * (lane % 4)], m[j, lane // 4, 2 * (lane % 4) + 1])
        np.testing.assert_array_equal(r[:, j], want)


def test_emulated_cp_async_lands_at_its_wait_group():
    src = np.arange(1, 9, dtype=F32)
    v = np.zeros(4, dtype=F32)
    module = emulate.build_source(PRIMITIVES, {"T_STORAGE": "__half"}, "tc-primitives")
    module.launch("async_probe", (1,), (32,), src, v)
    assert v.tolist() == [-1.0, 1.0, 5.0, -1.0]   # before any wait: old bytes; group 2 only after wait_group 0


def test_emulated_ldmatrix_refuses_a_misaligned_row():
    code = PRIMITIVES + r"""
extern "C" __global__ void misaligned(unsigned* r) {
    __shared__ __align__(16) unsigned short s[80];
    unsigned o[4];
    tc_ldmatrix_x4(o, &s[1 + 8 * (threadIdx.x % 8)]);
    r[threadIdx.x] = o[0];
}
"""
    module = emulate.build_source(code, {"T_STORAGE": "__half"}, "tc-misaligned")
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        module.launch("misaligned", (1,), (32,), np.zeros(32, np.uint32))


# ---- tc_gemm against NumPy ------------------------------------------------------------------------------------
def _poison(shape):
    return np.full(shape, np.nan, dtype=F32)


def reference(x, W, bias=None, norm=None, gamma=None, beta=None, act=None, gated=False, residual=None,
              xsplit=True, dtype=np.float16):
    """The NumPy twin: NumpyOps' norm, linear and epilogue in float32 (XSPLIT=0: x rounded to the weight's 16-bit
    type first, as that variant's mma operand)."""
    if norm == 1:
        x = OPS.rms_norm(x, gamma, 1e-5)
    elif norm == 2:
        x = OPS.layer_norm(x, gamma, beta, 1e-5)
    if not xsplit:
        x = x.astype(dtype).astype(F32)
    y = OPS.linear(x, W, bias)
    y = OPS.gated_activation(y, act) if gated else (OPS.activation(y, act) if act else y)
    return y if residual is None else y + residual


def run_tc_gemm(x, W, defines, splits=1, bias=None, gamma=None, beta=None, residual=None, ldx=None):
    """Launch tc_gemm (and tc_gemm_reduce) on the emulator with the wrapper's geometry -> y [T, ncols] float32."""
    d = {"T_ACT": "float", **defines}
    T, n_in = x.shape
    out = W.shape[0]
    ncols = out // 2 if d.get("GATED") else out
    ldx = ldx or n_in
    xb = np.zeros((T, ldx), F32)
    xb[:, :n_in] = x
    cols = 16 * d.get("WARPS", 4) * d.get("MT", 1)
    y, partial = _poison((T, ncols)), _poison((splits, T, out))
    res = residual if residual is not None else y
    gamma = gamma if gamma is not None else np.ones(n_in, F32)
    beta = beta if beta is not None else gamma
    module = emulate.build("tc_gemm", d)
    module.launch("tc_gemm", (-(-ncols // cols), splits), (32, d.get("WARPS", 4)), xb, gamma, beta, 1e-5,
                  np.ascontiguousarray(W), bias, res, y, partial, T, n_in, out, ldx, ncols, ncols)
    if splits > 1:
        module.launch("tc_gemm_reduce", (-(-T * ncols // 256),), (256,), partial, bias, res, y, T, out, splits,
                      ncols, ncols)
    return y


def _close(got, ref, tol):
    assert np.isfinite(got).all(), "tc_gemm left outputs unwritten (NaN poison) or produced non-finite values"
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)


# (storage, T, n_in, out, defines, splits): token buckets 8 .. 64, row and column tails, several stages and x
# tiles, split-K into whole stages (also an empty last split), 1 to 4 warps, 2 m-tiles a warp.
SLOW = pytest.mark.exhaustive   # a g++ build per define set (~10 s on 2 shared cores): make test-exhaustive
SHAPES = [
    ("__half", 2, 128, 64, {"MAX_TOKENS": 8}, 1),
    pytest.param("__half", 5, 192, 80, {"MAX_TOKENS": 8, "WARPS": 2, "XK": 64}, 1, marks=SLOW),
    pytest.param("__nv_bfloat16", 8, 256, 48, {"MAX_TOKENS": 8, "WARPS": 1, "STAGES": 2}, 2, marks=SLOW),
    pytest.param("__half", 13, 320, 72, {"MAX_TOKENS": 16, "MT": 2, "WARPS": 2, "XK": 128}, 3, marks=SLOW),
    pytest.param("__nv_bfloat16", 32, 112, 40, {"MAX_TOKENS": 32, "WARPS": 2, "XK": 128, "STAGES": 3}, 1,
                 marks=SLOW),
    ("__half", 64, 128, 32, {"MAX_TOKENS": 64, "WARPS": 2, "XK": 64, "STAGES": 2}, 2),
    pytest.param("__half", 3, 208, 16, {"MAX_TOKENS": 8, "WARPS": 1}, 3, marks=SLOW),   # 4 stages, 3 splits: one empty
]


@pytest.mark.parametrize("storage, T, n_in, out, defines, splits", SHAPES)
def test_tc_gemm_matches_numpy(rng, storage, T, n_in, out, defines, splits):
    dtype = np.float16 if storage == "__half" else BF16
    W = (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(dtype)
    x = rng.standard_normal((T, n_in)).astype(F32)
    y = run_tc_gemm(x, W, {"T_STORAGE": storage, **defines}, splits, ldx=n_in + 16)
    _close(y, reference(x, W.astype(F32)), 2e-5)


@pytest.mark.parametrize("storage", ["__half", "__nv_bfloat16"])
@pytest.mark.exhaustive
def test_tc_gemm_without_x_split_rounds_x_once(rng, storage):
    dtype = np.float16 if storage == "__half" else BF16
    T, n_in, out = 6, 192, 48
    W = (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(dtype)
    x = rng.standard_normal((T, n_in)).astype(F32)
    y = run_tc_gemm(x, W, {"T_STORAGE": storage, "XSPLIT": 0, "WARPS": 1})
    _close(y, reference(x, W.astype(F32), xsplit=False, dtype=dtype), 2e-5)
    split_error = np.abs(y - reference(x, W.astype(F32))).max()
    assert split_error > 1e-4        # the rounding of x shows against float32 x: the XSPLIT=1 default keeps it


# (T, defines, splits): bias, every activation, gated with bias, residual, RMSNorm and LayerNorm (+ bias) fused.
EPILOGUES = [
    pytest.param(4, {"HAS_BIAS": 1, "ACT": 1}, 1, marks=SLOW),
    pytest.param(7, {"ACT": 2, "HAS_RESIDUAL": 1}, 2, marks=SLOW),
    (9, {"MAX_TOKENS": 16, "GATED": 1, "ACT": 4, "HAS_BIAS": 1, "STAGES": 2}, 2),
    (3, {"GATED": 1, "ACT": 3, "HAS_RESIDUAL": 1, "NORM": 1, "STAGES": 2}, 1),
    pytest.param(16, {"MAX_TOKENS": 16, "NORM": 2, "HAS_BIAS": 1, "XK": 64}, 1, marks=SLOW),
    pytest.param(5, {"NORM": 2, "NORM_BIAS": 0, "ACT": 4}, 2, marks=SLOW),
]


@pytest.mark.parametrize("T, defines, splits", EPILOGUES)
def test_tc_gemm_prologue_and_epilogues(rng, T, defines, splits):
    n_in, out = 192, 96
    d = {"T_STORAGE": "__half", "WARPS": 2, **defines}
    gated, norm = d.get("GATED", 0), d.get("NORM", 0)
    ncols = out // 2 if gated else out
    W = (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(np.float16)
    x = (3 * rng.standard_normal((T, n_in)) + 1).astype(F32)
    bias = rng.standard_normal(out).astype(F32) if d.get("HAS_BIAS") else None
    residual = rng.standard_normal((T, ncols)).astype(F32) if d.get("HAS_RESIDUAL") else None
    gamma, beta = rng.standard_normal(n_in).astype(F32), rng.standard_normal(n_in).astype(F32)
    norm_beta = beta if norm == 2 and d.get("NORM_BIAS", 1) else None
    y = run_tc_gemm(x, W, d, splits, bias=bias, gamma=gamma, beta=beta,
                    residual=None if residual is None else residual.copy())
    want = reference(x, W.astype(F32), bias, norm, gamma, norm_beta, _ACT.get(d.get("ACT", 0)), bool(gated),
                     residual)
    _close(y, want, 5e-5)


def test_tc_gemm_split_k_is_deterministic(rng):
    # the same inputs, launched again: the same bits (the split sums meet in split order, no atomics)
    T, n_in, out = 11, 512, 64
    W = (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(np.float16)
    x = rng.standard_normal((T, n_in)).astype(F32) * 10
    d = {"T_STORAGE": "__half", "MAX_TOKENS": 16, "WARPS": 2}
    first = run_tc_gemm(x, W, d, splits=4)
    for _ in range(2):
        np.testing.assert_array_equal(run_tc_gemm(x, W, d, splits=4).view(np.uint32), first.view(np.uint32))


def test_tc_gemm_writes_nothing_past_its_token_bucket(rng):
    W = rng.standard_normal((32, 64)).astype(np.float16)
    y = run_tc_gemm(rng.standard_normal((9, 64)).astype(F32), W, {"T_STORAGE": "__half", "MAX_TOKENS": 8})
    assert np.isnan(y).all()


# ---- tc_quant_gemm: int8 / int4 weights dequantized in registers ---------------------------------------------
def run_tc_quant_gemm(x, qt, defines, splits=1, bias=None):
    """Launch tc_quant_gemm (+ reduce) on the emulator on the quant layout of `qt` -> y [T, out] float32."""
    from hpcinfer.kernels.layout import quant_pack

    qp, scale, minimum = quant_pack(qt.q, qt.scale, qt.min)
    groups = scale.shape[0]
    fmt = {"QBITS": qt.bits, "QSIGNED": int(qp.dtype == np.int8), "HAS_MIN": int(qt.min is not None),
           "GROUP": 0 if groups == 1 else qt.group_size}
    d = {"T_STORAGE": "__half", "T_ACT": "float", "HAS_BIAS": int(bias is not None), **fmt, **defines}
    (T, n_in), out = x.shape, qt.shape[0]
    cols = 16 * d.get("WARPS", 4) * d.get("MT", 1)
    y, partial = _poison((T, out)), _poison((splits, T, out))
    module = emulate.build("tc_quant_gemm", d)
    module.launch("tc_quant_gemm", (-(-out // cols), splits), (32, d.get("WARPS", 4)), x, None, None, 0.0,
                  np.ascontiguousarray(qp.view(np.uint8)), scale, minimum if minimum is not None else scale, bias,
                  y, y, partial, T, n_in, out, n_in, out, out)
    if splits > 1:
        module.launch("tc_quant_gemm_reduce", (-(-T * out // 256),), (256,), partial, bias, y, y, T, out, splits,
                      out, out)
    return y


# (mode, group, T, n_in, out, defines, splits): per-channel int8, int4 in groups of 32 / 64, asym8, row and input
# tails, split-K.
QUANT_CASES = [
    pytest.param("int8", 0, 5, 192, 48, {"WARPS": 2}, 1, marks=SLOW),
    pytest.param("int4", 64, 12, 256, 40, {"MAX_TOKENS": 16, "WARPS": 2, "STAGES": 3}, 2, marks=SLOW),
    ("int4", 32, 3, 224, 33, {"WARPS": 1}, 3),     # 7 vectors a row: the last stage's second one zero-filled
    pytest.param("asym8", 32, 33, 128, 64, {"MAX_TOKENS": 64, "WARPS": 2, "XK": 64, "STAGES": 2}, 1, marks=SLOW),
]


@pytest.mark.parametrize("mode, group, T, n_in, out, defines, splits", QUANT_CASES)
def test_tc_quant_gemm_matches_numpy(rng, mode, group, T, n_in, out, defines, splits):
    from hpcinfer.quant.formats import quantize

    qt = quantize((rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(F32), mode, group or 64)
    x = rng.standard_normal((T, n_in)).astype(F32)
    bias = rng.standard_normal(out).astype(F32)
    y = run_tc_quant_gemm(x, qt, defines, splits, bias)
    # integer q in the mma, scale (and min) applied per group in float32: no weight is rounded
    _close(y, OPS.linear_q(x, qt, bias), 2e-5)
