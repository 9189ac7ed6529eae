"""The SBI GEMV's row tiling (TILING=1, cuda_src/sbi_core.cuh) on the CPU emulator against NumPy, kernel by kernel.

Each case launches sbi_gemv / fused_norm_gemv (and the *_reduce kernel when split) with its defines as given, so
that the shapes can reach what the wrapper's plan rarely makes in a small test: several staged x tiles (X_TILE
smaller than the row: norm statistics read from global memory), input splits (one of them empty), a tail of
vectors in every lane pass (in not a multiple of 32 vectors), column tails (out not a multiple of WARPS * RW),
T below its bucket. Outputs start as NaN, so an element left unwritten fails. Then every define set that
backend/cupy_sbi.plan emits for the row tiling compiles with NVRTC for sm_90 and sm_80.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hpcinfer.backend import cupy_sbi
from hpcinfer.backend.interface import NormParams
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.kernels import loader
import kernel_emulator as emulate

F32 = np.float32
OPS = NumpyOps()
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
_NP = {"float": np.float32, "__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}
_ACT_NAMES = {1: "gelu", 2: "gelu_tanh", 3: "relu", 4: "silu"}

ROW_CASES = [
    # storage, act_t, T, in, out (weight rows), defines beyond TILING=1 / W_ROWMAJOR=1, splits
    ("float", "float", 1, 132, 37, {"MAX_TOKENS": 1, "UNROLL": 8}, 1),                      # 33 vectors: a tail
    ("__half", "float", 3, 200, 37, {"MAX_TOKENS": 4, "RW": 2, "WARPS": 2, "UNROLL": 2, "HAS_BIAS": 1,
                                     "ACT": 1}, 1),                                           # 25 vectors < 32
    ("__nv_bfloat16", "float", 4, 1040, 21, {"MAX_TOKENS": 4, "RW": 2, "WARPS": 3, "UNROLL": 2, "X_TILE": 512,
                                             "HAS_RESIDUAL": 1}, 1),                          # tiles of 64, 64, 2
    ("__half", "float", 16, 264, 38, {"MAX_TOKENS": 16, "RW": 2, "WARPS": 2, "UNROLL": 2, "GATED": 1, "ACT": 4,
                                      "HAS_BIAS": 1}, 1),                                     # 19 columns of 4
    ("float", "float", 3, 200, 30, {"MAX_TOKENS": 16, "RW": 3, "WARPS": 2, "UNROLL": 1, "HAS_RESIDUAL": 1}, 1),
    ("__half", "float", 3, 136, 30, {"MAX_TOKENS": 4, "NORM": 1, "RW": 2, "WARPS": 2, "UNROLL": 1}, 1),
    ("__nv_bfloat16", "float", 1, 520, 26, {"MAX_TOKENS": 1, "NORM": 1, "GATED": 1, "ACT": 4, "WARPS": 2,
                                            "UNROLL": 1, "X_TILE": 256, "HAS_RESIDUAL": 1}, 1),  # 3 tiles
    ("float", "float", 4, 256, 24, {"MAX_TOKENS": 4, "NORM": 2, "HAS_BIAS": 1, "ACT": 2, "UNROLL": 1}, 2),
    ("__half", "float", 16, 392, 10, {"MAX_TOKENS": 16, "NORM": 2, "NORM_BIAS": 0, "ACT": 3, "RW": 2,
                                      "WARPS": 2, "UNROLL": 1, "X_TILE": 256, "X_VEC": 0, "HAS_RESIDUAL": 1}, 3),
    ("__half", "float", 3, 1024, 18, {"MAX_TOKENS": 4, "RW": 2, "WARPS": 3, "UNROLL": 2, "GATED": 1, "ACT": 1,
                                      "HAS_BIAS": 1, "HAS_RESIDUAL": 1}, 2),                  # split, gated
    ("__half", "__nv_bfloat16", 3, 96, 20, {"MAX_TOKENS": 4, "RW": 2, "WARPS": 2, "UNROLL": 4, "HAS_BIAS": 1,
                                            "HAS_RESIDUAL": 1}, 1),                           # bf16 activations
    ("float", "float", 1, 64, 9, {"MAX_TOKENS": 2, "NORM": 2, "X_VEC": 0}, 1),               # T below bucket
]


def _reference(x, W, gamma, beta, bias, residual, d):
    """NumpyOps.fused_linear (the unfused sequence, tests/backend/test_sbi_wiring.py) for the defines `d`."""
    kind = {1: "rmsnorm", 2: "layernorm"}.get(d.get("NORM", 0))
    norm = None if kind is None else NormParams(kind, gamma, beta if kind == "layernorm" and d.get("NORM_BIAS", 1)
                                                else None, 1e-5)
    return OPS.fused_linear(x, W, bias, norm=norm, act=_ACT_NAMES.get(d.get("ACT", 0)), gated=bool(d.get("GATED")),
                            residual=None if residual is None else residual.astype(F32))


@pytest.mark.parametrize("storage, act_t, T, n_in, out, defines, splits", ROW_CASES)
@needs_emulator
@pytest.mark.slow
def test_row_tiling_matches_numpy_on_the_emulator(storage, act_t, T, n_in, out, defines, splits):
    rng = np.random.default_rng(T * 7919 + n_in * 31 + out)
    d = {"T_STORAGE": storage, "T_ACT": act_t, "TILING": 1, "W_ROWMAJOR": 1, **defines}
    dt, at = _NP[storage], _NP[act_t]
    norm, gated = d.get("NORM", 0), d.get("GATED", 0)
    ncols = out // 2 if gated else out
    ldx = n_in + (8 if d.get("X_VEC", 1) else 3)                 # X_VEC=0: rows 3 elements apart of alignment
    W = (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(dt)
    xb = (rng.standard_normal((T, ldx)) + (0.5 if norm == 2 else 0.0)).astype(at)
    bias = rng.standard_normal(out).astype(F32) if d.get("HAS_BIAS") else None
    residual = rng.standard_normal((T, ncols)).astype(at) if d.get("HAS_RESIDUAL") else None
    gamma, beta = (1 + 0.2 * rng.standard_normal(n_in)).astype(F32), rng.standard_normal(n_in).astype(F32)
    ref = _reference(xb[:, :n_in].astype(F32), W, gamma, beta, bias, residual, d)

    y, partial = np.full((T, ncols), np.nan, at), np.full((splits, T, out), np.nan, F32)
    res = residual if residual is not None else y
    name = "fused_norm_gemv" if norm else "sbi_gemv"
    module = emulate.build(name, d)
    warps, rw = d.get("WARPS", 4), d.get("RW", 1)
    grid, block = (-(-ncols // (warps * rw)), splits), (32, warps)
    head = (xb, gamma, beta, 1e-5) if norm else (xb,)
    module.launch(name, grid, block, *head, W, bias, res, y, partial, T, n_in, out, ldx, ncols, ncols)
    if splits > 1:
        assert np.isfinite(partial[:, :, :ncols * (2 if gated else 1)]).all()   # every split wrote its sums
        module.launch(f"{name}_reduce", (-(-T * ncols // 256),), (256,), partial, bias, res, y, T, out, splits,
                      ncols, ncols)
    got = y.astype(np.float64)
    assert np.isfinite(got).all(), "the kernel left outputs unwritten (NaN poison)"
    tol = 2e-5 if act_t == "float" else 2e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_cases_cover_the_brief():
    """The matrix above: T 1, 3, 4, 16; every weight type; tails; gated, bias, residual, both norms; splits."""
    Ts = {c[2] for c in ROW_CASES}
    assert {1, 3, 4, 16} <= Ts and {c[0] for c in ROW_CASES} == set(_NP)
    assert any(c[3] // (16 // {"float": 4}.get(c[0], 2)) % 32 for c in ROW_CASES)          # vector tails
    d = [c[5] for c in ROW_CASES]
    assert {x.get("NORM", 0) for x in d} == {0, 1, 2} and any(x.get("GATED") for x in d)
    assert any(x.get("HAS_BIAS") for x in d) and any(x.get("HAS_RESIDUAL") for x in d)
    assert max(c[6] for c in ROW_CASES) == 3 and any(x.get("X_TILE", 1 << 30) < c[3] for c, x in zip(ROW_CASES, d))


# ---- NVRTC: every define set plan emits for the row tiling ---------------------------------------------------
def _nvrtc_unavailable() -> str | None:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:   # noqa: BLE001 - cupy absent, or libnvrtc not found
        return f"NVRTC unavailable ({type(exc).__name__}: {exc})"
    return None


NVRTC_SKIP = _nvrtc_unavailable()


def _planned():
    cases = []
    for tokens in cupy_sbi.TOKEN_BUCKETS:
        for dtype in (np.float32, np.float16, np.uint16):
            for n_in in (1600, 14336):
                for norm, act, gated in ((None, None, False), ("rmsnorm", "silu", True), ("layernorm", "gelu", False)):
                    launch = cupy_sbi.plan(tokens, n_in, 2 * 4096, dtype, 132, norm=norm, norm_bias=True, act=act,
                                           gated=gated, has_bias=True, has_residual=True)
                    cases.append(pytest.param(launch.name, launch.defines,
                                              id=f"T{tokens}-{np.dtype(dtype).name}-{n_in}-{norm}"))
    # beyond plan: half activations, element-wise x, 3 rows per warp, a forced 8-warp block
    for i, extra in enumerate(({"T_ACT": "__half", "MAX_TOKENS": 4, "RW": 3, "X_VEC": 0, "HAS_RESIDUAL": 1},
                               {"T_ACT": "__nv_bfloat16", "MAX_TOKENS": 8, "WARPS": 8, "RW": 2, "UNROLL": 2,
                                "GATED": 1, "ACT": 4},
                               {"T_ACT": "float", "MAX_TOKENS": 2, "NORM": 2, "NORM_BIAS": 0, "UNROLL": 1})):
        name = "fused_norm_gemv" if "NORM" in extra else "sbi_gemv"
        defines = {"T_STORAGE": "__half", "TILING": 1, "W_ROWMAJOR": 1, **extra}
        cases.append(pytest.param(name, defines, id=f"extra{i}"))
    return cases


@pytest.mark.skipif(NVRTC_SKIP is not None, reason=NVRTC_SKIP or "")
@pytest.mark.parametrize("name, defines", _planned())
def test_planned_row_variants_compile(name, defines):
    loader.compile_check(name, defines, "sm_90")
    if defines["MAX_TOKENS"] == 16 and defines["T_STORAGE"] == "__half":
        loader.compile_check(name, defines, "sm_80")
