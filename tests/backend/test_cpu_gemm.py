"""The compiled small-batch GEMM (backend/cpu_kernels/gemm.py) against its NumPy twin (NumpyOps with cpu_kernels =
"numpy"): plain, with every fusion (norm before, bias / activation / gate-up / residual after), odd sizes, blocks of
rows ended part way and 1..64 tokens, int8 / q8_0 / asym8 / int4 / q4_1 weights (gemm_quant.py); batch invariance (a
token's row is the same bits alone or among others, at every place of a step); and the switch."""

import numpy as np
import pytest

from hpcinfer.backend.cpu_kernels import compiled, gemm, gemm_quant
from hpcinfer.backend.interface import NormParams
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.quant.formats import QuantizedTensor, quantize

REFERENCE = NumpyOps(threads=2, cpu_kernels="numpy")
KERNELS = NumpyOps(threads=2, cpu_kernels="numba")             # tiny products: one thread (gemm.THREAD_WORK)
SHAPES = [(1, 1), (5, 3), (13, 67), (64, 128), (33, 97)]          # (out, in): odd, tiny, row counts not of 4


@pytest.fixture(autouse=True)
def kernels_at_every_token_count(monkeypatch):
    """The kernels run whatever the crossover to BLAS (gemm.max_tokens) is, so that 1..64 tokens test them."""
    monkeypatch.setattr(gemm, "CROSSOVER", 64)
    monkeypatch.setattr(gemm, "QUANT_CROSSOVER", 64)


def data(tokens, rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return x, w, rng


def close(got, want):
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 17, 64])
def test_linear_matches_numpy(rows, cols, tokens):
    x, w, rng = data(tokens, rows, cols)
    bias = rng.standard_normal(rows).astype(np.float32)
    close(KERNELS.linear(x, w), REFERENCE.linear(x, w))
    close(KERNELS.linear(x, w, bias), REFERENCE.linear(x, w, bias))


def norms(cols, rng):
    weight, bias = rng.standard_normal(cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    return [None, NormParams("rmsnorm", weight, None, 1e-5), NormParams("layernorm", weight, bias, 1e-5),
            NormParams("layernorm", weight, None, 1e-6)]


@pytest.mark.parametrize("act", [None, "silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_fused_linear_matches_numpy(act, tokens):
    x, w, rng = data(tokens, 37, 70, seed=tokens)
    bias = rng.standard_normal(37).astype(np.float32)
    residual = rng.standard_normal((tokens, 37)).astype(np.float32)
    for norm in norms(70, rng):
        for b in (None, bias):
            for res in (None, residual):
                close(KERNELS.fused_linear(x, w, b, norm, act, residual=res),
                      REFERENCE.fused_linear(x, w, b, norm, act, residual=res))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_gated_fused_linear_matches_numpy(act, tokens):
    x, w, rng = data(tokens, 2 * 21, 40, seed=3)                   # [gate | up], F = 21 (not a multiple of 4)
    bias = rng.standard_normal(42).astype(np.float32)
    for norm in norms(40, rng)[:2]:
        for b in (None, bias):
            close(KERNELS.fused_linear(x, w, b, norm, act, gated=True),
                  REFERENCE.fused_linear(x, w, b, norm, act, gated=True))


@pytest.mark.parametrize("rows,cols", [(13, 67), (64, 128), (258, 512)])     # the last on 2 threads
def test_a_tokens_row_is_the_same_bits_alone_or_among_others(rows, cols):
    """Static and continuous batching put a token in steps of different sizes and at different places."""
    x, w, rng = data(8, rows, cols, seed=7)
    norm, bias = norms(cols, rng)[1], rng.standard_normal(rows).astype(np.float32)
    together = [KERNELS.linear(x, w), KERNELS.fused_linear(x, w, bias, norm, "silu"),
                KERNELS.fused_linear(x, np.concatenate([w, w[::-1]]), None, norm, "gelu", gated=True)]
    for t in range(8):
        alone = [KERNELS.linear(x[t:t + 1], w), KERNELS.fused_linear(x[t:t + 1], w, bias, norm, "silu"),
                 KERNELS.fused_linear(x[t:t + 1], np.concatenate([w, w[::-1]]), None, norm, "gelu", gated=True)]
        for a, b in zip(alone, together):
            assert np.array_equal(a[0], b[t]), t
        assert np.array_equal(KERNELS.linear(x[t:t + 3], w)[0], together[0][t])        # first of an odd step


@pytest.mark.parametrize("rows,cols", [(20, 576), (9, 1536), (5, 4097), (3, 7)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 16])
def test_blocks_of_rows_of_any_size(rows, cols, tokens):
    """gemm.py's blocks hold 4096 / I rows (7 of 576, 2 of 1536, 1 past 4096): outputs that end a block part way,
    in the plain, fused (residual) and gated kernels, against NumPy."""
    x, w, rng = data(tokens, 2 * rows, cols, seed=cols)
    bias = rng.standard_normal(2 * rows).astype(np.float32)
    residual = rng.standard_normal((tokens, 2 * rows)).astype(np.float32)
    norm = norms(cols, rng)[1]
    close(KERNELS.linear(x, w[:rows]), REFERENCE.linear(x, w[:rows]))
    close(KERNELS.fused_linear(x, w, bias, norm, "relu", residual=residual),
          REFERENCE.fused_linear(x, w, bias, norm, "relu", residual=residual))
    close(KERNELS.fused_linear(x, w, bias, norm, "silu", gated=True),
          REFERENCE.fused_linear(x, w, bias, norm, "silu", gated=True))


@pytest.mark.parametrize("cols", [1, 7, 16, 17, 63, 65, 576, 1000, 1536])
def test_a_token_sums_alike_in_either_place_of_a_pair(cols):
    """A token pair's two dots (gemm._dot2) and an odd last token (a pair with itself) give the same bits at every
    width, the vector loop's tails included: every token of steps of 1 to 5 tokens, at every place, against the
    token alone."""
    x, w, _ = data(6, 11, cols, seed=cols)
    alone = [KERNELS.linear(x[t:t + 1], w)[0] for t in range(6)]
    for size in range(2, 6):
        for start in range(0, 7 - size):
            step = KERNELS.linear(x[start:start + size], w)
            for place in range(size):
                assert np.array_equal(step[place], alone[start + place]), (size, start, place)


def test_numpy_setting_never_calls_the_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a compiled kernel ran under cpu_kernels = numpy")

    x, w, rng = data(4, 8, 16)
    norm = norms(16, rng)[1]
    want = [REFERENCE.linear(x, w), REFERENCE.fused_linear(x, w, None, norm, "silu", residual=x[:, :8])]
    for name in ("fused_gemm", "gemm", "gemm_gated", "normalized_rows"):
        monkeypatch.setattr(gemm, name, refuse)
    got = [REFERENCE.linear(x, w), REFERENCE.fused_linear(x, w, None, norm, "silu", residual=x[:, :8])]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(AssertionError, match="compiled kernel ran"):
        KERNELS.linear(x, w)                                         # the same call under numba does run them


def test_past_the_crossover_and_for_other_dtypes_blas_runs(monkeypatch):
    x, w, _ = data(9, 12, 16)
    monkeypatch.setattr(gemm, "max_tokens", lambda rows, cols, quantized=False: 8)
    monkeypatch.setattr(gemm, "fused_gemm", lambda *a, **k: pytest.fail("kernel past the crossover"))
    assert np.array_equal(KERNELS.linear(x, w), REFERENCE.linear(x, w))
    assert np.array_equal(KERNELS.linear(x[:2], w.astype(np.float16)), REFERENCE.linear(x[:2], w.astype(np.float16)))
    qt = quantize(np.ones((12, 64), np.float32), "int8")
    monkeypatch.setattr(gemm_quant, "gemm_q", lambda *a: pytest.fail("quantized kernel past the crossover"))
    assert np.array_equal(KERNELS.linear_q(np.ones((9, 64), np.float32), qt),
                          REFERENCE.linear_q(np.ones((9, 64), np.float32), qt))


def test_small_products_run_on_fewer_threads(monkeypatch):
    asked = []
    monkeypatch.setattr(gemm.numba, "set_num_threads", asked.append)
    gemm.use_threads(2, 10)
    gemm.use_threads(2, 1 << 30)
    assert asked == [1, min(2, gemm.numba.config.NUMBA_NUM_THREADS)]


def test_warm_up_measures_the_cold_start_once():
    compiled.warm_up.cache_clear()
    first = compiled.warm_up()
    assert compiled.warm_up() is first and first.seconds > 0
    assert "cache" in first.describe() and f"{first.seconds:.2f} s" in first.describe()
    assert NumpyOps(cpu_kernels="numba").kernel_warm_up is first and NumpyOps().kernel_warm_up is None


def quantized(w, mode, group):
    """w quantized in `mode` (q4_1: int4 in groups of 32 relabelled, as a GGUF's kept blocks are)."""
    if mode == "q4_1":
        q = quantize(w, "int4", 32)
        return QuantizedTensor("q4_1", q.q, q.scale, q.min, 32)
    return quantize(w, mode, group)


@pytest.mark.parametrize("mode,group", [("int8", 0), ("q8_0", 32), ("asym8", 16), ("int4", 64), ("int4", 32),
                                        ("q4_1", 32)])
@pytest.mark.parametrize("rows,cols,tokens", [(13, 128, 1), (64, 256, 5), (33, 192, 8), (6, 64, 64)])
def test_quantized_linear_matches_numpy(mode, group, rows, cols, tokens):
    x, w, rng = data(tokens, rows, cols, seed=rows)
    qt = quantized(w, mode, group or 64)
    bias = rng.standard_normal(rows).astype(np.float32)
    close(KERNELS.linear_q(x, qt), REFERENCE.linear_q(x, qt))
    close(KERNELS.linear_q(x, qt, bias), REFERENCE.linear_q(x, qt, bias))


@pytest.mark.parametrize("mode,group", [("int8", 0), ("q8_0", 32), ("asym8", 16), ("int4", 64), ("q4_1", 32)])
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 192), (21, 128)])
def test_one_token_matches_numpy(mode, group, rows, cols):
    """1 token (a decode step) computes no padding token: every output against the NumPy twin."""
    x, w, rng = data(1, rows, cols, seed=cols)
    qt = quantized(w, mode, group or 64)
    bias = rng.standard_normal(rows).astype(np.float32)
    close(KERNELS.linear_q(x, qt), REFERENCE.linear_q(x, qt))
    close(KERNELS.linear_q(x, qt, bias), REFERENCE.linear_q(x, qt, bias))


@pytest.mark.parametrize("rows,cols", [(5, 1), (13, 67), (33, 97), (4, 1000)])
def test_int8_rows_of_any_width(rows, cols):
    """int8's one group is the whole row: widths that are no multiple of the vector lanes (the dot's tails)."""
    x, w, _ = data(5, rows, cols, seed=cols)
    qt = quantize(w, "int8")
    together = KERNELS.linear_q(x, qt)
    close(together, REFERENCE.linear_q(x, qt))
    for t in range(5):
        assert np.array_equal(KERNELS.linear_q(x[t:t + 1], qt)[0], together[t]), t


@pytest.mark.parametrize("mode,group", [("int8", 0), ("q8_0", 32), ("asym8", 64), ("int4", 32), ("q4_1", 32)])
@pytest.mark.parametrize("rows,cols", [(21, 128), (40, 576), (3, 1536)])
def test_quantized_rows_are_batch_invariant(mode, group, rows, cols):
    x, w, rng = data(16, rows, cols, seed=5)
    qt, bias = quantized(w, mode, group or 64), rng.standard_normal(rows).astype(np.float32)
    together = KERNELS.linear_q(x, qt, bias)
    for t in range(16):
        assert np.array_equal(KERNELS.linear_q(x[t:t + 1], qt, bias)[0], together[t]), t
        assert np.array_equal(KERNELS.linear_q(x[t:t + 3], qt, bias)[0], together[t]), t     # first of 3


def test_quantized_numpy_setting_never_calls_the_kernels(monkeypatch):
    x, w, _ = data(3, 8, 64)
    qt = quantize(w, "int4", 32)
    want = REFERENCE.linear_q(x, qt)
    monkeypatch.setattr(gemm_quant, "gemm_q", lambda *a: pytest.fail("a kernel ran under cpu_kernels = numpy"))
    assert np.array_equal(REFERENCE.linear_q(x, qt), want)
