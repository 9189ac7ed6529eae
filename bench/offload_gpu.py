"""The GPU side of the offload benchmark (offload.py --backend cupy): the transfer floor from the links
measured by hpcinfer/offload/profile_gpu.py (as the copy engine, hpcinfer/backend/cupy_transfer.py, uses them) and
the report's text."""

from __future__ import annotations


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
