"""Weight offload on the CuPy backend, run on the CPU stand-in for cupy (tests/helpers/emu_cupy/): the tiers find the
backend's device arrays and device-form quantized weights (backend/cupy_quant.DeviceQuantizedTensor), stream
them from host memory and disk, and the tokens and bytes moved equal the NumPy backend's run.
"""

from __future__ import annotations

import numpy as np
import pytest

import emu_cupy as emu
from hpcinfer.backend.numpy_ops import NumpyOps
import kernel_emulator as emulate
from hpcinfer.quant.storage import configure
from offload_models import build, generate, make_prompts, offload, preset

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")

@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


PLACEMENTS = {"host": dict(weights_gpu=25, weights_cpu=75, prefetch_layers=1),
              "disk": dict(weights_gpu=0, weights_cpu=50, prefetch_layers=2),
              "zigzag": dict(weights_gpu=50, weights_cpu=50, schedule="zigzag", num_gpu_batches=2),
              "zigzag-kv-host": dict(weights_gpu=50, weights_cpu=50, schedule="zigzag", num_gpu_batches=2,
                                     cache_gpu=0, cache_cpu=100),
              "cpu-attention": dict(weights_gpu=50, weights_cpu=50, schedule="zigzag", num_gpu_batches=2,
                                    cache_gpu=0, cache_cpu=100, cpu_attention=True)}


def run(ops, prompts, off, quantize):
    """(tokens per prompt, the model's weight tiers, the run's StepTimes)."""
    source = preset("tiny-dense")
    if quantize:
        configure(source, quantize, 32)
    model = build(source, off, ops)
    out, times = generate(model, prompts, off)
    return [tokens for tokens, _ in out], model.weights, times


# every placement in float; each quantized weight format over the placements that move it differently (a layer at
# a time from host memory, from disk, and zig-zag beside host attention)
CASES = ([(placement, None) for placement in PLACEMENTS]
         + [("host", "int8"), ("cpu-attention", "int8"), ("disk", "int4"), ("zigzag-kv-host", "int4")])


@pytest.mark.parametrize("placement, quantize", CASES)
def test_streamed_weights_on_emulated_cupy_give_numpys_tokens_and_bytes(prompts, tmp_path, placement, quantize):
    off = offload(tmp_path, **PLACEMENTS[placement])
    want, cpu_tiers, _ = run(NumpyOps(), prompts, off, quantize)
    with emu.installed():
        from hpcinfer.backend.cupy_ops import CupyOps

        got, gpu_tiers, times = run(CupyOps(device=0), prompts,
                                    offload(tmp_path / "gpu", **PLACEMENTS[placement]), quantize)
        # every copy of the offload paths went through the copy engine: pinned host memory, the copy stream
        # (the stand-in runs such a copy only when an event after it is waited on: a read without the wait fails)
        assert emu._state.pageable_async_copies == 0
        kv_moved = times.kv_bytes_to_device + times.kv_bytes_to_host
        delegated = times.attention_bytes_to_host + times.attention_bytes_to_device   # CPU attention's q, k, v, out
        assert emu._state.async_copy_bytes == (gpu_tiers.bytes_from_host + gpu_tiers.bytes_from_disk + kv_moved
                                               + delegated)
        assert (delegated > 0) == (placement == "cpu-attention")
        assert (kv_moved > 0) == (placement == "zigzag-kv-host")
        assert gpu_tiers.streamed, "no layer was streamed"
        for i in gpu_tiers.streamed:                                 # what was streamed is the backend's
            for holder, key in gpu_tiers.tensors[i]:
                assert getattr(holder, key) is None                  # released after the run
        kinds = {kind[0] for layer in gpu_tiers.kinds for kind in layer}
        assert ("quant" in kinds) == bool(quantize)
    assert got == want
    moved = gpu_tiers.bytes_from_host + gpu_tiers.bytes_from_disk
    assert moved > 0
    if not quantize:                                                 # the same arrays move (the device form of a
        assert moved == cpu_tiers.bytes_from_host + cpu_tiers.bytes_from_disk    # quantized weight is padded)
    else:
        assert np.isclose(moved, cpu_tiers.bytes_from_host + cpu_tiers.bytes_from_disk, rtol=0.25)


def test_prefetch_threads_bind_the_ranks_gpu(prompts, tmp_path, monkeypatch):
    """CUDA's current device is per host thread: every prefetch thread makes the rank's GPU current
    (ops.use_device as the pool's initializer) before it allocates or copies anything."""
    import threading

    bound = []
    with emu.installed(devices=2):
        from hpcinfer.backend.cupy_ops import CupyOps

        ops = CupyOps(device=1)
        real = ops.use_device
        monkeypatch.setattr(ops, "use_device", lambda: (bound.append(threading.current_thread().name), real())[1])
        tokens, tiers, _ = run(ops, prompts[:2], offload(tmp_path, **PLACEMENTS["host"]), None)
    assert tiers.streamed and tokens
    assert bound and all(name != threading.main_thread().name for name in bound)


@pytest.mark.parametrize("mode", ("int8", "int4"))
@pytest.mark.parametrize("placement", ("cache-host-staging", "cache-host-cpu-attention"))
def test_a_quantized_kv_cache_in_host_memory_on_emulated_cupy_gives_numpys_tokens(placement, mode):
    """Zig-zag with an int8 / int4 cache in pinned host memory: its quantized parts go through the staging buffers on
    the copy stream (or stay on the host for CPU attention) and the tokens are the NumPy run's."""
    import test_offload_kv_quant as kvq
    from hpcinfer.config import OffloadSection

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in kvq.PROMPT_LENGTHS[:4]]
    off = OffloadSection(**dict(kvq.ZIGZAG[placement], num_gpu_batches=2))
    want, cpu_times = kvq.generate(kvq.build(kvq.source(), off, mode), prompts, off)
    with emu.installed():
        from hpcinfer.backend.cupy_ops import CupyOps

        got, gpu_times = kvq.generate(kvq.build(kvq.source(), off, mode, ops=CupyOps(device=0)), prompts, off)
        assert emu._state.pageable_async_copies == 0
    assert got == want
    assert gpu_times.kv_bytes_to_device == cpu_times.kv_bytes_to_device
    assert (gpu_times.kv_bytes_to_device > 0) == (placement == "cache-host-staging")
