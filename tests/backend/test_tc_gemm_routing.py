"""The tensor-core small-batch GEMM wired into CupyOps (hpcinfer/backend/cupy_tc_gemm.py).

1. The launch choice, pure Python: token buckets, what the kernel declines, the shared-memory fit (the kernel's
   static_assert, in Python), split-K only where the column blocks leave SMs idle.
2. On the CPU stand-in of cupy (tests/helpers/emu_cupy/: the kernels run on the emulator): CupyOps.linear and
   fused_linear route 2 .. 64 tokens of 16-bit weights to tc_gemm, 1 token to the SBI GEMV, 65 to cuBLAS, and
   linear_q 2 .. 64 tokens to tc_quant_gemm, each against NumpyOps (slow: a g++ build per define set).
3. Under stream capture: a linear of up to 64 tokens calls no cuBLAS (the stand-in still refuses cuBLAS there, as
   CuPy does), and a tiny float16 Llama's decode steps of 33 sequences are captured and replayed with NumPy's tokens.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from hpcinfer.backend import cupy_sbi, cupy_tc_gemm
from hpcinfer.backend.interface import NormParams
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate

F32 = np.float32
OPS = NumpyOps()
H200_SMS = 132
needs_emulator = pytest.mark.skipif(emulate.unavailable() is not None, reason=f"{emulate.unavailable()}")
GPT2_XL = [(1600, 4800), (1600, 1600), (1600, 6400), (6400, 1600)]            # (in, out) of its projections
LLAMA_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]          # qkv, o, gate+up, down


# ---- 1. the launch choice -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, bucket", [(0, None), (1, None), (2, 8), (8, 8), (9, 16), (17, 32), (33, 64),
                                            (64, 64), (65, None)])
def test_token_bucket(tokens, bucket):
    assert cupy_tc_gemm.token_bucket(tokens) == bucket


def test_plan_declines_what_the_kernel_does_not_take():
    plan = cupy_tc_gemm.plan
    assert plan(4, 1600, 4800, "__half", H200_SMS) is not None
    assert plan(1, 1600, 4800, "__half", H200_SMS) is None                 # one token: the SBI GEMV
    assert plan(65, 1600, 4800, "__half", H200_SMS) is None                # cuBLAS
    assert plan(4, 1608, 4800, "__half", H200_SMS) is None                 # in % 16
    assert plan(4, 1600, 4801, "__half", H200_SMS, act="silu", gated=True) is None
    assert plan(4, 1600, 4800, "__half", H200_SMS, gated=True) is None     # gated needs an activation
    assert plan(4, 1600, 4800, "__half", H200_SMS, act="swish") is None


@pytest.mark.parametrize("tokens", [2, 8, 16, 32, 64])
@pytest.mark.parametrize("gated", [False, True])
def test_every_model_shape_fits_shared_memory(tokens, gated):
    for n_in, out in GPT2_XL + LLAMA_8B:
        p = cupy_tc_gemm.plan(tokens, n_in, out, "__nv_bfloat16", H200_SMS, act="silu" if gated else None,
                              gated=gated, norm="rmsnorm")
        d = p.defines
        nrt = d["MT"] * (2 if gated else 1)
        used = cupy_tc_gemm.shared_bytes(d["MAX_TOKENS"], d["WARPS"], nrt, d["STAGES"], d["XK"])
        assert used <= 48 * 1024 and d["XK"] % 64 == 0 and d["STAGES"] >= 2
        assert p.block == (32, d["WARPS"]) and p.grid[0] * 16 * d["WARPS"] * d["MT"] >= (out // 2 if gated else out)


def test_split_k_only_where_the_columns_leave_sms_idle():
    # 132 SMs, 64 columns per block: 264 blocks fill 2 per SM; Llama's gate+up (28672 rows) is one kernel
    assert cupy_tc_gemm.choose_splits(448, 4096, H200_SMS) == 1
    assert cupy_tc_gemm.choose_splits(75, 1600, H200_SMS) == 4        # gpt2 qkv: 75 blocks -> 4 splits
    assert cupy_tc_gemm.choose_splits(25, 6400, H200_SMS) == 11       # gpt2 down: 25 blocks -> 11
    assert cupy_tc_gemm.choose_splits(1, 1 << 20, H200_SMS) == cupy_tc_gemm.MAX_SPLITS
    assert cupy_tc_gemm.choose_splits(2, 256, H200_SMS) == 1          # every split keeps 4 stages of 64


# ---- 2. CupyOps on the stand-in -------------------------------------------------------------------------------
@pytest.fixture
def routed(emu_cupy, monkeypatch):
    """CupyOps(device=0) on the stand-in and the list of paths its linears took: "tc", "sbi" or "cublas"."""
    from hpcinfer.backend.cupy_ops import CupyOps

    paths = []

    def spy(module, label):
        real = module.fused_linear

        def call(*args, **kwargs):
            y = real(*args, **kwargs)
            if y is not None:
                paths.append(label)
            return y
        monkeypatch.setattr(module, "fused_linear", call)

    spy(cupy_tc_gemm, "tc")
    spy(cupy_sbi, "sbi")
    ops = CupyOps(device=0)
    real_matmul = ops.matmul
    monkeypatch.setattr(ops, "matmul", lambda a, b: (paths.append("cublas"), real_matmul(a, b))[1])
    return ops, paths


def _weights(rng, shape, dtype):
    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(F32)
    return w.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


@pytest.mark.parametrize("T, dtype, path", [(1, "float16", "sbi"), (2, "bfloat16", "tc"), (9, "float16", "tc"),
                                            (64, "bfloat16", "tc"), (65, "float16", "cublas"),
                                            (3, "float32", "sbi"), (17, "float32", "cublas")])
@needs_emulator
@pytest.mark.exhaustive
def test_linear_routes_by_tokens_and_dtype(routed, T, dtype, path):
    ops, paths = routed
    rng = np.random.default_rng(T)
    x, w = rng.standard_normal((T, 64)).astype(F32), _weights(rng, (80, 64), dtype)
    bias = rng.standard_normal(80).astype(F32)
    got = ops.to_host(ops.linear(ops.asarray(x), ops.asarray(w), ops.asarray(bias)))
    np.testing.assert_allclose(got, OPS.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    assert paths == [path]


@pytest.mark.parametrize("T, kind, gated, act", [(3, "rmsnorm", True, "silu"), (20, "layernorm", False, "gelu"),
                                                 (2, None, False, None)])
@needs_emulator
@pytest.mark.exhaustive
def test_fused_linear_on_tensor_cores_matches_numpy(routed, T, kind, gated, act):
    ops, paths = routed
    rng = np.random.default_rng(T + 7)
    n_in, out = 64, 96
    x, w = (2 * rng.standard_normal((T, n_in)) + 1).astype(F32), _weights(rng, (out, n_in), "float16")
    bias = rng.standard_normal(out).astype(F32)
    residual = rng.standard_normal((T, out // 2 if gated else out)).astype(F32)
    norm = None if kind is None else NormParams(kind, rng.standard_normal(n_in).astype(F32),
                                                rng.standard_normal(n_in).astype(F32) if kind == "layernorm"
                                                else None, 1e-5)
    dev = lambda a: None if a is None else ops.asarray(a)                                    # noqa: E731
    dnorm = None if norm is None else NormParams(norm.kind, dev(norm.weight), dev(norm.bias), norm.eps)
    got = ops.to_host(ops.fused_linear(dev(x), dev(w), dev(bias), norm=dnorm, act=act, gated=gated,
                                       residual=dev(residual)))
    want = OPS.fused_linear(x, w, bias, norm=norm, act=act, gated=gated, residual=residual)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert paths == ["tc"]          # T = 20 > NORM_FUSE_MAX_TOKENS: the norm kernel first, the rest still fused


# ---- 3. under stream capture ----------------------------------------------------------------------------------
@needs_emulator
def test_a_captured_linear_of_64_tokens_calls_no_cublas(routed):
    ops, paths = routed
    cp = ops.xp
    rng = np.random.default_rng(3)
    w = ops.asarray(_weights(rng, (48, 64), "float16"))
    x64, x65 = (ops.asarray(rng.standard_normal((t, 64)).astype(F32)) for t in (64, 65))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        y = ops.linear(x64, w)                                    # tc_gemm: recorded, no library call
        graph = stream.end_capture()
    assert paths == ["tc"] and ops.library_calls == 0
    x64[...] = x64 * 2                                            # new inputs in the captured buffer
    graph.launch()
    want = OPS.linear(ops.to_host(x64), ops.to_host(w).astype(F32))
    np.testing.assert_allclose(ops.to_host(y), want, rtol=1e-4, atol=1e-4)
    with stream:                                                  # 65 tokens: cuBLAS, which a capture refuses
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match="cuBLAS"):
            ops.linear(x65, w)
        stream.end_capture()


@needs_emulator
@pytest.mark.exhaustive
def test_decode_steps_of_33_float16_sequences_are_captured(emu_cupy):
    """A tiny float16 Llama (rotary, RMSNorm, GQA, SiLU-gated MLP) decoding 33 sequences: every projection of the
    step runs on tc_gemm, so the step is captured once and replayed (the SBI GEMV's 16 tokens made it eager before),
    with NumPy's greedy tokens."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.checkpoint.presets import PRESETS, PresetSource
    from hpcinfer.comm.group import Groups
    from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
    from hpcinfer.generate.schedules.pipeline import generate_batch
    from hpcinfer.model.transformer import Decoder

    arch = dataclasses.replace(PRESETS["tiny-dense"], norm="rmsnorm", position="rotary", rotary_dim=16,
                               tied_embeddings=False, num_kv_heads=2, gated_mlp=True, activation="silu",
                               qkv_bias=False, out_bias=False, mlp_bias=False)
    source, sequences, new_tokens = PresetSource("tiny-llama-f16", arch), 33, 3
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, arch.vocab_size, size=2).tolist() for _ in range(sequences)]

    def run(ops, graphs):
        model = Decoder(ops, Groups(), arch, dtype="float16").load(source)
        times = StepTimes()
        out = generate_batch(model, prompts, list(range(sequences)), GenerationParams(new_tokens, ignore_eos=True),
                             times, ScheduleParams(1, 1, None, graphs))
        return [tokens for tokens, _ in out], times, ops

    want, _, _ = run(NumpyOps(), False)
    got, times, ops = run(CupyOps(device=0, kernels=True), True)
    assert got == want
    assert times.graph_eager_steps == 0
    assert (times.graph_captures, times.graph_replays) == (1, new_tokens - 1)


@pytest.mark.parametrize("mode, group", [("int8", 64), ("int4", 32)])
@needs_emulator
@pytest.mark.exhaustive
def test_linear_q_routes_2_to_64_tokens_to_tensor_cores(emu_cupy, monkeypatch, mode, group):
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.quant.formats import quantize

    ops = CupyOps(device=0)
    kernels, real = [], ops._kernel
    monkeypatch.setattr(ops, "_kernel", lambda name, fn, **d: (kernels.append(fn), real(name, fn, **d))[1])
    rng = np.random.default_rng(9)
    qt = quantize((rng.standard_normal((40, 128)) / 11).astype(F32), mode, group)
    dq = ops.prepare_quantized(qt)
    bias = rng.standard_normal(40).astype(F32)
    for T, first in ((1, "quant_gemv"), (6, "tc_quant_gemm"), (65, "quant_dequant")):
        kernels.clear()
        x = rng.standard_normal((T, 128)).astype(F32)
        got = ops.to_host(ops.linear_q(ops.asarray(x), dq, ops.asarray(bias)))
        np.testing.assert_allclose(got, OPS.linear_q(x, qt, bias), rtol=1e-5, atol=1e-5)   # no weight rounded
        assert kernels[0] == first
