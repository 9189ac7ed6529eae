"""A GPU's side of the hardware profile (`hpcinfer profile --backend cupy`, docs/offload-planning.md): the host <->
device link as the copy engine uses it (backend/cupy_transfer.py: pinned host memory, a non-blocking copy
stream), the device's matmul rate and memory bandwidth, and its memory. profile.measure gives the host side
(memcpy, disk, the CPU's matmul); `with_gpu` replaces the device terms with these.

Every probe copies one `size`-byte float32 array on a non-blocking copy stream, the stream synchronized before the
clock starts and before it is read (perf_counter between stream syncs: the copies are 256 MiB, tens of ms, so the
clock's overhead is noise; it also runs on the CPU stand-in for cupy, where CUDA events time nothing), best of a
few. Pageable host -> device is recorded for comparison only: the copy engine never copies from pageable memory.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .profile import NUMPY_NOTE

TIMING = "perf_counter between copy-stream synchronizations, best of 3"


def _best(repeats: int, fn) -> float:
    """The smallest of `repeats` results of `fn()` (seconds, at least 1e-9), after one warm-up call."""
    fn()
    return max(min(fn() for _ in range(repeats)), 1e-9)


def _timed_on(stream, fn) -> float:
    """Seconds of `fn()`'s work queued on `stream`: synchronized before the clock starts and before it stops."""
    stream.synchronize()
    t0 = time.perf_counter()
    fn()
    stream.synchronize()
    return time.perf_counter() - t0


def measure_links(cp, size: int) -> dict:
    """Bytes/s of host -> device from pinned memory (the copy engine's uploads), from pageable memory (for the
    record), and device -> host into pinned memory (the KV cache's stores), on a non-blocking stream."""
    import cupyx

    n = max(size // 4, 1)
    pinned = cupyx.empty_pinned((n,), dtype=np.float32)
    pinned[...] = 1.0
    pageable = np.ones(n, np.float32)
    device = cp.empty((n,), dtype=np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    h2d = _best(3, lambda: _timed_on(stream, lambda: device.set(pinned, stream=stream)))
    h2d_pageable = _best(3, lambda: _timed_on(stream, lambda: device.set(pageable, stream=stream)))
    d2h = _best(3, lambda: _timed_on(stream, lambda: device.get(stream=stream, out=pinned, blocking=False)))
    nbytes = pageable.nbytes
    return {"h2d_pinned": nbytes / h2d, "h2d_pageable": nbytes / h2d_pageable, "d2h_pinned": nbytes / d2h,
            "gpu_timing": TIMING}


def measure_device(cp, n: int = 2048) -> dict:
    """FLOP/s of an n x n float32 matmul and bytes/s of a device -> device copy (read + write) on the GPU."""
    a = cp.ones((n, n), dtype=np.float32)
    b = cp.empty_like(a)
    stream = cp.cuda.get_current_stream()
    cp.matmul(a, a, out=b)                                   # warm-up (the cuBLAS handle, the kernel)
    mm_s = _best(3, lambda: _timed_on(stream, lambda: cp.matmul(a, a, out=b)))
    copy_s = _best(3, lambda: _timed_on(stream, lambda: cp.copyto(b, a)))
    return {"device_flops": 2 * n ** 3 / mm_s, "device_copy": 2 * a.nbytes / copy_s}


def gpu_profile(profile, bw: dict):
    """The planner's profile (measured as the NumPy backend sees the machine) with the GPU's links and compute
    measured here: host <-> device from pinned memory, the device's matmul FLOP/s and memory bandwidth. The GPU's
    copy engine runs beside its compute, so the cost model overlaps the terms (overlap = True), where the NumPy
    profile it starts from says they share the cores."""
    return dataclasses.replace(profile, host_to_device=bw["h2d_pinned"], device_to_host=bw["d2h_pinned"],
                               device_flops=bw["device_flops"], device_bandwidth=bw["device_copy"],
                               name=f"{profile.name} + GPU links", overlap=True,
                               gemv_bandwidth=None)        # the host's small-matmul rate is not the GPU's


def with_gpu(profile, cp, size: int, device_memory: int | None = None):
    """`profile` (profile.measure's, the host side) with this GPU's links, compute and memory (device_memory:
    the budget to plan for, default the GPU's total memory)."""
    bw = {**measure_links(cp, size), **measure_device(cp)}
    total = int(cp.cuda.runtime.memGetInfo()[1])
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    host_notes = [n for n in profile.notes.split("; ") if n and n != NUMPY_NOTE]       # the disk's caveats stay
    notes = [f"cupy backend on {name}: host<->device over the link from pinned memory ({TIMING})", *host_notes]
    return dataclasses.replace(gpu_profile(profile, bw), notes="; ".join(notes),
                               device_memory=int(device_memory if device_memory is not None else total),
                               name=f"{profile.name.replace(' (measured)', '')} + {name} (measured)")
