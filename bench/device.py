"""The device a benchmark script's backend runs on: synchronize it around the clocks, the bytes its memory pool
holds, and its description for the record (no-ops or the backend's name alone on NumPy)."""

from __future__ import annotations


def sync_device(ops) -> None:
    """Wait for the work queued on the ops' GPU (a no-op on the NumPy backend): timers start and stop after it."""
    if getattr(ops, "name", "numpy") == "cupy":
        ops.xp.cuda.Device().synchronize()


def pool_used_bytes(ops) -> int | None:
    """Bytes in use in cupy's default device memory pool (what our arrays hold on the GPU); None on NumPy."""
    if getattr(ops, "name", "numpy") != "cupy":
        return None
    return int(ops.xp.get_default_memory_pool().used_bytes())


def device_info(ops) -> dict:
    """The backend, and on cupy the GPU's name, memory, compute capability and the cupy / CUDA versions."""
    import numpy as np

    info = {"backend": getattr(ops, "name", "numpy"), "numpy": np.__version__}
    if info["backend"] != "cupy":
        return info
    cp = ops.xp
    info["cupy"] = getattr(cp, "__version__", None)
    try:
        rt = cp.cuda.runtime
        dev = rt.getDevice()
        props = rt.getDeviceProperties(dev)
        name = props.get("name", b"")
        info.update(device=dev, device_name=name.decode() if isinstance(name, bytes) else str(name),
                    device_memory_GiB=round(props.get("totalGlobalMem", 0) / 2**30, 1),
                    compute_capability=f"{props.get('major')}.{props.get('minor')}",
                    cuda_runtime=rt.runtimeGetVersion(), cuda_driver=rt.driverGetVersion())
    except Exception as e:  # noqa: BLE001 - a description, never a reason to lose the measurements
        info["device_error"] = f"{type(e).__name__}: {e}"
    return info
