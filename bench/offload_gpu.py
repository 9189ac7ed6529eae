"""The GPU side of the offload benchmark (bench/offload.py --backend cupy): the host <-> device link bandwidths,
measured as the copy engine (hpcinfer/backend/cupy_transfer.py) uses the link, and a planner profile with them.

Every probe copies one `size`-byte float32 array on a non-blocking copy stream, the stream synchronized before the
clock starts and before it is read (perf_counter between stream syncs: the copies are 256 MiB, tens of ms, so the
clock's overhead is noise; it also runs on the CPU stand-in for cupy, where CUDA events time nothing), best of a
few. Pageable host -> device is recorded for comparison only: the copy engine never copies from pageable memory.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

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
    measured here: host <-> device from pinned memory, the device's matmul FLOP/s and memory bandwidth."""
    return dataclasses.replace(profile, host_to_device=bw["h2d_pinned"], device_to_host=bw["d2h_pinned"],
                               device_flops=bw["device_flops"], device_bandwidth=bw["device_copy"],
                               name=f"{profile.name} + GPU links")


def transfer_floor(run: dict, bw: dict) -> tuple[float, float]:
    """(warm, cold) seconds the run's copies need on a GPU: host-tier weights and KV loads at pinned host ->
    device, KV stores at device -> host, disk-tier weights read into pinned memory and then copied over."""
    host = (run["weights_bytes_from_host"] + run["kv_bytes_to_device"]) / bw["h2d_pinned"] + \
        run["kv_bytes_to_host"] / bw["d2h_pinned"]
    disk = run["weights_bytes_from_disk"]
    over = disk / bw["h2d_pinned"]
    return host + over + disk / bw["disk_read_warm"], host + over + disk / bw["disk_read_cold"]


def describe(device: dict, bw: dict) -> dict:
    """Markdown pieces of the CuPy backend: where it ran, its measured links, and the note on the copies."""
    where = (f"CuPy backend on {device.get('device_name')} (CUDA driver {device.get('cuda_driver')}, runtime "
             f"{device.get('cuda_runtime')}, cupy {device.get('cupy')}), one process")
    links = (f"GPU links: host -> device {bw['h2d_pinned'] / 1e9:.2f} GB/s from pinned memory (pageable "
             f"{bw['h2d_pageable'] / 1e9:.2f}), device -> host {bw['d2h_pinned'] / 1e9:.2f} GB/s into pinned memory; "
             f"device matmul {bw['device_flops'] / 1e12:.1f} TFLOP/s ({bw['gpu_timing']}).")
    note = ("Notes: on the CuPy backend every host <-> device copy is a real PCIe (or NVLink-C2C) transfer from "
            "pinned host memory on a non-blocking copy stream, ordered against the compute stream by CUDA events "
            "(docs/offload.md, \"Copies on a GPU\"), so prefetch overlaps the copies with the kernels; a disk-tier "
            "layer is read from the page cache into a pinned buffer first. The transfer floor counts host-tier "
            "bytes at the pinned host -> device bandwidth, KV stores at device -> host, and disk-tier bytes at "
            "disk read + host -> device. The device budget is the runtime's, not the GPU's memory.")
    return {"where": where, "links": links, "note": note}
