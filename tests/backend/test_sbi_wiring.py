"""SBI-GeMM and the Deep-Fusion regions wired into the backends (hpcinfer/backend/cupy_sbi.py, Ops.fused_linear).

1. The launch choice, pure Python: token buckets, the block shapes of both tilings (rows, the default, and the old
   cols), input-dimension splits, when the kernel does not apply (cuBLAS).
2. NumpyOps.fused_linear is exactly the unfused sequence, and the model's fused calls change no bit of NumPy logits
   or greedy tokens (every family of tests/helpers/hf_models.py).
3. cupy_sbi.fused_linear itself, with a NumPy stand-in for CupyOps whose kernels run on the CPU emulator
   (tests/helpers/kernel_emulator.py): the defines, grids and arguments the wrapper computes under both tilings,
   against NumpyOps (slow: a g++ build per define set, cached under build/kernel-emu/). The row tiling's kernel
   cases (tiles, tails, splits) are in tests/kernels/test_sbi_rows_tiling.py.
4. CupyOps.linear / fused_linear and a tiny Llama's greedy tokens on tests/helpers/emu_cupy/ (and on a GPU when there
   is one) against NumpyOps, for T in {1, 3, 16, 17} and float32 / float16 / bfloat16 weights (16-bit weights from
   2 tokens on run tc_gemm instead: tests/backend/test_tc_gemm_routing.py).
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

from hpcinfer.backend import cupy_sbi
from hpcinfer.backend.cupy_ops import CupyOps
from hpcinfer.backend.interface import NormParams
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate

F32 = np.float32
OPS = NumpyOps()
H100_SMS = 132


# ---- 1. the launch choice -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16),
                                            (17, None), (0, None), (512, None)])
def test_token_bucket(tokens, bucket):
    assert cupy_sbi.token_bucket(tokens) == bucket


def test_rows_tiling_splits_only_where_the_columns_leave_sms_idle():
    # GPT-2 1.5B on an H100 (fp16, VEC 8): at T = 1, 4 columns per block (6 from T = 3): QKV 4800 -> 1200 blocks,
    # the down projection (1600 columns, in = 6400) -> 400 blocks, the MLP up 6400 -> 1600: one kernel each
    for ncols, n_in in ((4800, 1600), (1600, 1600), (1600, 6400), (6400, 1600), (50257, 1600)):
        for bucket in cupy_sbi.TOKEN_BUCKETS:
            assert cupy_sbi.choose_splits(ncols, n_in, 8, H100_SMS, "rows", bucket) == 1
    # a small model (or a tp shard): 128 columns = 32 blocks < 132 SMs -> 9 splits for 2 blocks per SM, while
    # every split keeps a full batch of warp loads (32 lanes x UNROLL 8 vectors at T = 1)
    assert cupy_sbi.choose_splits(128, 64 * 256 * 8, 8, H100_SMS, "rows", 1) == 9
    assert cupy_sbi.choose_splits(64, 2 * 256 * 8, 8, H100_SMS, "rows", 1) == 2
    assert cupy_sbi.choose_splits(64, 256 * 8, 8, H100_SMS, "rows", 1) == 1
    assert cupy_sbi.choose_splits(64, 1 << 20, 8, H100_SMS, "rows", 16) == cupy_sbi.MAX_SPLITS
    assert cupy_sbi.choose_splits(64, 1 << 20, 8, 16, "rows", 1) == 1        # 16 blocks fill 16 SMs


def test_cols_tiling_splits_as_before():
    # the old tiling (32 columns per block): QKV 4800 columns = 150 blocks -> 2 splits for 2 blocks per SM;
    # the down projection (1600 columns = 50 blocks, in = 6400) -> 6 splits; the MLP up (6400 = 200 blocks) -> 2
    assert cupy_sbi.choose_splits(4800, 1600, 8, H100_SMS, "cols") == 2
    assert cupy_sbi.choose_splits(1600, 6400, 8, H100_SMS, "cols") == 6
    assert cupy_sbi.choose_splits(6400, 1600, 8, H100_SMS, "cols") == 2
    assert cupy_sbi.choose_splits(50257, 1600, 8, H100_SMS, "cols") == 1   # the LM head fills the GPU alone
    # a tiny input dimension: every split keeps at least WARPS * UNROLL vectors
    assert cupy_sbi.choose_splits(64, 64, 4, H100_SMS, "cols") == 1         # 16 vectors: one pass of 4 warps x 4
    assert cupy_sbi.choose_splits(64, 256, 4, H100_SMS, "cols") == 4
    assert cupy_sbi.choose_splits(32, 1 << 20, 8, H100_SMS, "cols") == cupy_sbi.MAX_SPLITS


@pytest.mark.parametrize("bucket", cupy_sbi.TOKEN_BUCKETS)
@pytest.mark.parametrize("vec", [4, 8])
def test_rows_tiles_fit_shared_memory_and_whole_batches(bucket, vec):
    warps, rw, unroll = cupy_sbi.ROW_TILES[bucket]
    assert -(-1600 // (warps * rw)) >= 2 * H100_SMS                         # >= 2 blocks per SM at out = 1600
    for n_in in (vec, 96, 1600, 6400, 14336):
        x_tile = cupy_sbi.x_tile(n_in, vec, bucket, unroll)
        assert x_tile % (32 * unroll * vec) == 0 and bucket * x_tile * 4 <= 40 * 1024   # sbi_core.cuh's asserts
        assert x_tile >= min(n_in, cupy_sbi.XS_FLOATS // bucket // 2)          # all of x, or most of the budget


def test_plan_defines_and_grids():
    launch = cupy_sbi.plan(3, 1600, 4800, np.float16, H100_SMS, has_bias=True)
    assert launch.name == "sbi_gemv"
    assert launch.defines == {"T_STORAGE": "__half", "T_ACT": "float", "MAX_TOKENS": 4, "TILING": 1, "WARPS": 3,
                              "UNROLL": 4, "RW": 2, "X_TILE": 2048, "ACT": 0, "HAS_BIAS": 1, "HAS_RESIDUAL": 0,
                              "GATED": 0, "X_VEC": 1, "W_ROWMAJOR": 1}
    assert launch.grid == (800, 1) and launch.block == (32, 3) and launch.splits == 1
    assert launch.reduce_grid == (-(-3 * 4800 // 256),)

    cols = cupy_sbi.plan(3, 1600, 4800, np.float16, H100_SMS, has_bias=True, tiling="cols")
    assert cols.defines == {"T_STORAGE": "__half", "T_ACT": "float", "MAX_TOKENS": 4, "TILING": 0, "WARPS": 4,
                            "UNROLL": 4, "ROWS": 1, "ACT": 0, "HAS_BIAS": 1, "HAS_RESIDUAL": 0, "GATED": 0,
                            "X_VEC": 1, "W_ROWMAJOR": 1}
    assert cols.grid == (150, 2) and cols.block == (32, 4) and cols.splits == 2

    gated = cupy_sbi.plan(1, 576, 2 * 1536, np.uint16, H100_SMS, norm="rmsnorm", act="silu", gated=True,
                          has_residual=False, x_vec=False)
    assert gated.name == "fused_norm_gemv"
    assert gated.defines["T_STORAGE"] == "__nv_bfloat16" and gated.defines["GATED"] == 1
    assert gated.defines["ACT"] == 4 and gated.defines["NORM"] == 1 and gated.defines["NORM_BIAS"] == 0
    assert gated.defines["X_VEC"] == 0 and gated.defines["X_TILE"] == 2048   # 576 rounded up to a whole batch
    assert gated.grid == (1536 // 4, 1)                                    # the grid covers F columns, not 2F

    ln = cupy_sbi.plan(16, 64, 64, np.float32, 4, norm="layernorm", norm_bias=True, act="gelu", has_residual=True)
    assert ln.defines["NORM"] == 2 and ln.defines["NORM_BIAS"] == 1 and ln.defines["MAX_TOKENS"] == 16
    assert ln.defines["HAS_RESIDUAL"] == 1 and ln.defines["ACT"] == 1 and ln.defines["X_TILE"] == 256
    forced = cupy_sbi.plan(16, 1600, 1600, np.float16, H100_SMS, tiling="rows:8x2x2")
    assert (forced.defines["WARPS"], forced.defines["RW"], forced.defines["UNROLL"]) == (8, 2, 2)
    assert forced.grid == (100, 3) and forced.block == (32, 8)          # 100 blocks < 132 SMs: split
    for bad in ("diagonal", "rows:0x2x2", "rows:8x2", "rows:33x1x1", "rows:4x1x16"):   # last: 64 KiB of x
        with pytest.raises(ValueError, match="tiling"):
            cupy_sbi.plan(16, 64, 64, np.float16, 4, tiling=bad)


@pytest.mark.parametrize("args, keys", [
    ((17, 64, 64, np.float32), {}),                                  # too many tokens: cuBLAS
    ((0, 64, 64, np.float32), {}),
    ((1, 100, 64, np.float16), {}),                                  # in not a whole number of 16-byte vectors
    ((1, 66, 64, np.float32), {}),
    ((1, 64, 64, np.float64), {}),                                   # no float64 kernels
    ((1, 64, 64, np.int8), {}),
    ((1, 64, 63, np.float32), {"gated": True, "act": "silu"}),       # gate/up halves need an even out
    ((1, 64, 64, np.float32), {"gated": True}),                      # gated without an activation
    ((1, 64, 64, np.float32), {"act": "tanh"}),                      # an activation the kernels do not have
    ((1, 64, 64, np.float32), {"norm": "batchnorm"}),
])
def test_plan_declines(args, keys):
    assert cupy_sbi.plan(*args, H100_SMS, **keys) is None


# ---- 2. the NumPy twin ----------------------------------------------------------------------------------------
def _norm(rng, kind, n, bias=True):
    return NormParams(kind, (1 + 0.2 * rng.standard_normal(n)).astype(F32),
                      rng.standard_normal(n).astype(F32) if bias and kind == "layernorm" else None, 1e-5)


FUSED_CASES = [  # (norm kind, layernorm bias, act, gated, bias, residual)
    (None, False, None, False, True, False), (None, False, None, False, True, True),
    ("rmsnorm", False, None, False, False, False), ("rmsnorm", False, "silu", True, False, False),
    ("layernorm", True, "gelu", False, True, False), ("layernorm", False, "gelu_tanh", False, True, True),
    (None, False, "relu", False, False, True), ("rmsnorm", False, "gelu", True, True, True),
]


@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
@pytest.mark.parametrize("kind, ln_bias, act, gated, has_bias, has_res", FUSED_CASES)
def test_numpy_fused_linear_is_the_unfused_sequence(tokens, kind, ln_bias, act, gated, has_bias, has_res):
    rng = np.random.default_rng(tokens)
    n_in, out = 48, 64
    x = rng.standard_normal((tokens, n_in)).astype(F32)
    w = rng.standard_normal((out, n_in)).astype(np.float16)
    bias = rng.standard_normal(out).astype(F32) if has_bias else None
    residual = rng.standard_normal((tokens, out // 2 if gated else out)).astype(F32) if has_res else None
    norm = None if kind is None else _norm(rng, kind, n_in, ln_bias)

    h = x
    if kind == "rmsnorm":
        h = OPS.rms_norm(h, norm.weight, norm.eps)
    elif kind == "layernorm":
        h = OPS.layer_norm(h, norm.weight, norm.bias, norm.eps)
    y = OPS.linear(h, w, bias)
    if act is not None:
        y = OPS.gated_activation(y, act) if gated else OPS.activation(y, act)
    expected = y if residual is None else residual + y                     # the model's `x + sublayer(x)`
    got = OPS.fused_linear(x, w, bias, norm=norm, act=act, gated=gated, residual=residual)
    np.testing.assert_array_equal(got, expected)


@pytest.fixture(scope="module", params=("gpt2", "opt", "gpt_neox", "llama"))
def hf_tiny(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from hpcinfer.api import load_model
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp(request.param)
    convert_hf(save_tiny_model(request.param, root / "hf"), str(root / "model.h5"))
    model = load_model(str(root / "model.h5"))
    rng = np.random.default_rng(7)
    return model, [rng.integers(0, model.arch.vocab_size, n).tolist() for n in (5, 1, 12)]


def test_model_fused_calls_change_no_bit(hf_tiny, monkeypatch):
    from hpcinfer.api import generate, prompt_logits

    model, prompts = hf_tiny
    assert isinstance(model.ops, NumpyOps)
    fused = prompt_logits(model, prompts), generate(model, prompts, 6)
    monkeypatch.setattr(NumpyOps, "fused_linear", None)       # a backend without it: the layers call op by op
    unfused = prompt_logits(model, prompts), generate(model, prompts, 6)
    np.testing.assert_array_equal(fused[0], unfused[0])
    assert fused[1] == unfused[1]


def test_quantized_and_tp_paths_fall_back_to_unfused():
    """qw (linear_q) and tp > 1 never reach fused_linear; the result is still act(norm(x) W^T + b) + residual."""
    from hpcinfer.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from hpcinfer.quant.formats import quantize

    rng = np.random.default_rng(3)
    calls = []

    class Spy(NumpyOps):
        def fused_linear(self, *args, **kwargs):
            calls.append(kwargs)
            return super().fused_linear(*args, **kwargs)

    ops, tp = Spy(), types.SimpleNamespace(size=1, rank=0)
    x = rng.standard_normal((2, 32)).astype(F32)
    w = rng.standard_normal((64, 32)).astype(F32)
    params = _norm(rng, "rmsnorm", 32)

    class Norm:                                               # what the model's Norm offers the layers
        def __init__(self):
            self.params = params

        def __call__(self, a):
            return ops.rms_norm(a, params.weight, params.eps)

    col = ColumnParallelLinear(ops, tp, ["up"], [64], False, "float32")
    col.qw = quantize(w, "int8")
    y = col(x, Norm(), act="silu", gated=True)
    assert calls == []
    ref = ops.gated_activation(ops.linear_q(ops.rms_norm(x, params.weight, 1e-5), col.qw), "silu")
    np.testing.assert_array_equal(y, ref)

    row = RowParallelLinear(ops, types.SimpleNamespace(size=2, rank=0, all_reduce=lambda a: 2 * a), "down", 64,
                            False, "float32")
    row.w = w
    res = rng.standard_normal((2, 64)).astype(F32)
    y = row(x, residual=res)
    assert calls == []                                        # tp > 1: the all-reduce sits between GEMV and add
    np.testing.assert_array_equal(y, res + 2 * ops.linear(x, w))


# ---- 3. the wrappers' launches on the CPU emulator ------------------------------------------------------------
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")


class EmulatedOps:
    """What cupy_sbi.fused_linear asks of a CupyOps, over NumPy, launching the kernels on the CPU emulator."""

    kernels = True
    xp = np

    def __init__(self, sm_count: int):
        self._sm_count = sm_count
        self.launches = []

    _rows = CupyOps._rows

    def _kernel(self, name, function, **defines):
        module = emulate.build(name, {"T_STORAGE": "float", "T_ACT": "float", **defines})

        def launch(grid, block, args):
            self.launches.append((name, function, grid, block, defines))
            module.launch(function, grid, block, *args)

        return launch


def _storage(rng, shape, dtype: str):
    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(F32)
    if dtype == "bfloat16":
        return w.astype(ml_dtypes.bfloat16).view(np.uint16), w.astype(ml_dtypes.bfloat16)
    return w.astype(dtype), w.astype(dtype)


EMU_CASES = [  # (T, in, out, weight dtype, norm, ln bias, act, gated, bias, residual, strided x, SMs)
    (1, 64, 96, "float32", None, False, None, False, True, False, False, 1),             # one split
    (3, 512, 64, "float16", None, False, None, False, True, True, False, 8),             # cols: 4 splits, bucket 4
    (16, 64, 40, "bfloat16", None, False, "gelu_tanh", False, False, False, True, 2),    # X_VEC=0, a column tail
    (1, 256, 128, "float16", "rmsnorm", False, "silu", True, False, True, False, 8),     # gated; cols: 2 splits
    (5, 32, 64, "float32", "layernorm", True, "gelu", False, True, False, False, 1),     # bucket 8
    (2, 64, 64, "bfloat16", "layernorm", False, "relu", False, True, True, True, 4),     # NORM_BIAS=0, X_VEC=0
    (1, 2048, 12, "float32", None, False, None, False, True, True, False, 132),          # rows: 2 splits
    (3, 4104, 14, "float16", "rmsnorm", False, "silu", True, True, False, False, 132),   # rows: 4 splits, gated
]


def _splits(case, tiling):
    T, n_in, out, dt, _, _, act, gated, *_, sms = case
    return cupy_sbi.plan(T, n_in, out, np.float32 if dt == "float32" else np.float16, sms, gated=gated, act=act,
                         tiling=tiling).splits


def test_emulated_cases_cover_the_second_reduction():
    for tiling in cupy_sbi.TILINGS:
        splits = [_splits(case, tiling) for case in EMU_CASES]
        assert splits.count(1) >= 2 and 2 in splits and max(splits) >= 4, (tiling, splits)


@pytest.mark.parametrize("tiling", cupy_sbi.TILINGS)
@pytest.mark.parametrize("T, n_in, out, dtype, kind, ln_bias, act, gated, has_bias, has_res, strided, sms",
                         EMU_CASES)
@needs_emulator
@pytest.mark.slow
def test_wrapper_launch_matches_numpy_on_the_emulator(T, n_in, out, dtype, kind, ln_bias, act, gated, has_bias,
                                                      has_res, strided, sms, tiling):
    rng = np.random.default_rng(T * 1000 + n_in)
    w_dev, w_host = _storage(rng, (out, n_in), dtype)
    ncols = out // 2 if gated else out
    xb = rng.standard_normal((T, n_in + 3)).astype(F32)
    x = xb[:, 1:n_in + 1] if strided else np.ascontiguousarray(xb[:, :n_in])   # strided: misaligned rows
    bias = rng.standard_normal(out).astype(F32) if has_bias else None
    residual = rng.standard_normal((T, ncols)).astype(F32) if has_res else None
    norm = None if kind is None else _norm(rng, kind, n_in, ln_bias)

    ops = EmulatedOps(sms)
    got = cupy_sbi.fused_linear(ops, x, w_dev, bias, norm=norm, act=act, gated=gated, residual=residual,
                                tiling=tiling)
    ref = OPS.fused_linear(np.ascontiguousarray(x), w_host, bias, norm=norm, act=act, gated=gated,
                           residual=residual)
    assert got is not None and got.shape == (T, ncols)
    name, function, grid, block, defines = ops.launches[0]
    launch = cupy_sbi.plan(T, n_in, out, w_dev.dtype, sms, norm=kind, norm_bias=bool(ln_bias and kind),
                           act=act, gated=gated, has_bias=has_bias, has_residual=has_res, x_vec=not strided,
                           tiling=tiling)
    assert (name, grid, block, defines) == (launch.name, launch.grid, launch.block, launch.defines)
    assert len(ops.launches) == (2 if launch.splits > 1 else 1)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@needs_emulator
@pytest.mark.slow
def test_linear_through_the_wrapper_on_the_emulator():
    """CupyOps.linear's kernel path (no epilogue) for the T the kernel takes; T = 17 declines (cuBLAS)."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((64, 32)) / 8).astype(np.float16)
    ops = EmulatedOps(4)
    for T in (1, 3, 16):
        x = rng.standard_normal((T, 32)).astype(F32)
        np.testing.assert_allclose(cupy_sbi.fused_linear(ops, x, w), OPS.linear(x, w), rtol=2e-5, atol=2e-5)
    assert cupy_sbi.fused_linear(ops, rng.standard_normal((17, 32)).astype(F32), w) is None
    ops.kernels = False
    assert cupy_sbi.fused_linear(ops, rng.standard_normal((1, 32)).astype(F32), w) is None


# ---- 4. CupyOps on the fake cupy (tests/helpers/emu_cupy/: the real kernels on the CPU emulator), and on a GPU -------
@pytest.fixture(params=["fake", "gpu"])
def emu_ops(request, monkeypatch):
    """CupyOps(device=0) on the fake cupy (or on a real GPU, where there is one), and the list of its SBI calls:
    (fused norm?, kernel ran?)."""
    if request.param == "gpu":
        from hpcinfer.backend.cupy_ops import gpu_available

        if not gpu_available():
            pytest.skip("no GPU")
    else:
        import emu_cupy

        emu_cupy.install(monkeypatch)
    calls, real = [], cupy_sbi.fused_linear

    def spy(ops, x, w, bias=None, norm=None, *args, **kwargs):
        y = real(ops, x, w, bias, norm, *args, **kwargs)
        calls.append((norm is not None, y is not None))
        return y

    monkeypatch.setattr(cupy_sbi, "fused_linear", spy)
    return CupyOps(device=0), calls


def _weights(rng, shape, dtype):
    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(F32)
    return w.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T", [1, 3, 16, 17])
@pytest.mark.slow
def test_cupy_linear_on_the_fake_matches_numpy(emu_ops, T, dtype):
    gpu, calls = emu_ops
    rng = np.random.default_rng(T)
    x, w, bias = rng.standard_normal((T, 64)).astype(F32), _weights(rng, (96, 64), dtype), rng.standard_normal(96)
    bias = bias.astype(F32)
    got = gpu.to_host(gpu.linear(gpu.asarray(x), gpu.asarray(w), gpu.asarray(bias)))
    np.testing.assert_allclose(got, OPS.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    if dtype != "float32" and T >= 2:                             # 16-bit weights, 2 .. 64 tokens: tc_gemm
        assert calls == []                                        # (tests/backend/test_tc_gemm_routing.py)
    else:
        assert calls == [(False, T <= cupy_sbi.SBI_MAX_TOKENS)]   # the kernel up to 16 tokens, then cuBLAS


FAKE_FUSED = [  # (weight dtype, norm kind, layernorm bias, act, gated, bias, residual)
    ("float16", "rmsnorm", False, "silu", True, False, True),     # Llama's region 3 (+ the residual for the test)
    ("bfloat16", "layernorm", True, "gelu", False, True, False),  # GPT-2's region 3
    ("float32", None, False, None, False, True, True),            # region 4: bias + residual
]


@pytest.mark.parametrize("dtype, kind, ln_bias, act, gated, has_bias, has_res", FAKE_FUSED)
@pytest.mark.parametrize("T", [1, 3, 16, 17])
@pytest.mark.slow
def test_cupy_fused_linear_on_the_fake_matches_numpy(emu_ops, T, dtype, kind, ln_bias, act, gated, has_bias,
                                                     has_res):
    gpu, calls = emu_ops
    rng = np.random.default_rng(T + 100)
    n_in, out = 64, 128
    x, w = rng.standard_normal((T, n_in)).astype(F32), _weights(rng, (out, n_in), dtype)
    bias = rng.standard_normal(out).astype(F32) if has_bias else None
    residual = rng.standard_normal((T, out // 2 if gated else out)).astype(F32) if has_res else None
    norm = None if kind is None else _norm(rng, kind, n_in, ln_bias)
    dev = lambda a: None if a is None else gpu.asarray(a)                                   # noqa: E731
    dnorm = None if norm is None else NormParams(norm.kind, dev(norm.weight), dev(norm.bias), norm.eps)
    got = gpu.to_host(gpu.fused_linear(dev(x), dev(w), dev(bias), norm=dnorm, act=act, gated=gated,
                                       residual=dev(residual)))
    want = OPS.fused_linear(x, w, bias, norm=norm, act=act, gated=gated, residual=residual)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if dtype != "float32" and T >= 2:                             # 16-bit weights, 2 .. 64 tokens: tc_gemm
        assert calls == []
    else:
        assert calls[0] == (kind is not None, T <= cupy_sbi.SBI_MAX_TOKENS)


@pytest.mark.slow
def test_tiny_llama_greedy_tokens_on_the_fake_equal_numpy(emu_ops, tmp_path):
    """Regions 1, 3 (SiLU-gated) and 4 in a Llama block, end to end: prefill T > 16 runs unfused, decode fused."""
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from hpcinfer.api import generate, load_model, prompt_logits
    from hpcinfer.checkpoint.hf import convert_hf

    _, calls = emu_ops
    convert_hf(save_tiny_model("llama", tmp_path / "hf"), str(tmp_path / "model.h5"))
    cpu = load_model(str(tmp_path / "model.h5"), backend="numpy")
    gpu = load_model(str(tmp_path / "model.h5"), backend="cupy")
    prompts = [[1, 2, 3, 4, 5], [7], list(range(10, 30))]
    want, got = prompt_logits(cpu, prompts), prompt_logits(gpu, prompts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert generate(gpu, prompts, 5) == generate(cpu, prompts, 5)
    assert (True, True) in calls and (False, True) in calls        # fused norm + GEMV and GEMV + residual ran
