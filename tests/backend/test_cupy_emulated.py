"""The CuPy backend with no GPU: CupyOps on tests/helpers/emu_cupy/ (a fake cupy over NumPy whose RawModule and
ElementwiseKernel run the real cuda_src/ kernels and snippets on the CPU kernel emulator).

1. The op cases of tests/backend/test_cupy_ops.py (imported, not copied), with its tolerances, for CupyOps with the
   kernels and with its plain-CuPy fallback, against NumpyOps; its dtype round trips.
2. CUDA graphs: test_cupy_ops' DecodeGraph test (capture, replay at new positions = eager), a step that cannot
   be captured (cuBLAS, a host upload) runs eagerly with its reason kept, and the fake's graph semantics (replay =
   same memory, same baked scalars; views unrecorded; syncs and cuBLAS inside capture refused as CuPy does).
3. End to end: the tiny presets generate the same greedy tokens with CupyOps on the fake as with NumpyOps.
4. The fake's own refusals, so that the checks above mean something: kernel argument types and sizes, writes past
   an allocation, compile errors, ElementwiseKernel dtypes, host arrays in device math, dtypes cupy lacks.
Skipped, with the reason, where the kernel emulator cannot build (no g++ or CUDA headers). About 35 s on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest

import emu_cupy as emu
import test_cupy_ops as gpu_cases
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")


@pytest.fixture(scope="module", params=["kernels", "plain-cupy"])
def emu_gpu(request):
    """CupyOps(device=0) on the fake cupy: with the cuda_src/ kernels, and with plain CuPy code only."""
    with emu.installed():
        from hpcinfer.backend.cupy_ops import CupyOps

        yield CupyOps(device=0, kernels=request.param == "kernels")


@pytest.fixture
def small_poison(monkeypatch):
    """test_cupy_ops fills 256 MiB of pool with NaN before each op; the fake's cp.empty starts as NaN already."""
    monkeypatch.setattr(gpu_cases, "POISON_BYTES", 4096)


# ------------------------------------------------------------------------------------------------- 1. ops

@pytest.mark.parametrize("name, dtype", gpu_cases.PARAMS)
def test_op_matches_numpy(emu_gpu, small_poison, name, dtype):
    gpu_cases.test_op_matches_numpy(emu_gpu, name, dtype)


@pytest.mark.parametrize("dtype", list(gpu_cases.TOLERANCE))
def test_storage_round_trips_and_stays_in_its_dtype(emu_gpu, dtype):
    gpu_cases.test_storage_round_trips_and_stays_in_its_dtype(emu_gpu, dtype)


def test_asarray_converts_on_the_device_with_rounding_as_ml_dtypes(emu_gpu):
    gpu_cases.test_asarray_converts_on_the_device_with_rounding_as_ml_dtypes(emu_gpu)


def test_make_ops_builds_cupy_ops_on_the_fake(emu_gpu):
    from hpcinfer.backend.ops import make_ops

    ops = make_ops("cupy", 0)
    assert ops.name == "cupy" and ops.xp is emu_gpu.xp and ops.device_id == 0
    assert make_ops("auto").name == "cupy"      # auto: cupy when a GPU is visible


# ---------------------------------------------------------------------------------------------- 2. graphs

def test_decode_graph_replays_with_new_inputs_and_matches_eager(emu_gpu):
    gpu_cases.test_decode_graph_replays_with_new_inputs_and_matches_eager(emu_gpu)


def test_a_step_whose_capture_fails_runs_eagerly(emu_gpu):
    gpu_cases.test_a_step_whose_capture_fails_runs_eagerly(emu_gpu)


def test_a_host_upload_inside_the_capture_makes_the_key_eager(emu_gpu):
    """A step that uploads a host array at every call cannot be captured (CUDA refuses the copy): the key runs
    eagerly, with the reason kept, and the outputs are the eager ones; the stream is out of capture mode."""
    from hpcinfer.backend.cupy_graphs import DecodeGraph

    gpu, rng = emu_gpu, np.random.default_rng(0)
    w = gpu.asarray(gpu_cases.randn(rng, 8, 8))
    bias = gpu_cases.randn(rng, 8)                               # a host array, uploaded at every call

    def step_fn(inputs, step):
        return gpu.linear(gpu.asarray(inputs["x"]), w, gpu.asarray(bias))

    graph = DecodeGraph(gpu)
    for starts in ([3, 4], [5, 6]):
        x = gpu_cases.randn(rng, 2, 8)
        got = graph(step_fn, {"x": x}, [0, 1], starts)
        np.testing.assert_allclose(gpu.to_host(got), x @ gpu.to_host(w).T + bias, rtol=1e-5, atol=1e-5)
    why = graph.eager_keys[(2, 64)]
    if gpu.kernels:
        assert "cudaErrorStreamCaptureUnsupported" in why and "host -> device" in why, why
    else:
        assert "calls cuBLAS" in why, why                      # the plain linear: found before any capture
    assert not graph.captured and graph.eager_steps == 2
    assert not graph.stream.is_capturing()
    gpu.xp.cuda.get_current_stream().synchronize()               # the capture is over: syncs work again


@pytest.mark.parametrize("call", ["matmul", "operator", "dot", "ndarray.dot", "einsum", "tensordot"])
def test_cublas_inside_a_capture_is_refused_as_cupy_does(emu_gpu, call):
    """CuPy 14 raises NotImplementedError for any cuBLAS call on a capturing stream (cublas.setStream), before
    the library runs: the capture is still valid and ends normally. Outside a capture the same calls work."""
    cp = emu_gpu.xp
    a = cp.asarray(np.eye(3, dtype=np.float32))
    calls = {"matmul": lambda: cp.matmul(a, a), "operator": lambda: a @ a, "dot": lambda: cp.dot(a, a),
             "ndarray.dot": lambda: a.dot(a), "einsum": lambda: cp.einsum("ij,jk->ik", a, a),
             "tensordot": lambda: cp.tensordot(a, a, axes=1)}
    np.testing.assert_array_equal(cp.asnumpy(calls[call]()), np.eye(3))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        b = a + 1                                                # recorded
        with pytest.raises(NotImplementedError, match="calling cuBLAS API during stream capture"):
            calls[call]()
        graph = stream.end_capture()
    assert len(graph) == 1 and int(b[0, 0]) == 2


def test_graph_replay_uses_the_captured_memory_and_scalars(emu_gpu):
    """What a CUDA graph does, and the fake with it: replay rereads the same buffers, keeps the host scalars of
    capture time, and writes into the outputs allocated at capture."""
    cp = emu_gpu.xp
    x = cp.asarray(np.arange(6, dtype=np.float32))
    scale = np.float32(2.0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        y = x * scale                                            # recorded: a new output buffer
        view = y.reshape(2, 3)[:, 1]                             # a view: not recorded, shares y's memory
        z = cp.empty(2, dtype=np.float32)
        z[...] = view + 1                                        # recorded
        graph = stream.end_capture()
    assert len(graph) == 3                                       # multiply, add, setitem
    x.set(np.full(6, 10, dtype=np.float32))
    scale = np.float32(5.0)                                      # a new host value: the graph keeps 2.0
    graph.launch(stream=cp.cuda.get_current_stream())
    np.testing.assert_array_equal(y.get(), np.full(6, 20, dtype=np.float32))
    np.testing.assert_array_equal(z.get(), [21, 21])
    np.testing.assert_array_equal(view.get(), [20, 20])
    assert scale == 5.0


@pytest.mark.parametrize("sync", ["get", "int", "bool", "asarray", "synchronize", "host-index"])
def test_host_syncs_inside_a_capture_fail_and_invalidate_it(emu_gpu, sync):
    cp = emu_gpu.xp
    x = cp.asarray(np.arange(4, dtype=np.float32))
    actions = {"get": lambda: x.get(), "int": lambda: int(x[0]), "bool": lambda: bool(x[0] > 1),
               "asarray": lambda: cp.asarray(np.ones(4)), "synchronize": lambda: cp.cuda.Stream.null.synchronize(),
               "host-index": lambda: x[np.array([0, 2])]}
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorStreamCapture"):
            actions[sync]()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            stream.end_capture()
    assert int(x[1]) == 1                                        # fine again outside the capture


def test_work_on_another_stream_during_a_capture_fails(emu_gpu):
    cp = emu_gpu.xp
    x = cp.zeros(3, dtype=np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.begin_capture()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorStreamCaptureImplicit"):
        x + 1                                                    # the current stream is the null stream
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
        stream.end_capture()


def test_the_fake_keeps_host_and_device_apart(emu_gpu):
    cp = emu_gpu.xp
    d = cp.asarray(np.ones(3, dtype=np.float32))
    assert isinstance(d, cp.ndarray) and not isinstance(d, np.ndarray)
    assert not isinstance(np.ones(3), cp.ndarray)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(d)
    with pytest.raises(TypeError, match="host NumPy array"):
        d + np.ones(3, dtype=np.float32)
    with pytest.raises(TypeError, match="host NumPy array"):
        cp.concatenate([d, np.ones(3, dtype=np.float32)])
    assert isinstance(np.exp(d), cp.ndarray) and isinstance(d.sum(), cp.ndarray)   # 0-d device array
    assert np.isnan(cp.empty(4, dtype=np.float32).get()).all()


def test_kernel_launches_check_argument_types(emu_gpu):
    from hpcinfer.kernels.loader import kernel

    cp = emu_gpu.xp
    fn = kernel("activation", "activation", {"T_STORAGE": "float", "T_ACT": "float", "ACT": 3, "BLOCK": 64})
    x = cp.asarray(np.array([-1, 2, -3, 4], dtype=np.float32))
    y = cp.empty(4, dtype=np.float32)
    fn((1,), (64,), (x, y, np.int64(4)))
    np.testing.assert_array_equal(y.get(), [0, 2, 0, 4])
    with pytest.raises(TypeError, match="int32"):
        fn((1,), (64,), (x, y, np.int32(4)))                     # long long n: 8 bytes
    fn((1,), (64,), (x, y, 4))                                  # a Python int goes as int64: right here
    with pytest.raises(TypeError, match="int64"):
        fn((1,), (64,), (x, cp.empty(4, dtype=np.int64), np.int64(4)))   # float* y
    with pytest.raises(TypeError, match="host array"):
        fn((1,), (64,), (x, np.empty(4, dtype=np.float32), np.int64(4)))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        fn((1,), (64,), (x, y))


# ------------------------------------------------------------------------------------------- 3. end to end

@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_tiny_preset_greedy_tokens_equal_numpy(emu_gpu, preset):
    from hpcinfer.api import generate, prompt_logits
    from hpcinfer.checkpoint.presets import PRESETS, open_preset
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.transformer import Decoder

    prompts = [[1, 2, 3, 4, 5], [200, 7], [42] * 11]
    cpu = Decoder(NumpyOps(), Groups(), PRESETS[preset]).load(open_preset(preset))
    gpu = Decoder(emu_gpu, Groups(), PRESETS[preset]).load(open_preset(preset))
    want, got = prompt_logits(cpu, prompts), prompt_logits(gpu, prompts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert generate(gpu, prompts, 6) == generate(cpu, prompts, 6)


def test_the_fake_refuses_what_cupy_refuses(emu_gpu):
    import ml_dtypes

    cp = emu_gpu.xp
    with pytest.raises(TypeError, match="Unsupported dtype"):
        cp.asarray(np.ones(3, dtype=ml_dtypes.bfloat16))        # CupyOps.asarray uploads the uint16 bits instead
    x = cp.asarray(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(x[x > 1].get(), [2, 3])       # outside a capture: fine
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="boolean mask"):
            x[x > 1]
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
            stream.end_capture()


def test_nccl_is_unavailable_on_the_fake(emu_gpu):
    from hpcinfer.comm.nccl_group import nccl_available

    assert not nccl_available()


def test_compile_errors_and_elementwise_type_checks(emu_gpu):
    cp = emu_gpu.xp
    bad = cp.RawModule(code='extern "C" __global__ void broken(float* x) { x[0] = not_declared; }',
                       options=("-std=c++17",))
    with pytest.raises(cp.cuda.compiler.CompileException, match="not_declared"):
        bad.compile()
    scale = cp.ElementwiseKernel("float32 x, float32 s", "float32 y", "y = x * s", "emu_test_scale")
    x = cp.asarray(np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(scale(x, 3.0).get(), np.arange(5) * 3)    # a scalar cast to float32
    with pytest.raises(TypeError, match="Type is mismatched"):
        scale(x.astype(np.float64), 3.0)
    fill = cp.ElementwiseKernel("raw int64 idx", "raw float32 out", "out[idx[i]] = (float)i", "emu_test_scatter")
    out = cp.zeros(6, dtype=np.float32)
    fill(cp.asarray(np.array([5, 0, 2], dtype=np.int64)), out, size=3)
    np.testing.assert_array_equal(out.get(), [1, 0, 2, 0, 0, 0])


def test_a_decode_graph_step_steered_by_host_values_replays_stale(emu_gpu):
    """The hazard DecodeGraph's docstring names, reproduced by the fake as by a GPU: a host value read by the step
    (here a capture-time position) is baked into the graph, so replays at other positions give its old result."""
    from hpcinfer.backend.cupy_graphs import DecodeGraph

    gpu = emu_gpu
    x = np.ones((2, 4), dtype=np.float32)
    graph = DecodeGraph(gpu)
    first = gpu.to_host(graph(lambda inputs, step: inputs["x"] * np.float32(step.starts[0]), {"x": x}, [0, 1],
                              [3, 3])).copy()
    again = gpu.to_host(graph(lambda inputs, step: inputs["x"] * np.float32(step.starts[0]), {"x": x}, [0, 1],
                              [9, 9]))
    np.testing.assert_array_equal(first, 3 * x)
    np.testing.assert_array_equal(again, 3 * x)                  # not 9: the replay kept the captured scalar


def test_the_function_fixture_nests_inside_the_module_one(emu_gpu, emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    assert emu_cupy is not emu_gpu.xp
    ops = CupyOps(device=0)
    assert ops.xp is emu_cupy and ops.to_host(ops.asarray(np.arange(3))).tolist() == [0, 1, 2]


def test_kernels_get_poisoned_margins_and_writes_past_an_allocation_are_reported(emu_gpu):
    cp = emu_gpu.xp
    module = cp.RawModule(code='extern "C" __global__ void shift(const float* x, float* y, long long n) {\n'
                               '    long long i = threadIdx.x;\n'
                               '    if (i <= n) y[i] = x[i - 1];\n}\n')           # reads x[-1], writes y[n]
    shift = module.get_function("shift")
    x = cp.asarray(np.arange(1, 5, dtype=np.float32))
    y = cp.zeros(8, dtype=np.float32)
    shift((1,), (32,), (x, y[:4], np.int64(3)))                 # inside y's allocation: fine
    got = y.get()
    assert np.isnan(got[0]) and got[1:4].tolist() == [1, 2, 3]  # x[-1] is poison
    with pytest.raises(RuntimeError, match="wrote outside the allocation of argument"):
        shift((1,), (32,), (x, cp.zeros(3, dtype=np.float32), np.int64(3)))
