"""Every CupyOps op against its NumpyOps twin (the spec), CUDA graphs of a decode step, and SmolLM2 end to end.
Each op test runs twice: with the cuda_src/ kernels, and with the plain CuPy code they fall back to.

GPU only: skipped, with the reason, where cupy sees no GPU. Every run draws a fresh seed (named in any failure
message). Before each op runs, CuPy's memory pool is filled with NaN and handed back, so the op's fresh outputs
start as NaN (not with HPCINFER_SANITIZE=1: under compute-sanitizer the pool is off, every array its own
allocation, so that memcheck sees an access past it); the KV positions an attention call must append are NaN in its cache before the call, and cache
positions it must not read are NaN too. An op that skips part of its output, or reads past what it should, fails.

Tolerances (|got - want| <= tol * (|want| + max |want|)), by the storage dtype of weights and tables (compute is
float32 everywhere): float32 1e-5, float16 2e-3, bfloat16 2e-2. Integer outputs, routing tables, copies: exact.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.backend import moe_ops
from hpcinfer.backend.cupy_ops import gpu_available
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.parallel.layers import weight_dtype


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU visible to cupy "
                                                             "(cupy missing, or cupy.is_available() is False)")]

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(os.environ.get("HPCINFER_SMOLLM2") or REPO / "models" / "smollm2.h5")   # gpu-check: the carried one
NUMPY = NumpyOps()
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
POISON_BYTES = 256 << 20
# Under compute-sanitizer (make gpu-check's memcheck step): CuPy's memory pool off, so that every array is its own
# cudaMalloc and an access past it is seen, and no poison block (later arrays would be carved out of it).
SANITIZE = os.environ.get("HPCINFER_SANITIZE") == "1"


@pytest.fixture(scope="module", autouse=True)
def allocator_for_the_sanitizer():
    if not SANITIZE:
        yield
        return
    import cupy

    cupy.cuda.set_allocator(None)
    yield
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


@pytest.fixture(scope="module", params=["kernels", "plain-cupy"])
def gpu(request):
    """CupyOps launching the cuda_src/ kernels, and CupyOps with plain CuPy code only (its fallback): both are
    held to NumPy, so a failure names the path that is wrong."""
    from hpcinfer.backend.cupy_ops import CupyOps

    return CupyOps(device=0, kernels=request.param == "kernels")


# ------------------------------------------------------------------------------------------------- the cases

@dataclass
class Case:
    op: str
    args: tuple
    storage: str = "float32"     # dtype of the stored operands (weights, tables): picks the tolerance
    inplace: tuple = ()          # positions of arguments the op writes (compared after the call)
    host: tuple = ()             # positions of array arguments the GPU op gets as host arrays (index lists)
    exact: bool = False
    kwargs: dict = field(default_factory=dict)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def stored(array, dtype: str):
    return array.astype(weight_dtype(dtype))


def linear_case(tokens, bias=True):
    def build(rng, dtype):
        x, w = randn(rng, tokens, 96), stored(randn(rng, 40, 96, scale=0.2), dtype)
        return Case("linear", (x, w, randn(rng, 40) if bias else None), storage=dtype)
    return build


def embedding_case(rng, dtype):
    table = stored(randn(rng, 50, 24), dtype)
    ids = rng.integers(0, 50, 11).astype(np.int64)
    ids[3] = ids[7]                                           # a repeated id
    return Case("embedding", (table, ids), storage=dtype, host=(1,))


def attention_case(slots, starts, counts, heads=4, kv_heads=2, hd=16, n_slots=6, lmax=48):
    def build(rng, dtype):
        step = StepLayout.build(slots, starts, counts)
        T = step.num_tokens
        q, k, v = randn(rng, T, heads, hd), randn(rng, T, kv_heads, hd), randn(rng, T, kv_heads, hd)
        caches = []
        for _ in range(2):
            cache = np.full((n_slots, kv_heads, lmax, hd), np.nan, dtype=np.float32)   # unread: NaN
            used = int((step.starts + step.counts).max())
            for slot in step.slots:
                cache[slot, :, :used] = randn(rng, kv_heads, used, hd)
            for slot, start, count in zip(step.slots, step.starts, step.counts):
                cache[slot, :, start:start + count] = np.nan                            # to be appended
            caches.append(cache)
        return Case("attention", (q, k, v, caches[0], caches[1], step, 0.3), inplace=(3, 4))
    return build


def encoder_attention_case(counts, heads=4, hd=16):
    """Encoder attention over packed whole sequences (no cache): ragged counts mask the padded keys; hd > 128
    takes CupyOps's CuPy fallback even with kernels. NumpyOps (the spec) takes q, k and v with the same heads."""
    def build(rng, dtype):
        step = StepLayout.build(np.arange(len(counts)), np.zeros(len(counts)), counts)
        q, k, v = (randn(rng, step.num_tokens, heads, hd) for _ in range(3))
        return Case("bidirectional_attention", (q, k, v, step, 1.0 / np.sqrt(hd)))
    return build


def gating_case(k, normalize):
    def build(rng, dtype):
        return Case("top_k_gating", (randn(rng, 33, 8, scale=2.0), k, normalize))
    return build


def _routing(rng, tokens=20, experts=6, k=2, capacity=None):
    chosen, weights = moe_ops.top_k_gating(randn(rng, tokens, experts, scale=2.0), k, "topk")
    return moe_ops.route(chosen, weights, experts, capacity), chosen, weights


def route_case(capacity):
    def build(rng, dtype):
        _, chosen, weights = _routing(rng)
        return Case("route", (chosen, weights, 6, capacity), exact=True)
    return build


def unpermute_case(capacity):
    def build(rng, dtype):
        routing, _, _ = _routing(rng, capacity=capacity)
        return Case("unpermute", (randn(rng, routing.num_rows, 24), routing, 20))
    return build


def permute_case(rng, dtype):
    routing, _, _ = _routing(rng, capacity=4)
    return Case("permute", (randn(rng, 20, 24), routing), exact=True)


def scatter_add_case(rng, dtype):
    index = rng.integers(0, 9, 30).astype(np.int64)          # repeats
    return Case("scatter_add_rows", (randn(rng, 9, 24), index, randn(rng, 30, 24)), inplace=(0,), host=(1,))


def rotary_case(rotary_dim):
    def build(rng, dtype):
        angles = rng.uniform(0, 6, (6, rotary_dim // 2))
        return Case("rotary", (randn(rng, 6, 5, 16), np.cos(angles).astype(np.float32),
                               np.sin(angles).astype(np.float32), rotary_dim))
    return build


KINDS = ("gelu", "gelu_tanh", "relu", "silu")
CASES = {
    **{f"linear-T{t}": (linear_case(t), tuple(TOLERANCE)) for t in (1, 7, 16, 17, 64)},
    "linear-nobias": (linear_case(5, bias=False), tuple(TOLERANCE)),
    "embedding": (embedding_case, tuple(TOLERANCE)),
    "layer_norm": (lambda rng, dt: Case("layer_norm", (randn(rng, 7, 48, scale=3) + 1, randn(rng, 48),
                                                       randn(rng, 48), 1e-5)), ("float32",)),
    "layer_norm-nobias": (lambda rng, dt: Case("layer_norm", (randn(rng, 7, 48, scale=3), randn(rng, 48), None,
                                                              1e-5)), ("float32",)),
    "rms_norm": (lambda rng, dt: Case("rms_norm", (randn(rng, 7, 48, scale=3), randn(rng, 48), 1e-6)),
                 ("float32",)),
    **{f"activation-{kind}": ((lambda kind: lambda rng, dt: Case("activation", (randn(rng, 5, 70, scale=4), kind)))
                              (kind), ("float32",)) for kind in KINDS},
    **{f"gated-{kind}": ((lambda kind: lambda rng, dt: Case("gated_activation", (randn(rng, 5, 80, scale=4), kind)))
                         (kind), ("float32",)) for kind in KINDS},
    "rotary-full": (rotary_case(16), ("float32",)),
    "rotary-partial": (rotary_case(8), ("float32",)),
    "attention-decode-contiguous": (attention_case([0, 1, 2], [9, 9, 9], [1, 1, 1]), ("float32",)),
    "attention-decode-scattered": (attention_case([4, 1, 3], [5, 17, 30], [1, 1, 1]), ("float32",)),
    "attention-decode-gqa4": (attention_case([2, 0], [3, 11], [1, 1], heads=8, kv_heads=2), ("float32",)),
    "attention-prefill": (attention_case([2, 0], [0, 0], [7, 3]), ("float32",)),
    "attention-prefill-continued": (attention_case([1, 5], [5, 0], [4, 6]), ("float32",)),
    "attention-prefill-mha": (attention_case([3], [0], [9], heads=4, kv_heads=4), ("float32",)),
    "attention-mixed": (attention_case([0, 2], [6, 0], [1, 5]), ("float32",)),
    "encoder-attention-ragged": (encoder_attention_case([7, 3, 12]), ("float32",)),
    "encoder-attention-equal": (encoder_attention_case([9, 9]), ("float32",)),
    "encoder-attention-one": (encoder_attention_case([1, 5], heads=2), ("float32",)),
    "encoder-attention-hd160": (encoder_attention_case([6, 4], heads=2, hd=160), ("float32",)),
    "argmax": (lambda rng, dt: Case("argmax", (randn(rng, 4, 1000),), exact=True), ("float32",)),
    "softmax": (lambda rng, dt: Case("softmax", (randn(rng, 6, 11, scale=5),)), ("float32",)),
    "top_k_gating-k1-none": (gating_case(1, "none"), ("float32",)),
    "top_k_gating-k2-topk": (gating_case(2, "topk"), ("float32",)),
    "top_k_gating-k3-topk": (gating_case(3, "topk"), ("float32",)),
    "route": (route_case(None), ("float32",)),
    "route-capacity": (route_case(3), ("float32",)),
    "permute": (permute_case, ("float32",)),
    "unpermute": (unpermute_case(None), ("float32",)),
    "unpermute-drops": (unpermute_case(3), ("float32",)),
    "scatter_add_rows": (scatter_add_case, ("float32",)),
    "asarray": (lambda rng, dt: Case("asarray", (stored(randn(rng, 3, 17), dt),), storage=dt, host=(0,),
                                     exact=True), tuple(TOLERANCE)),
    "zeros": (lambda rng, dt: Case("zeros", ((4, 5), weight_dtype(dt)), storage=dt, exact=True), tuple(TOLERANCE)),
}
PARAMS = [pytest.param(name, dtype, id=f"{name}-{dtype}") for name, (_, dtypes) in CASES.items() for dtype in dtypes]


# -------------------------------------------------------------------------------------------------- the test

@pytest.mark.parametrize("name, dtype", PARAMS)
def test_op_matches_numpy(gpu, name, dtype):
    seed = secrets.randbits(63)
    case = CASES[name][0](np.random.default_rng(seed), dtype)
    what = f"{name} ({dtype} storage, seed {seed})"
    host_args = [a.copy() if isinstance(a, np.ndarray) else a for a in case.args]
    device_args = [gpu.asarray(a) if isinstance(a, np.ndarray) and i not in case.host else a
                   for i, a in enumerate(case.args)]

    want = getattr(NUMPY, case.op)(*host_args, **case.kwargs)
    poison_device_memory(gpu.xp)
    got = getattr(gpu, case.op)(*device_args, **case.kwargs)

    tol = 0.0 if case.exact else TOLERANCE[case.storage]
    assert_same(gpu, got, want, tol, what)
    for i in case.inplace:
        assert_same(gpu, device_args[i], host_args[i], tol, f"{what}, argument {i} after the call")


def poison_device_memory(cp):
    """Fill CuPy's pool with NaN and give it back: the next allocations reuse (parts of) that block. Not under
    the sanitizer (SANITIZE), where there is no pool to fill."""
    if SANITIZE:
        return
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    junk = cp.full(POISON_BYTES // 4, np.nan, dtype=np.float32)
    cp.cuda.get_current_stream().synchronize()
    del junk


def assert_same(gpu, got, want, tol: float, what: str):
    if want is None:
        assert got is None, what
        return
    if isinstance(want, moe_ops.Routing):
        assert isinstance(got, moe_ops.Routing), f"{what}: got {type(got).__name__}"
        for f in dataclasses.fields(want):
            assert_same(gpu, getattr(got, f.name), getattr(want, f.name), 0.0, f"{what}: Routing.{f.name}")
        return
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            integer = np.asarray(w).dtype.kind in "iub"
            assert_same(gpu, g, w, 0.0 if integer else tol, f"{what}: output {i}")
        return
    got, want = gpu.to_host(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if want.dtype.name == "bfloat16":
        got, want = got.view(np.uint16), want.view(np.uint16)
    if tol == 0.0 or want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    finite = want[np.isfinite(want)]
    scale = float(np.abs(finite).max()) if finite.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


# -------------------------------------------------------------------------------------------- memory, dtypes

@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_storage_round_trips_and_stays_in_its_dtype(gpu, dtype):
    host = stored(randn(np.random.default_rng(), 8, 5), dtype)
    device = gpu.asarray(host)
    assert device.nbytes == host.nbytes                       # half precision stays half on the device
    back = gpu.to_host(device)
    assert back.dtype == host.dtype
    np.testing.assert_array_equal(back.view(np.uint8), host.view(np.uint8))
    np.testing.assert_array_equal(gpu.to_host(gpu._f32(device)), host.astype(np.float32))


def test_asarray_converts_on_the_device_with_rounding_as_ml_dtypes(gpu):
    x = randn(np.random.default_rng(), 1000, scale=100)
    x[:3] = [np.nan, np.inf, -0.0]
    bf16 = gpu.asarray(gpu.asarray(x), dtype=weight_dtype("bfloat16"))
    np.testing.assert_array_equal(gpu.to_host(bf16).view(np.uint16)[1:],
                                  x.astype(weight_dtype("bfloat16")).view(np.uint16)[1:])
    assert np.isnan(gpu.to_host(bf16)[0].astype(np.float32))


# ---------------------------------------------------------------------------------------------- CUDA graphs

def test_decode_graph_replays_with_new_inputs_and_matches_eager(gpu):
    """A decode-shaped step (norm, linear, attention over the cache, linear) captured once for (batch 3, bucket
    64) and replayed at other positions, slots and inputs of the same key: the same as running it eagerly."""
    from hpcinfer.backend.cupy_graphs import DecodeGraph

    cp, rng = gpu.xp, np.random.default_rng()
    S, D, heads, kv_heads, hd, lmax = 3, 32, 4, 2, 8, 80
    w_qkv = gpu.asarray(randn(rng, (heads + 2 * kv_heads) * hd, D, scale=0.2))
    w_out = gpu.asarray(randn(rng, D, heads * hd, scale=0.2))
    norm = gpu.asarray(randn(rng, D))

    def step_fn(inputs, step, cache_k, cache_v):
        h = gpu.linear(gpu.rms_norm(inputs["x"], norm, 1e-5), w_qkv)
        q = h[:, :heads * hd].reshape(S, heads, hd)
        k = h[:, heads * hd:(heads + kv_heads) * hd].reshape(S, kv_heads, hd)
        v = h[:, (heads + kv_heads) * hd:].reshape(S, kv_heads, hd)
        return gpu.linear(gpu.attention(q, k, v, cache_k, cache_v, step, 0.35), w_out)

    cache = [gpu.asarray(randn(rng, 5, kv_heads, lmax, hd)) for _ in range(2)]
    eager_cache = [c.copy() for c in cache]
    graph = DecodeGraph(gpu)
    for slots, starts in (([0, 1, 2], [3, 40, 7]), ([4, 2, 0], [10, 63, 5]), ([1, 3, 2], [0, 0, 61])):
        x = randn(rng, S, D)
        got = graph(lambda inputs, step: step_fn(inputs, step, *cache), {"x": x}, slots, starts)
        want = step_fn({"x": gpu.asarray(x)}, StepLayout.build(slots, starts, [1] * S), *eager_cache)
        np.testing.assert_allclose(gpu.to_host(got), gpu.to_host(want), rtol=1e-5, atol=1e-5)
        for c, e in zip(cache, eager_cache):
            np.testing.assert_array_equal(gpu.to_host(c), gpu.to_host(e))
    if gpu.kernels:
        assert list(graph.captured) == [(3, 64)] and not graph.eager_keys
    else:                                     # the plain path's matmuls are cuBLAS, which CuPy cannot capture
        assert not graph.captured and list(graph.eager_keys) == [(3, 64)] and graph.eager_steps == 3
    cp.cuda.get_current_stream().synchronize()


def test_a_step_whose_capture_fails_runs_eagerly(gpu):
    """A step that calls cuBLAS behind CupyOps' back (not counted in library_calls) passes its warm-up, then CuPy
    refuses it under capture: the graph ends the capture, the key runs eagerly from then on, and every output is
    the eager one: a graph never ends a job."""
    from hpcinfer.backend.cupy_graphs import DecodeGraph

    cp, rng = gpu.xp, np.random.default_rng()
    w = gpu.asarray(randn(rng, 8, 8))
    graph = DecodeGraph(gpu)
    for starts in ([3, 5], [4, 6]):
        x = randn(rng, 2, 8)
        got = graph(lambda inputs, step: cp.matmul(gpu.asarray(inputs["x"]), w), {"x": x}, [0, 1], starts)
        np.testing.assert_allclose(gpu.to_host(got), x @ gpu.to_host(w), rtol=1e-5, atol=1e-5)
    assert not graph.captured and graph.captures == 0
    assert "capturing it failed: NotImplementedError" in graph.eager_keys[(2, 64)] and graph.eager_steps == 2
    assert not cp.cuda.get_current_stream().is_capturing() and not graph.stream.is_capturing()


# ---------------------------------------------------------------------------------------------- end to end

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "2 + 2 =")


@pytest.fixture(scope="module")
def smollm2_prompts():
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is missing: `make model` and `make demo` (or the convert step of the Makefile)")
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.generate.tokenizer import TextTokenizer

    with open_checkpoint(str(SMOLLM2)) as ckpt:
        tokenizer = TextTokenizer.from_checkpoint(ckpt)
    return [tokenizer.encode_chat(text) for text in PROMPTS]


def test_smollm2_float32_greedy_tokens_equal_numpy(smollm2_prompts):
    from hpcinfer.api import generate, load_model, prompt_logits

    cpu, gpu_model = load_model(str(SMOLLM2), backend="numpy"), load_model(str(SMOLLM2), backend="cupy")
    want, got = prompt_logits(cpu, smollm2_prompts), prompt_logits(gpu_model, smollm2_prompts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert generate(gpu_model, smollm2_prompts, 24) == generate(cpu, smollm2_prompts, 24)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_smollm2_half_precision_agrees_with_numpy_for_the_first_tokens(smollm2_prompts, dtype):
    """Same storage dtype on both backends: logits within the dtype's tolerance of the largest logit, and the
    first 4 greedy tokens equal."""
    from hpcinfer.api import generate, load_model, prompt_logits

    cpu = load_model(str(SMOLLM2), dtype=dtype, backend="numpy")
    gpu_model = load_model(str(SMOLLM2), dtype=dtype, backend="cupy")
    want, got = prompt_logits(cpu, smollm2_prompts), prompt_logits(gpu_model, smollm2_prompts)
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()
    assert generate(gpu_model, smollm2_prompts, 4) == generate(cpu, smollm2_prompts, 4)


def test_cli_run_with_the_cupy_backend_writes_the_numpy_results(run_cli, tmp_path, smollm2_prompts):
    """`hpcinfer run` on one rank: backend cupy (comm auto: NCCL groups of one rank) gives numpy's tokens."""
    import json

    import cupy

    if getattr(cupy, "_emulated", False):
        pytest.skip("the CPU stand-in of cupy lives in this process only, not in the `hpcinfer run` it starts")

    outputs = {}
    for backend in ("numpy", "cupy"):
        out = tmp_path / f"{backend}.jsonl"
        result = run_cli(["run", REPO / "inputs" / "demo.toml", "--set", f"model.checkpoint={SMOLLM2}",
                          "--set", f"runtime.backend={backend}",
                          "--set", "generate.max_new_tokens=12", "--set", f"generate.output={out}",
                          "--set", f"generate.metrics={tmp_path / f'{backend}.json'}"], timeout=300, cwd=REPO)
        assert result.returncode == 0, result.stderr
        outputs[backend] = [json.loads(line)["output_tokens"] for line in out.read_text().splitlines()]
    assert outputs["cupy"] == outputs["numpy"]
