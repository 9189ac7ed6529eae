"""What the cost model needs to know about a machine: tier capacities, link bandwidths and compute rates.

FlexGen Section 4.3 ("To use the cost model, we run profiling on the hardware ... and fit the hardware
parameters") and its Table 6 constants: ctog_bdw, gtoc_bdw, dtoc_bdw, ctod_bdw, mm_flops, bmm_flops, cpu_flops.
Here they are one number each (bytes/s or FLOP/s), measured by `measure` or taken from a preset, and kept in a
flat TOML file (`hpcinfer profile --out FILE`, read back by `hpcinfer plan --profile FILE`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ..config import parse_bytes, read_toml
from ..errors import ConfigError
from .policy import human_bytes

MEMORY_FIELDS = ("device_memory", "host_memory", "disk_memory")
RATE_FIELDS = ("host_to_device", "device_to_host", "disk_to_host", "host_to_disk",
               "device_flops", "host_flops", "device_bandwidth", "host_bandwidth")
# The cluster, for the layout planner (`hpcinfer plan --gpus`, docs/planner.md); optional, with defaults.
LINK_FIELDS = ("gpus_per_node", "intra_node_latency", "intra_node_bandwidth", "inter_node_latency",
               "inter_node_bandwidth")


@dataclass(frozen=True)
class HardwareProfile:
    device_memory: int           # bytes the device tier may hold (GPU memory; NumPy backend: compute arrays)
    host_memory: int             # bytes the host tier may hold (pinned host memory on GPU systems)
    disk_memory: int             # bytes the disk tier may hold (free space under [offload] disk_dir)
    host_to_device: float        # bytes/s, host -> device copies (FlexGen's ctog_bdw)
    device_to_host: float        # bytes/s, device -> host copies (gtoc_bdw)
    disk_to_host: float          # bytes/s, disk reads (dtoc_bdw)
    host_to_disk: float          # bytes/s, disk writes, fsync included (ctod_bdw)
    device_flops: float          # FLOP/s of a large matmul on the device (mm_flops)
    host_flops: float            # FLOP/s of a large matmul on the host (cpu_flops)
    device_bandwidth: float      # bytes/s the device reads its memory at: decode attention over a device cache
    host_bandwidth: float        # bytes/s the host reads its memory at: decode attention on the host
    overlap: bool = True         # transfers run beside compute (a GPU's copy engine and DMA): a layer costs its
                                 # slowest term. False (a NumPy-measured profile): a "transfer" is a memcpy on the
                                 # cores that compute, and the KV / activation copies are synchronous
                                 # (backend/transfer.HostCopies), so a layer costs the sum of its terms
    name: str = "custom"         # preset name, or where it was measured
    notes: str = ""              # caveats of the measurement (e.g. a disk read served by the page cache)
    # Decode's weight reads (optional; None: device_bandwidth): bytes/s of weights read by decode-shaped matmuls,
    # x [T <= 8, D] @ W [D, F] over weights larger than the last-level cache (`measure`). On NumPy/BLAS a small-
    # batch matmul reaches well under a streaming read; the cost models read decode weights at `decode_bandwidth`.
    gemv_bandwidth: float | None = None
    # The cluster (LINK_FIELDS; the offload planner ignores them): ranks per node and the two link classes.
    gpus_per_node: int = 1                 # ranks (GPUs) of one node
    intra_node_latency: float = 2e-6       # s, one message between two ranks of a node
    intra_node_bandwidth: float = 10e9     # B/s one rank sends to a rank of its own node
    inter_node_latency: float = 5e-6       # s, one message to a rank of another node
    inter_node_bandwidth: float = 1e9      # B/s one rank sends to other nodes (its share of the node's network)

    def __post_init__(self):
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be true or false, got {self.overlap!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        for key in LINK_FIELDS[1:]:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                    (key.endswith("bandwidth") and not value > 0):
                raise ValueError(f"{key} must be a number {'> 0' if key.endswith('bandwidth') else '>= 0'}, "
                                 f"got {value!r}")
        if self.gemv_bandwidth is not None and (isinstance(self.gemv_bandwidth, bool) or not isinstance(
                self.gemv_bandwidth, (int, float)) or not self.gemv_bandwidth > 0):
            raise ValueError(f"gemv_bandwidth must be a rate > 0 (or absent), got {self.gemv_bandwidth!r}")
        for key in MEMORY_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a number of bytes >= 0, got {value!r}")
        for key in RATE_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key} must be a rate > 0, got {value!r}")

    @property
    def decode_bandwidth(self) -> float:
        """Bytes/s a decode (token) step reads its weights at: min(gemv_bandwidth, device_bandwidth), and
        device_bandwidth when gemv_bandwidth is absent (presets, older files). The min: a weight read by small
        matmuls is still a read of memory, so it cannot beat the streaming rate; a larger gemv figure means the
        measurement's weights were partly cache-resident, not that decode streams faster."""
        if self.gemv_bandwidth is None:
            return self.device_bandwidth
        return min(self.gemv_bandwidth, self.device_bandwidth)

    def with_budgets(self, device_memory: int | None = None, host_memory: int | None = None,
                     disk_memory: int | None = None) -> "HardwareProfile":
        """The same machine with some capacities replaced (None: keep)."""
        changes = {k: int(v) for k, v in (("device_memory", device_memory), ("host_memory", host_memory),
                                          ("disk_memory", disk_memory)) if v is not None}
        return dataclasses.replace(self, **changes)

    def to_toml(self) -> str:
        """A flat TOML document (read back by `load_profile`)."""
        lines = ["# hpcinfer hardware profile: capacities in bytes, bandwidths in bytes/s, rates in FLOP/s",
                 f"name = {_toml_string(self.name)}"]
        if self.notes:
            lines.append(f"notes = {_toml_string(self.notes)}")
        for key in MEMORY_FIELDS:
            lines.append(f"{key} = {getattr(self, key)}  # {human_bytes(getattr(self, key))}")
        lines.append(f"overlap = {'true' if self.overlap else 'false'}  # " + (
            "transfers overlap compute: a layer costs its slowest term" if self.overlap else
            "transfers share the compute cores: a layer costs the sum of its terms"))
        for key in RATE_FIELDS:
            value = float(getattr(self, key))
            unit = "FLOP/s" if key.endswith("flops") else "B/s"
            lines.append(f"{key} = {value:.6g}  # {_human_rate(value)}{unit}")
        if self.gemv_bandwidth is not None:
            value = float(self.gemv_bandwidth)
            lines.append(f"gemv_bandwidth = {value:.6g}  # {_human_rate(value)}B/s: decode-shaped matmuls' weights")
        lines.append(f"gpus_per_node = {self.gpus_per_node}")
        for key in LINK_FIELDS[1:]:
            value = float(getattr(self, key))
            lines.append(f"{key} = {value:.6g}  # " + (f"{value * 1e6:.3g} us" if key.endswith("latency")
                                                       else f"{_human_rate(value)}B/s"))
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        return (f"{self.name}: device {human_bytes(self.device_memory)}, host {human_bytes(self.host_memory)}, "
                f"disk {human_bytes(self.disk_memory)}; host->device {_human_rate(self.host_to_device)}B/s, "
                f"device->host {_human_rate(self.device_to_host)}B/s, disk->host "
                f"{_human_rate(self.disk_to_host)}B/s, host->disk {_human_rate(self.host_to_disk)}B/s; matmul "
                f"{_human_rate(self.device_flops)}FLOP/s device, {_human_rate(self.host_flops)}FLOP/s host; "
                f"memory {_human_rate(self.device_bandwidth)}B/s device, {_human_rate(self.host_bandwidth)}B/s "
                f"host" + (f", decode weights {_human_rate(self.decode_bandwidth)}B/s"
                           if self.gemv_bandwidth is not None else "") +
                f"; transfers {'overlap compute' if self.overlap else 'add to compute (shared cores)'}")


def _human_rate(value: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} "


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


# ---- presets ---------------------------------------------------------------------------------------------------
# Capacities are the machines' (decimal units); rates are sustained values a tuned runtime reaches, well below the
# data-sheet peaks (FlexGen fits them by profiling, Section 4.3).

PRESETS: dict[str, HardwareProfile] = {
    # FlexGen's evaluation machine (Section 6, Table 1): GCP, T4 16 GB over PCIe 3.0 x16, 208 GB DRAM, 1.5 TB SSD
    # reading at about 2 GB/s and writing at about 1 GB/s. T4: 65 TFLOP/s fp16 peak, 320 GB/s.
    "t4-16gb": HardwareProfile(
        name="t4-16gb", device_memory=16 * 10**9, host_memory=208 * 10**9, disk_memory=1500 * 10**9,
        host_to_device=12e9, device_to_host=12e9, disk_to_host=2e9, host_to_disk=1e9,
        device_flops=20e12, host_flops=1.0e12, device_bandwidth=250e9, host_bandwidth=40e9),
    # A100 40 GB on PCIe 4.0 x16 (~25 GB/s pinned), NVMe (3 GB/s read, 2 GB/s write), 312 TFLOP/s fp16 peak,
    # 1.55 TB/s; a two-socket host with 256 GB DRAM.
    "a100-40gb-pcie4": HardwareProfile(
        name="a100-40gb-pcie4", device_memory=40 * 10**9, host_memory=256 * 10**9, disk_memory=2000 * 10**9,
        host_to_device=25e9, device_to_host=25e9, disk_to_host=3e9, host_to_disk=2e9,
        device_flops=200e12, host_flops=2.0e12, device_bandwidth=1.3e12, host_bandwidth=100e9),
    # H100 80 GB SXM on PCIe 5.0 x16 (~50 GB/s pinned), NVMe RAID (6 GB/s read, 4 GB/s write), 990 TFLOP/s fp16
    # dense peak, 3.35 TB/s; a host with 512 GB DRAM.
    "h100-80gb": HardwareProfile(
        name="h100-80gb", device_memory=80 * 10**9, host_memory=512 * 10**9, disk_memory=4000 * 10**9,
        host_to_device=50e9, device_to_host=50e9, disk_to_host=6e9, host_to_disk=4e9,
        device_flops=600e12, host_flops=3.0e12, device_bandwidth=2.8e12, host_bandwidth=200e9),
    # Cluster nodes for the layout planner (docs/planner.md cites the data sheets). DGX A100 (40 GB): 8 A100-SXM4
    # over NVSwitch (NVLink 3: 300 GB/s per direction per GPU), 8 HDR InfiniBand ports (200 Gb/s = 25 GB/s per
    # GPU), 1 TB DRAM, PCIe 4.0 host links, 15 TB NVMe. Sustained rates below peak, as above.
    "dgx-a100-40gb": HardwareProfile(
        name="dgx-a100-40gb", device_memory=40 * 10**9, host_memory=1000 * 10**9, disk_memory=15000 * 10**9,
        host_to_device=25e9, device_to_host=25e9, disk_to_host=10e9, host_to_disk=5e9,
        device_flops=200e12, host_flops=2.0e12, device_bandwidth=1.3e12, host_bandwidth=150e9,
        gpus_per_node=8, intra_node_latency=5e-6, intra_node_bandwidth=240e9, inter_node_latency=10e-6,
        inter_node_bandwidth=22e9),
    # DGX H100: 8 H100-SXM5 80 GB over NVSwitch (NVLink 4: 450 GB/s per direction per GPU), 8 NDR InfiniBand
    # ports (400 Gb/s = 50 GB/s per GPU), 2 TB DRAM, PCIe 5.0, 30 TB NVMe.
    "dgx-h100-80gb": HardwareProfile(
        name="dgx-h100-80gb", device_memory=80 * 10**9, host_memory=2000 * 10**9, disk_memory=30000 * 10**9,
        host_to_device=50e9, device_to_host=50e9, disk_to_host=20e9, host_to_disk=10e9,
        device_flops=600e12, host_flops=3.0e12, device_bandwidth=2.8e12, host_bandwidth=250e9,
        gpus_per_node=8, intra_node_latency=4e-6, intra_node_bandwidth=360e9, inter_node_latency=8e-6,
        inter_node_bandwidth=45e9),
}


# ---- TOML ------------------------------------------------------------------------------------------------------

def load_profile(path: str) -> HardwareProfile:
    """Read a profile TOML file; ConfigError naming the file and the key on anything wrong."""
    raw = read_toml(path, "profile file")
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{path}: unknown key '{key}'; allowed keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for key in MEMORY_FIELDS + RATE_FIELDS:
        if key not in raw:
            raise ConfigError(f"{path}: missing key '{key}'")
        value = raw[key]
        try:
            kwargs[key] = parse_bytes(value) if key in MEMORY_FIELDS else float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: {key} = {value!r} is not a number") from None
    for key in ("name", "notes"):
        if key in raw:
            kwargs[key] = str(raw[key])
    if "overlap" in raw:                          # optional: files written before it was measured overlap (GPU)
        if not isinstance(raw["overlap"], bool):
            raise ConfigError(f"{path}: overlap = {raw['overlap']!r} is not true or false")
        kwargs["overlap"] = raw["overlap"]
    if "gemv_bandwidth" in raw:                   # optional: files without it read decode weights at device_bandwidth
        value = raw["gemv_bandwidth"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: gemv_bandwidth = {value!r} is not a number")
        kwargs["gemv_bandwidth"] = float(value)
    for key in LINK_FIELDS:
        if key in raw:
            value = raw[key]
            if key == "gpus_per_node" and not (isinstance(value, int) and not isinstance(value, bool)):
                raise ConfigError(f"{path}: gpus_per_node = {value!r} is not an integer")
            if key != "gpus_per_node" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{path}: {key} = {value!r} is not a number")
            kwargs[key] = value if key == "gpus_per_node" else float(value)
    try:
        return HardwareProfile(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def save_profile(profile: HardwareProfile, path: str) -> None:
    """Write atomically (a temp file renamed over `path`)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(profile.to_toml())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def resolve_profile(name_or_path: str) -> HardwareProfile:
    """A preset by name, else a profile file; ConfigError listing the presets when it is neither."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        return load_profile(name_or_path)
    raise ConfigError(f"unknown hardware profile {name_or_path!r}: neither a preset ({', '.join(PRESETS)}) nor "
                      f"an existing file")


# ---- measuring this machine ------------------------------------------------------------------------------------

NUMPY_NOTE = "numpy backend: host<->device is a memcpy, device and host rates are the same numbers"


def measure(tmp_dir: str, device_memory: int | None = None, host_memory: int | None = None,
            disk_memory: int | None = None, size: int = 256 * 2**20) -> HardwareProfile:
    """Measure this machine as the NumPy backend sees it (a few seconds with the default 256 MiB arrays).

    On the NumPy backend the device tier is ordinary memory, so host <-> device is a memcpy (np.copyto) and the
    device and host rates are the same numbers. Unset capacities: device and host half of physical memory each
    (they share it on this backend), disk the free space under `tmp_dir`.
    Disk reads: the file is written and fsynced, then its pages are dropped with posix_fadvise(DONTNEED) before
    reading it back. Filesystems that ignore the hint (tmpfs, some overlay and network filesystems) serve the read
    from the page cache; `notes` says so when the read comes out faster than a third of memcpy.
    """
    n = max(size // 4 // 1024, 64) * 1024                           # float32 elements, rows of 1024
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    nbytes = src.nbytes
    copy_s = best_of(3, lambda: np.copyto(dst, src))
    copy_back_s = best_of(3, lambda: np.copyto(src, dst))
    write_s, read_s, note = _disk_times(tmp_dir, src)
    a = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)
    b = np.random.default_rng(1).random((2048, 2048), dtype=np.float32)
    matmul_s = best_of(3, lambda: a @ b)
    flops = 2.0 * 2048**3 / matmul_s
    big = src.reshape(-1, 1024)                                      # [N, 1024]: a gemv reads it once
    vec = np.ones(1024, np.float32)
    read_mem_s = best_of(3, lambda: big @ vec)
    bandwidth = nbytes / read_mem_s
    gemv = gemv_bandwidth(src)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    notes = [NUMPY_NOTE]
    if note:
        notes.append(note)
    if nbytes / read_s > nbytes / copy_s / 3:
        notes.append("disk read faster than a third of memcpy: probably served by the page cache")
    return HardwareProfile(
        name=f"{socket.gethostname()} (measured)", notes="; ".join(notes),
        device_memory=int(device_memory if device_memory is not None else physical // 2),
        host_memory=int(host_memory if host_memory is not None else physical // 2),
        disk_memory=int(disk_memory if disk_memory is not None else shutil.disk_usage(tmp_dir).free),
        host_to_device=nbytes / copy_s, device_to_host=nbytes / copy_back_s,
        disk_to_host=nbytes / read_s, host_to_disk=nbytes / write_s,
        device_flops=flops, host_flops=flops, device_bandwidth=bandwidth, host_bandwidth=bandwidth,
        gemv_bandwidth=gemv,
        overlap=False)                        # a memcpy on the cores that compute: the terms add (cost_model)


# Decode-shaped weights [D, F] (GPT-2-small's and SmolLM2-360M's projections, a 2048-wide model's MLP) and the
# token counts of a decode micro-batch; the weights cycle through the shapes until they exceed the cache.
GEMV_SHAPES = ((768, 2304), (768, 3072), (3072, 768), (960, 2560), (2560, 960), (2048, 8192), (8192, 2048))
GEMV_TOKENS = (1, 4, 8)
LAST_LEVEL_CACHE = 32 * 2**20                      # bytes, when sysfs does not say (this machine's L3)


def gemv_bandwidth(buffer: np.ndarray, tokens=GEMV_TOKENS) -> float:
    """Bytes/s of weights read by decode-shaped matmuls: x [T, D] @ W [D, F] for every W of GEMV_SHAPES in turn,
    T in `tokens`, the weights views of `buffer` (float32, flat) of at least 4x the last-level cache in all (a
    larger buffer is allocated when `buffer` is smaller), so every pass reads memory, not cache. Per T: the
    weights' bytes over the best of 3 passes; the result is the median over T (on a CPU they are all below the
    ridge point, so a weight read bounds them all)."""
    need = 4 * last_level_cache()
    if buffer.nbytes < need:
        buffer = np.ones(need // 4, np.float32)
    weights, at = [], 0
    while at < buffer.size:
        D, F = GEMV_SHAPES[len(weights) % len(GEMV_SHAPES)]
        if at + D * F > buffer.size:
            break
        weights.append(buffer[at:at + D * F].reshape(D, F))                # [D, F]
        at += D * F
    nbytes = sum(w.nbytes for w in weights)
    rates = []
    for T in tokens:
        xs = {D: np.ones((T, D), np.float32) for D, _ in GEMV_SHAPES}       # [T, D]
        rates.append(nbytes / best_of(3, lambda: [xs[w.shape[0]] @ w for w in weights]))
    return float(np.median(rates))


def last_level_cache() -> int:
    """Bytes of the largest CPU cache sysfs lists (LAST_LEVEL_CACHE when it lists none)."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    for entry in (os.listdir(root) if os.path.isdir(root) else ()):
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=LAST_LEVEL_CACHE)


def best_of(repeats: int, fn) -> float:
    """The fastest of `repeats` timed calls of `fn` (seconds, at least 1e-9), after one untimed warm-up call."""
    fn()                                                             # warm up: page faults, BLAS threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _disk_times(tmp_dir: str, data: np.ndarray) -> tuple[float, float, str]:
    """(write seconds incl. fsync, read seconds after dropping the file's pages, a caveat or "")."""
    chunk = 16 * 2**20
    view = memoryview(data).cast("B")
    fd, path = tempfile.mkstemp(prefix="hpcinfer-profile-", dir=tmp_dir)
    note = ""
    try:
        t0 = time.perf_counter()
        for at in range(0, len(view), chunk):
            os.write(fd, view[at:at + chunk])
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            note = "no posix_fadvise: the disk read may come from the page cache"
        out = bytearray(chunk)
        t0 = time.perf_counter()
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while f.readinto(out):
                pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return max(write_s, 1e-9), max(read_s, 1e-9), note
