"""The CUDA kernels with no GPU.

1. Every kernel file compiles: NVRTC (the compiler cupy.RawModule uses, through cupy's low-level bindings) for sm_90
   and sm_80 in every storage type and the main #define variants, and nvcc where it is on the PATH.
2. The GPU-free parts of hpcinfer.kernels: the kernel registry, source inlining, #define options, the SBI layout.
3. Every kernel runs on the CPU emulator (tests/helpers/kernel_emulator.py) against its NumPy twin (marked slow).

The GPU parity tests of the CuPy backend (each op against NumPy on a device) are elsewhere and skip without a GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from hpcinfer.kernels import layout, loader
from hpcinfer.kernels.loader import CUDA_SRC, KERNELS

TYPES = ("float", "__half", "__nv_bfloat16")
STORAGE_TYPES = {"tc_gemm": TYPES[1:], "tc_quant_gemm": TYPES[1:]}   # the tensor-core kernels' 16-bit mma types


def _nvrtc_unavailable() -> str | None:
    """Why NVRTC cannot be used here (None when it can)."""
    try:
        from cupy.cuda import nvrtc
    except Exception as exc:   # noqa: BLE001 - cupy absent, or a broken install
        return f"cupy's NVRTC bindings cannot be imported ({type(exc).__name__}: {exc}); install the cuda-check extra"
    try:
        nvrtc.getVersion()
    except Exception as exc:   # noqa: BLE001 - libnvrtc not found
        return (f"libnvrtc cannot be loaded ({type(exc).__name__}: {exc}); install nvidia-cuda-nvrtc-cu12 "
                "(the cuda-check extra)")
    return None


NVRTC_SKIP = _nvrtc_unavailable()
needs_nvrtc = pytest.mark.skipif(NVRTC_SKIP is not None, reason=NVRTC_SKIP or "")
needs_nvcc = pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc is not on the PATH")


# ---- the matrix ------------------------------------------------------------------------------------------------
# Variants beyond the defaults: the options the wrappers will use (epilogues, token buckets, gated MLP, norms, big
# head dims), each compiled in half precision at sm_90; the compile-time shared-memory asserts are checked with them.
VARIANTS: dict[str, list[dict]] = {
    "rms_norm": [{"BLOCK": 128, "T_ACT": "float"}],
    "layer_norm": [{"HAS_BIAS": 0, "BLOCK": 512}],
    "activation": [{"ACT": a} for a in (1, 2, 3)],
    "embedding": [{"T_ACT": "float"}],
    "rotary": [{"T_ACT": "float", "BLOCK": 256}],
    "kv_append": [{"T_ACT": "float"}],
    # decode kernels: as backend/cupy_decode.decode_defines emits them (exact HEAD_DIM and GROUP), the edges of
    # the shared-memory assert, a head dim the 16-byte vectors do not divide evenly among the lanes (80)
    "paged_attention": [{"T_ACT": "float", "HEAD_DIM": 64, "GROUP": 3}, {"HEAD_DIM": 256, "GROUP": 8},
                        {"HEAD_DIM": 80, "GROUP": 4, "NWARPS": 8}, {"T_ACT": "float", "BLOCK": 256}],
    "decode_attention": [{"HEAD_DIM": 256, "GROUP": 8}, {"HEAD_DIM": 64, "GROUP": 3, "NWARPS": 8},
                         {"T_ACT": "float", "HEAD_DIM": 80, "GROUP": 1}, {"T_ACT": "float", "HEAD_DIM": 128,
                                                                          "GROUP": 4}],
    "decode_attention_quant": [{"KV_BITS": 4}, {"KV_BITS": 4, "HEAD_DIM": 64, "GROUP": 8, "NWARPS": 8},
                               {"KV_BITS": 8, "T_ACT": "float", "HEAD_DIM": 80, "GROUP": 3}],
    "kv_quant": [{"KV_BITS": 4}, {"KV_BITS": 8, "T_ACT": "float", "BLOCK": 256}],
    "prefill_attention": [{"MAX_HEAD_DIM": 256, "ROWS_PER_WARP": 2, "KT": 16}, {"NWARPS": 8, "ROWS_PER_WARP": 2},
                          {"T_ACT": "float", "KT": 8}, {"CAUSAL": 0}],
    "sbi_gemv": [{"MAX_TOKENS": 4, "HAS_BIAS": 1, "ACT": 1}, {"MAX_TOKENS": 16, "WARPS": 8, "HAS_RESIDUAL": 1},
                 {"MAX_TOKENS": 8, "GATED": 1, "ACT": 4, "HAS_BIAS": 1, "ROWS": 2},
                 {"MAX_TOKENS": 2, "X_VEC": 0, "ACT": 2, "UNROLL": 8}, {"T_ACT": "float", "ACT": 3},
                 {"MAX_TOKENS": 4, "W_ROWMAJOR": 1},
                 # as backend/cupy_sbi.plan emits them: float activations, row-major weights
                 {"T_ACT": "float", "W_ROWMAJOR": 1, "MAX_TOKENS": 16, "HAS_BIAS": 1, "HAS_RESIDUAL": 1, "X_VEC": 0},
                 {"T_ACT": "float", "W_ROWMAJOR": 1, "MAX_TOKENS": 1, "ACT": 2, "HAS_BIAS": 1}],
    "fused_norm_gemv": [{"NORM": 2, "MAX_TOKENS": 4, "HAS_BIAS": 1}, {"NORM": 2, "NORM_BIAS": 0, "ACT": 1},
                        {"NORM": 1, "GATED": 1, "ACT": 4, "MAX_TOKENS": 16}, {"NORM": 1, "T_ACT": "float"},
                        {"NORM": 1, "W_ROWMAJOR": 1},
                        {"NORM": 1, "NORM_BIAS": 0, "GATED": 1, "ACT": 4, "T_ACT": "float", "W_ROWMAJOR": 1,
                         "MAX_TOKENS": 8, "HAS_RESIDUAL": 1},
                        {"NORM": 2, "NORM_BIAS": 1, "ACT": 1, "HAS_BIAS": 1, "T_ACT": "float", "W_ROWMAJOR": 1,
                         "MAX_TOKENS": 2}],
    "quant_gemv": [{"QBITS": 4, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 64, "MAX_TOKENS": 16, "HAS_BIAS": 1},
                   {"QBITS": 4, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 32, "T_ACT": "float", "X_VEC": 0},
                   {"QBITS": 8, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 128, "MAX_TOKENS": 4, "ROWS": 2},
                   {"QBITS": 8, "QSIGNED": 1, "GROUP": 32, "WARPS": 8, "UNROLL": 2, "T_ACT": "float"}],
    "tc_gemm": [{"T_ACT": "float", "MAX_TOKENS": 64, "XK": 64, "STAGES": 3},
                {"T_ACT": "float", "MAX_TOKENS": 16, "GATED": 1, "ACT": 4, "HAS_BIAS": 1, "NORM": 1, "STAGES": 2,
                 "XK": 128},
                {"T_ACT": "float", "MAX_TOKENS": 32, "NORM": 2, "HAS_RESIDUAL": 1, "ACT": 1, "XSPLIT": 0,
                 "WARPS": 8, "STAGES": 2, "XK": 64},
                {"T_ACT": "float", "MAX_TOKENS": 8, "MT": 2, "WARPS": 2, "XK": 256}],
    "tc_quant_gemm": [{"T_ACT": "float", "QBITS": 4, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 64, "MAX_TOKENS": 64,
                       "XK": 64, "STAGES": 3, "HAS_BIAS": 1},
                      {"T_ACT": "float", "QBITS": 8, "QSIGNED": 1, "GROUP": 0, "MAX_TOKENS": 16, "XK": 192},
                      {"T_ACT": "float", "QBITS": 8, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 32, "MAX_TOKENS": 8,
                       "XSPLIT": 0, "WARPS": 8, "STAGES": 2}],
    "quant_dequant": [{"QBITS": 4, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 64, "T_ACT": "float"},
                      {"QBITS": 8, "QSIGNED": 0, "HAS_MIN": 1, "GROUP": 32}, {"QBITS": 8, "BLOCK": 128}],
    "moe_gating": [{"MAX_EXPERTS": 1024, "ROUTE_BLOCK": 256, "PERMUTE": 0}, {"T_ACT": "float", "CHUNK": 512}],
}


def _cases():
    cases = []
    for name in sorted(KERNELS):
        for t in STORAGE_TYPES.get(name, TYPES):
            cases.append(pytest.param(name, {"T_STORAGE": t}, "sm_90", id=f"{name}-{t}-sm_90"))
        cases.append(pytest.param(name, {"T_STORAGE": "__half"}, "sm_80", id=f"{name}-__half-sm_80"))
        for i, extra in enumerate(VARIANTS.get(name, [])):
            cases.append(pytest.param(name, {"T_STORAGE": "__half", **extra}, "sm_90", id=f"{name}-v{i}-sm_90"))
    # PTX for a virtual architecture (what RawModule builds when the driver is older than NVRTC)
    for name in ("sbi_gemv", "decode_attention"):
        cases.append(pytest.param(name, {"T_STORAGE": "__nv_bfloat16"}, "compute_80", id=f"{name}-bf16-compute_80"))
    return cases


@needs_nvrtc
@pytest.mark.parametrize("name, defines, arch", _cases())
def test_nvrtc_compiles(name, defines, arch):
    loader.compile_check(name, defines, arch)


@needs_nvrtc
def test_nvrtc_reports_errors_with_the_log():
    # a static_assert of the kernel itself: too much shared memory for the 48 KiB a static allocation may take
    with pytest.raises(loader.KernelCompileError, match="shared memory"):
        loader.compile_check("prefill_attention", {"MAX_HEAD_DIM": 256}, "sm_90")


@needs_nvrtc
def test_nvrtc_finds_matching_cuda_headers():
    major = loader.nvrtc_version()[0]
    dirs = loader.cuda_include_dirs(major)
    assert dirs, f"no cuda_fp16.h for NVRTC {major} (install nvidia-cuda-runtime-cu{major})"


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_nvcc_compiles(name, arch):
    loader.nvcc_check(CUDA_SRC / f"{name}.cu", arch, {"T_STORAGE": "__half"})


# ---- the GPU-free parts of hpcinfer.kernels -------------------------------------------------------------------
def test_registry_matches_the_sources():
    files = {p.stem for p in CUDA_SRC.glob("*.cu")}
    assert files == set(KERNELS)
    for name, functions in KERNELS.items():
        text = loader.kernel_source(name)
        defined = set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(',
                                 text))
        assert defined == set(functions), name


def test_kernel_source_inlines_local_headers():
    text = loader.kernel_source("fused_norm_gemv")
    assert not re.search(r'^\s*#\s*include\s*"', text, re.M)   # sbi_core.cuh and common.cuh pasted in, once each
    assert text.count("// ---- begin common.cuh") == 1
    assert "sbi_body" in text and "#include <cuda_fp16.h>" in text


def test_define_options():
    assert loader.define_options({"T_STORAGE": "__half", "HAS_BIAS": True, "X": None, "A": 3}) == [
        "-DA=3", "-DHAS_BIAS=1", "-DT_STORAGE=__half", "-DX"]
    with pytest.raises(ValueError):
        loader.define_options({"BAD NAME": 1})
    with pytest.raises(ValueError):
        loader.define_options({"X": "a b"})


def test_kernels_package_imports_without_cupy():
    code = "import sys; sys.modules['cupy'] = None; import hpcinfer.kernels as k; print(len(k.KERNELS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_in", [64, 70, 3])
def test_sbi_layout_round_trip(dtype, n_in):
    w = np.random.default_rng(0).standard_normal((5, n_in)).astype(dtype)
    packed = layout.sbi_pack(w)
    vec = layout.sbi_vec(dtype)
    assert packed.shape == (-(-n_in // vec), 5, vec) and packed.flags.c_contiguous
    assert packed.strides[1] == 16                     # one 16-byte vector per (kv, column)
    assert np.array_equal(packed[0, 2, 1], w[2, 1])
    assert np.array_equal(layout.sbi_unpack(packed, n_in), w)
    assert not packed[-1, :, n_in - (packed.shape[0] - 1) * vec:].any()   # zero padding past `in`


# ---- the kernels run on the CPU emulator against their NumPy twins ---------------------------------------------
# tests/helpers/kernel_emulator.py runs each kernel with one std::thread per CUDA thread: indexing, tails, masking, the
# reductions and the epilogues are checked here, before any GPU time (speed and memory races are the GPU's tests).
# Marked slow: ~80 s the first time (a g++ build per variant, cached under build/kernel-emu/), ~30 s after.
from hpcinfer.backend import moe_ops                      # noqa: E402
from hpcinfer.backend.interface import StepLayout         # noqa: E402
from hpcinfer.backend.numpy_ops import NumpyOps           # noqa: E402
import kernel_emulator as emulate  # noqa: E402

EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
F32 = np.float32
OPS = NumpyOps()


def _np_type(c_type):
    import ml_dtypes

    return {"float": np.float32, "__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}[c_type]


def _poison(shape, dtype=F32):
    """Outputs start as NaN (or -7 for integers), so that an element the kernel does not write fails the test."""
    return np.full(shape, -7 if np.dtype(dtype).kind == "i" else np.nan, dtype=dtype)


def _close(got, ref, tol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "the kernel left elements unwritten (NaN poison) or produced non-finite values"
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)


@pytest.fixture
def rng():
    return np.random.default_rng()                      # fresh inputs every run


@pytest.mark.parametrize("storage", ["float", "__half"])
@pytest.mark.parametrize("kind", ["rms", "layer", "layer_nobias"])
@needs_emulator
@pytest.mark.slow
def test_emulated_norms(rng, storage, kind):
    dt, T, D, ld = _np_type(storage), 3, 200, 210
    xb = rng.standard_normal((T, ld)).astype(dt)
    w, b = rng.standard_normal(D).astype(F32), rng.standard_normal(D).astype(F32)
    y = _poison((T, D), dt)
    x = xb[:, :D].astype(F32)
    if kind == "rms":
        emulate.build("rms_norm", {"T_STORAGE": storage, "BLOCK": 64}).launch(
            "rms_norm", (T,), (64,), xb, w, y, D, ld, D, 1e-5)
        ref = OPS.rms_norm(x, w, 1e-5)
    else:
        has_bias = kind == "layer"
        emulate.build("layer_norm", {"T_STORAGE": storage, "BLOCK": 96, "HAS_BIAS": int(has_bias)}).launch(
            "layer_norm", (T,), (96,), xb, w, b, y, D, ld, D, 1e-5)
        ref = OPS.layer_norm(x, w, b if has_bias else None, 1e-5)
    _close(y.astype(F32), ref.astype(dt).astype(F32), 1e-5 if storage == "float" else 1e-2)


@pytest.mark.parametrize("code, kind", [(1, "gelu"), (2, "gelu_tanh"), (3, "relu"), (4, "silu")])
@needs_emulator
@pytest.mark.slow
def test_emulated_activations(rng, code, kind):
    module = emulate.build("activation", {"T_STORAGE": "float", "ACT": code, "BLOCK": 64})
    x = (rng.standard_normal((5, 37)) * 3).astype(F32)
    y = _poison(x.shape)
    module.launch("activation", (2,), (64,), x, y, x.size)         # 2 blocks of 64 < 185 elements: grid-stride
    _close(y, OPS.activation(x, kind), 2e-6)
    T, F = 4, 45
    gate_up = (rng.standard_normal((T, 2 * F + 3)) * 2).astype(F32)  # rows 2F + 3 apart
    y = _poison((T, F))
    module.launch("gated_activation", (3,), (64,), gate_up, y, T, F, 2 * F + 3, F)
    _close(y, OPS.gated_activation(np.ascontiguousarray(gate_up[:, :2 * F]), kind), 2e-6)


@needs_emulator
@pytest.mark.slow
def test_emulated_embedding_vocab_parallel(rng):
    V, D, start, rows = 50, 70, 10, 20                  # this rank holds rows 10 .. 29
    table = rng.standard_normal((V, D)).astype(np.float16)
    ids = np.array([3, 49, 0, 17, 60, -1, 25, 10, 29, 30], np.int64)
    out = _poison((len(ids), D))
    emulate.build("embedding", {"T_STORAGE": "__half", "T_ACT": "float", "BLOCK": 32}).launch(
        "embedding", (len(ids),), (32,), table[start:start + rows].copy(), ids, out, len(ids), D, start, rows, D)
    mine = (ids >= start) & (ids < start + rows)
    ref = np.zeros((len(ids), D), F32)
    ref[mine] = OPS.embedding(table, ids[mine])
    _close(out, ref, 0)


@needs_emulator
@pytest.mark.slow
def test_emulated_rotary(rng):
    T, H, Hkv, hd, rd = 4, 3, 1, 16, 12                 # partial rotary, q and k heads read from inside qkv
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(F32)
    angles = rng.standard_normal((T, rd // 2)).astype(F32)
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    ref = OPS.rotary(qkv[:, :(H + Hkv) * hd].reshape(T, H + Hkv, hd), cos, sin, rd)
    module = emulate.build("rotary", {"T_STORAGE": "float", "BLOCK": 32})
    y = _poison((T, H + Hkv, hd))
    module.launch("rotary", (T,), (32,), qkv, cos, sin, y, H + Hkv, hd, rd, qkv.shape[1], (H + Hkv) * hd)
    _close(y, ref, 1e-6)
    inplace = qkv.copy()
    module.launch("rotary", (T,), (32,), inplace, cos, sin, inplace, H + Hkv, hd, rd, qkv.shape[1], qkv.shape[1])
    _close(inplace[:, :(H + Hkv) * hd].reshape(T, H + Hkv, hd), ref, 1e-6)
    _close(inplace[:, (H + Hkv) * hd:], qkv[:, (H + Hkv) * hd:], 0)   # v untouched


ATTENTION_CASES = [
    # storage, H, Hkv, hd, starts, counts, slots, defines
    ("float", 6, 2, 32, [0, 5, 30], [7, 1, 12], [4, 0, 2], {}),                       # prefill, GQA, mixed lengths
    ("__half", 6, 2, 64, [0, 5, 30], [7, 1, 12], [4, 0, 2], {"NWARPS": 2, "ROWS_PER_WARP": 3, "KT": 16}),
    ("float", 4, 4, 40, [3, 0], [40, 33], [1, 3], {}),                                # MHA, hd % 32 != 0, 3 q-tiles
    ("float", 8, 1, 32, [0], [9], [0], {}),                                          # MQA: 2 tokens per block
    ("float", 6, 2, 32, [0, 5, 70, 2], [1, 1, 1, 1], [4, 0, 2, 3], {}),               # decode, length 1 < NWARPS
    ("__half", 9, 3, 64, [0, 50, 7], [1, 1, 1], [2, 1, 0], {"NWARPS": 8}),           # decode, SmolLM2's heads
    ("__nv_bfloat16", 8, 8, 128, [10, 3], [1, 1], [1, 0], {"NWARPS": 2}),
]


@pytest.mark.parametrize("storage, H, Hkv, hd, starts, counts, slots, defines", ATTENTION_CASES)
@needs_emulator
@pytest.mark.slow
def test_emulated_attention(rng, storage, H, Hkv, hd, starts, counts, slots, defines):
    dt, N, Lmax = _np_type(storage), 5, 80
    step = StepLayout.build(slots, starts, counts)
    T = step.num_tokens
    cache_k = rng.standard_normal((N, Hkv, Lmax, hd)).astype(dt)
    cache_v = rng.standard_normal((N, Hkv, Lmax, hd)).astype(dt)
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(F32)
    ld, scale = qkv.shape[1], 1.0 / np.sqrt(hd)
    q = qkv[:, :H * hd].reshape(T, H, hd)
    k = qkv[:, H * hd:(H + Hkv) * hd].reshape(T, Hkv, hd)
    v = qkv[:, (H + Hkv) * hd:].reshape(T, Hkv, hd)
    ref_k, ref_v = cache_k.copy(), cache_v.copy()
    ref = OPS.attention(q, k, v, ref_k, ref_v, step, scale)

    slots_, starts_, offsets = (np.asarray(a, np.int64) for a in (slots, starts, step.offsets))
    out = _poison((T, H * hd))
    types = {"T_STORAGE": storage, "T_ACT": "float"}
    if step.is_decode:
        d = {**types, "HEAD_DIM": hd, "GROUP": H // Hkv, **defines}
        emulate.build("decode_attention", d).launch(
            "decode_attention", (Hkv, len(slots)), (32, d.get("NWARPS", 4)), qkv, qkv[:, H * hd:],
            qkv[:, (H + Hkv) * hd:], cache_k, cache_v, slots_, starts_, None, None, 0, out, None, None, H, Hkv, hd,
            Lmax, ld, ld, ld, H * hd, scale)
    else:
        k_rows, v_rows = np.ascontiguousarray(qkv[:, H * hd:]), np.ascontiguousarray(qkv[:, (H + Hkv) * hd:])
        emulate.build("kv_append", {**types, "BLOCK": 64}).launch(
            "kv_append", (max(counts), len(slots)), (64,), k_rows, v_rows, cache_k, cache_v, slots_, starts_,
            offsets, Hkv, hd, Lmax, k_rows.shape[1], v_rows.shape[1])
        d = {**types, **defines}
        tokens_per_block = d.get("NWARPS", 4) * d.get("ROWS_PER_WARP", 4) // (H // Hkv)
        emulate.build("prefill_attention", d).launch(
            "prefill_attention", (Hkv, -(-max(counts) // tokens_per_block), len(slots)), (32, d.get("NWARPS", 4)),
            qkv, cache_k, cache_v, slots_, starts_, offsets, out, H, Hkv, hd, Lmax, ld, H * hd, scale)
    _close(out, ref, 2e-5 if storage == "float" else 2e-3)
    _close(cache_k.astype(F32), ref_k.astype(F32), 0)
    _close(cache_v.astype(F32), ref_v.astype(F32), 0)


@pytest.mark.parametrize("H, Hkv, hd, counts", [(4, 4, 32, [7, 1, 12]), (6, 2, 40, [33, 5]), (8, 1, 32, [9])])
@needs_emulator
@pytest.mark.slow
def test_emulated_bidirectional_attention(rng, H, Hkv, hd, counts):
    """prefill_attention with CAUSAL=0 over a scratch cache filled by kv_append == the encoder's attention op."""
    S, L = len(counts), max(counts)
    step = StepLayout.build(np.arange(S), np.zeros(S), counts)
    T = step.num_tokens
    q, k, v = (rng.standard_normal((T, h, hd)).astype(F32) for h in (H, Hkv, Hkv))
    scale = 1.0 / np.sqrt(hd)
    ref = OPS.bidirectional_attention(q, np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1), step, scale)
    cache_k, cache_v = (np.full((S, Hkv, L, hd), np.nan, dtype=F32) for _ in range(2))
    zeros, slots = np.zeros(S, np.int64), np.arange(S, dtype=np.int64)
    offsets = np.asarray(step.offsets, np.int64)
    k_rows, v_rows = k.reshape(T, Hkv * hd), v.reshape(T, Hkv * hd)
    emulate.build("kv_append", {"T_STORAGE": "float", "BLOCK": 64}).launch(
        "kv_append", (L, S), (64,), k_rows, v_rows, cache_k, cache_v, slots, zeros, offsets, Hkv, hd, L, Hkv * hd,
        Hkv * hd)
    out = _poison((T, H * hd))
    per_block = 16 // (H // Hkv)
    emulate.build("prefill_attention", {"T_STORAGE": "float", "CAUSAL": 0}).launch(
        "prefill_attention", (Hkv, -(-L // per_block), S), (32, 4), q.reshape(T, H * hd), cache_k, cache_v, slots,
        zeros, offsets, out, H, Hkv, hd, L, H * hd, H * hd, scale)
    _close(out, ref, 2e-5)


GEMV_CASES = [
    # storage, act_t, T, in, out, defines, options
    ("float", "float", 1, 64, 40, {}, {}),
    ("__half", "float", 3, 200, 70, {"MAX_TOKENS": 4, "WARPS": 3, "UNROLL": 2}, {}),
    ("__half", "float", 5, 203, 70, {"MAX_TOKENS": 8, "ROWS": 2, "X_VEC": 0}, {}),          # in % VEC != 0
    ("__nv_bfloat16", "__nv_bfloat16", 4, 512, 96, {"MAX_TOKENS": 4, "HAS_BIAS": 1, "ACT": 1}, {}),
    ("__half", "float", 2, 256, 66, {"MAX_TOKENS": 2, "HAS_BIAS": 1, "HAS_RESIDUAL": 1}, {"splits": 3}),
    ("__half", "float", 3, 128, 100, {"MAX_TOKENS": 4, "ROWS": 2, "GATED": 1, "ACT": 4, "HAS_BIAS": 1}, {}),
    ("float", "float", 16, 96, 33, {"MAX_TOKENS": 16, "WARPS": 8, "ACT": 3, "HAS_RESIDUAL": 1}, {}),
    ("__half", "float", 2, 200, 70, {"MAX_TOKENS": 2, "NORM": 1}, {}),
    ("__half", "float", 3, 200, 70, {"MAX_TOKENS": 4, "NORM": 2, "HAS_BIAS": 1}, {}),
    ("__half", "float", 3, 131, 80, {"MAX_TOKENS": 4, "NORM": 1, "GATED": 1, "ACT": 4, "X_VEC": 0}, {"splits": 2}),
    ("float", "float", 1, 96, 50, {"NORM": 2, "NORM_BIAS": 0, "ACT": 2}, {}),
    ("__half", "float", 3, 200, 70, {"MAX_TOKENS": 4, "W_ROWMAJOR": 1, "UNROLL": 2}, {"splits": 2}),
    ("__nv_bfloat16", "float", 2, 64, 100, {"MAX_TOKENS": 2, "NORM": 1, "GATED": 1, "ACT": 4, "W_ROWMAJOR": 1}, {}),
]
_ACT_NAMES = {1: "gelu", 2: "gelu_tanh", 3: "relu", 4: "silu"}


@pytest.mark.parametrize("storage, act_t, T, n_in, out, defines, options", GEMV_CASES)
@needs_emulator
@pytest.mark.slow
def test_emulated_sbi_gemv(rng, storage, act_t, T, n_in, out, defines, options):
    dt, at = _np_type(storage), _np_type(act_t)
    d = {"T_STORAGE": storage, "T_ACT": act_t, **defines}
    norm, gated, splits = d.get("NORM", 0), d.get("GATED", 0), options.get("splits", 1)
    has_bias, has_res, act = d.get("HAS_BIAS", 0), d.get("HAS_RESIDUAL", 0), _ACT_NAMES.get(d.get("ACT", 0))
    ldx = n_in + (8 if d.get("X_VEC", 1) else 3)
    ncols = out // 2 if gated else out
    W = (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(dt)
    xb = rng.standard_normal((T, ldx)).astype(at)
    bias = rng.standard_normal(out).astype(F32) if has_bias else None
    residual = rng.standard_normal((T, ncols)).astype(at) if has_res else None
    gamma, beta = rng.standard_normal(n_in).astype(F32), rng.standard_normal(n_in).astype(F32)

    x = xb[:, :n_in].astype(F32)
    if norm == 1:
        x = OPS.rms_norm(x, gamma, 1e-5)
    elif norm == 2:
        x = OPS.layer_norm(x, gamma, beta if d.get("NORM_BIAS", 1) else None, 1e-5)
    ref = OPS.linear(x, W, bias)
    ref = OPS.gated_activation(ref, act) if gated else (OPS.activation(ref, act) if act else ref)
    if has_res:
        ref = ref + residual.astype(F32)

    y, partial = _poison((T, ncols), at), _poison((splits, T, out))
    res = residual if has_res else y
    name = "fused_norm_gemv" if norm else "sbi_gemv"
    module = emulate.build(name, d)
    grid, block = (-(-ncols // (32 * d.get("ROWS", 1))), splits), (32, d.get("WARPS", 4))
    wp = W if d.get("W_ROWMAJOR", 0) else layout.sbi_pack(W)
    if norm:
        module.launch(name, grid, block, xb, gamma, beta, 1e-5, wp, bias, res, y, partial, T, n_in, out, ldx, ncols,
                      ncols)
    else:
        module.launch(name, grid, block, xb, wp, bias, res, y, partial, T, n_in, out, ldx, ncols, ncols)
    if splits > 1:
        module.launch(f"{name}_reduce", (-(-T * ncols // 256),), (256,), partial, bias, res, y, T, out, splits,
                      ncols, ncols)
    _close(y.astype(F32), ref, 1e-4 if act_t == "float" else 2e-2)


@pytest.mark.parametrize("T, E, K, normalize, capacity", [(7, 8, 2, "topk", None), (20, 5, 1, "none", 3),
                                                          (33, 40, 3, "topk", 2), (5, 4, 4, "none", 0)])
@needs_emulator
@pytest.mark.slow
def test_emulated_moe(rng, T, E, K, normalize, capacity):
    # a small block and chunk, so that the scan takes several rounds and threads own several experts
    module = emulate.build("moe_gating", {"T_STORAGE": "float", "NWARPS": 2, "ROUTE_BLOCK": 32, "CHUNK": 16,
                                          "MAX_EXPERTS": 64})
    logits = rng.standard_normal((T, E)).astype(F32)
    logits[1, :] = 0.5                                                   # a row of ties: the lower index wins
    ld = E + 2
    padded = np.zeros((T, ld), F32)
    padded[:, :E] = logits
    norm = int(normalize == "topk")
    cap = -1 if capacity is None else capacity
    ref_experts, ref_weights = moe_ops.top_k_gating(logits, K, normalize)

    experts, weights = _poison((T, K), np.int64), _poison((T, K))
    module.launch("moe_topk_gating", (-(-T // 2),), (32, 2), padded, experts, weights, T, E, K, ld, norm)
    np.testing.assert_array_equal(experts, ref_experts)
    _close(weights, ref_weights, 1e-6)

    routing = moe_ops.route(ref_experts, ref_weights, E, capacity)
    R, N, D = routing.num_rows, T * K, 19
    tables = {"expert_counts": _poison(E, np.int64), "offsets": _poison(E + 1, np.int64),
              "slot": _poison(N, np.int64), "row_of_choice": _poison(N, np.int64),
              "expert_of_row": _poison(N, np.int64), "token_of_row": _poison(N, np.int64),
              "weight_of_row": _poison(N), "num_rows": _poison(1, np.int64)}
    module.launch("moe_route", (1,), (32,), ref_experts, ref_weights, T, K, E, cap, *tables.values())
    want = {"expert_counts": routing.expert_counts, "offsets": moe_ops.expert_segments(routing.expert_counts),
            "slot": routing.slot.reshape(-1), "row_of_choice": routing.row_of_choice.reshape(-1),
            "expert_of_row": routing.expert_of_row, "token_of_row": routing.token_of_row,
            "weight_of_row": routing.weight_of_row, "num_rows": [R]}
    for key, value in want.items():
        np.testing.assert_array_equal(tables[key][:len(value)], value, err_msg=key)

    x = rng.standard_normal((T, D + 1)).astype(F32)                      # rows D + 1 apart
    rows = _poison((N, D))
    module.launch("moe_permute", (N,), (32,), x, tables["token_of_row"], tables["num_rows"], rows, D, D + 1, D)
    np.testing.assert_array_equal(rows[:R], moe_ops.permute(x[:, :D], routing))
    out = _poison((T, D))
    module.launch("moe_unpermute", (T,), (32,), rows, tables["row_of_choice"], tables["weight_of_row"], out, T, K,
                  D, D, D)
    np.testing.assert_array_equal(out, moe_ops.unpermute(rows[:R], routing, T))   # same rounding, bit for bit

    fused = {key: _poison(v.shape, v.dtype) for key, v in tables.items()}
    experts2, weights2, rows2 = _poison((T, K), np.int64), _poison((T, K)), _poison((N, D))
    module.launch("moe_gate_dispatch", (1,), (64,), padded, T, E, K, ld, norm, cap, experts2, weights2,
                  *fused.values(), x, rows2, D, D + 1, D)
    np.testing.assert_array_equal(experts2, ref_experts)
    for key, value in want.items():
        tol = 1e-6 if key == "weight_of_row" else 0
        _close(fused[key][:len(value)], value, tol)
    np.testing.assert_array_equal(rows2[:R], rows[:R])
