"""Memory tiers for weights: each decoder layer's weights live on the device, in host memory, or on disk, and are
streamed to the device just before use (ZeRO-Inference), prefetched `prefetch_layers` ahead on background threads.

On the NumPy backend the device is the compute arrays, the host a separate store of copies, and the disk one .npy
file per tensor under `[offload] disk_dir` (read back through a memory map, never whole-file into a second copy).
Device bytes are accounted: resident layers + layers fetched at the moment; the peak is reported.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ConfigError

TIERS = ("device", "host", "disk")


def layer_tensors(obj, found=None, seen=None) -> list:
    """Every (holder, key) whose value is a weight array, below a block: attributes holding arrays, and lists of
    arrays (expert stacks). Walks the model's and the parallel layers' objects only."""
    found = [] if found is None else found
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    for key, value in vars(obj).items():
        if isinstance(value, np.ndarray) and key not in ("cos", "sin"):
            found.append((obj, key))
        elif isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
            found.append((obj, key))
        elif _is_weight_holder(value):
            layer_tensors(value, found, seen)
    return found


def _is_weight_holder(value) -> bool:
    module = type(value).__module__
    return (module.startswith("hpcinfer.model") or module.startswith("hpcinfer.parallel")) and \
        type(value).__name__ not in ("Dispatcher",)


def _nbytes(value) -> int:
    return sum(int(a.nbytes) for a in value) if isinstance(value, list) else int(value.nbytes)


def place_layers(num_layers: int, weights_gpu: float, weights_cpu: float) -> list[str]:
    """Tier of each layer from the placement percentages (FlexGen places weights at layer granularity): the first
    layers on the device, then host, then disk, in the proportions asked."""
    n_dev = round(num_layers * weights_gpu / 100)
    n_host = round(num_layers * (weights_gpu + weights_cpu) / 100) - n_dev
    return ["device"] * n_dev + ["host"] * n_host + ["disk"] * (num_layers - n_dev - n_host)


class WeightTiers:
    """The weights of a model's blocks across tiers, with `fetch(i)` / `release(i)` around each use."""

    def __init__(self, ops, blocks: list, tiers: list[str], disk_dir: str | None, prefetch_layers: int = 0):
        self.ops, self.blocks, self.tiers, self.prefetch_layers = ops, blocks, tiers, prefetch_layers
        self.tensors: list = [[] for _ in blocks]
        self.layer_bytes = [0] * len(blocks)
        self.host: dict = {}                              # (layer, n) -> host array(s)
        self.disk: dict = {}                              # (layer, n) -> file path(s)
        self.disk_dir = disk_dir
        self.resident: set = set()
        self.pending: dict = {}                           # layer -> Future of its fetch
        self.pool = ThreadPoolExecutor(max(1, prefetch_layers)) if prefetch_layers else None
        self.lock = threading.Lock()
        self.device_bytes = self.peak_bytes = 0
        self.bytes_from_host = self.bytes_from_disk = 0

    def place(self, i: int) -> None:
        """Called once block i has loaded its weights: keep them (device tier) or move them to host or disk, so
        that loading never holds more than one streamed layer at a time."""
        self.tensors[i] = layer_tensors(self.blocks[i])
        self.layer_bytes[i] = sum(_nbytes(getattr(h, k)) for h, k in self.tensors[i])
        if self.tiers[i] == "device":
            self.resident.add(i)
            self.device_bytes += self.layer_bytes[i]
            self.peak_bytes = max(self.peak_bytes, self.device_bytes)
        else:
            self._offload(i, self.tiers[i])

    # ---- placing -------------------------------------------------------------------------------------------
    def _offload(self, i: int, tier: str) -> None:
        """Move layer i's arrays out of the block into its tier (the block's attributes become None)."""
        for n, (holder, key) in enumerate(self.tensors[i]):
            value = getattr(holder, key)
            if tier == "host":
                self.host[i, n] = [np.array(self.ops.to_host(v)) for v in value] if isinstance(value, list) \
                    else np.array(self.ops.to_host(value))
            else:
                self.disk[i, n] = self._write(i, n, value)
            setattr(holder, key, None)

    def _write(self, i: int, n: int, value):
        if self.disk_dir is None:
            raise ConfigError("[offload] weights on disk need [offload] disk_dir")
        os.makedirs(self.disk_dir, exist_ok=True)
        values = value if isinstance(value, list) else [value]
        paths = []
        for j, v in enumerate(values):
            path = os.path.join(self.disk_dir, f"layer{i:04d}-t{n:03d}-{j:04d}.npy")
            np.save(path, self.ops.to_host(v))
            paths.append(path)
        return paths if isinstance(value, list) else paths[0]

    # ---- streaming -----------------------------------------------------------------------------------------
    def fetch(self, i: int) -> None:
        """Make layer i's weights usable now (waiting for its prefetch if one is in flight), and start fetching
        the next `prefetch_layers` layers."""
        if i not in self.resident:
            future = self.pending.pop(i, None)
            arrays = future.result() if future is not None else self._read(i)
            self._install(i, arrays)
        for j in range(i + 1, min(i + 1 + self.prefetch_layers, len(self.blocks))):
            if j not in self.resident and j not in self.pending and self.pool is not None:
                self.pending[j] = self.pool.submit(self._read, j)

    def release(self, i: int) -> None:
        """Drop layer i's streamed weights from the device (resident layers stay)."""
        if self.tiers[i] == "device" or i not in self.resident:
            return
        for holder, key in self.tensors[i]:
            setattr(holder, key, None)
        self.resident.discard(i)
        with self.lock:
            self.device_bytes -= self.layer_bytes[i]

    def _read(self, i: int) -> list:
        """Layer i's arrays, read from its tier into new device arrays (runs on a prefetch thread too)."""
        with self.lock:                                    # the bytes are on the device from now on
            self.device_bytes += self.layer_bytes[i]
            self.peak_bytes = max(self.peak_bytes, self.device_bytes)
        out = []
        for n in range(len(self.tensors[i])):
            if self.tiers[i] == "host":
                src = self.host[i, n]
                out.append([self.ops.asarray(np.array(v)) for v in src] if isinstance(src, list)
                           else self.ops.asarray(np.array(src)))
                with self.lock:
                    self.bytes_from_host += _nbytes(src)
            else:
                src = self.disk[i, n]
                read = lambda p: self.ops.asarray(np.array(np.load(p, mmap_mode="r")))
                out.append([read(p) for p in src] if isinstance(src, list) else read(src))
                with self.lock:
                    self.bytes_from_disk += _nbytes(out[-1])
        return out

    def _install(self, i: int, arrays: list) -> None:
        for (holder, key), value in zip(self.tensors[i], arrays):
            setattr(holder, key, value)
        self.resident.add(i)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
