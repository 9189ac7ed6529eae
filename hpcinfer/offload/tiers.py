"""Memory tiers for weights: each decoder layer's weights live on the device, in host memory, or on disk, and are
streamed to the device just before use (ZeRO-Inference), prefetched `prefetch_layers` ahead on background threads.

On the NumPy backend the device is the compute arrays, the host a separate store of copies, and the disk one .npy
file per array under `[offload] disk_dir` (read back through a memory map, never whole-file into a second copy).
A weight slot holds a float array, a list of arrays (an expert stack) or a QuantizedTensor (its q, scale and min
move; the bytes moved are the quantized bytes). Device bytes are accounted: resident layers + layers fetched at
the moment; the peak is reported. TierMemory counts everything the offload tiers hold at once on the device and
in host memory (layers here, the KV cache and activations from the schedules), with each tier's peak.

Partitioned fetch (ZeRO-Inference with several ranks per node, `[offload] partitioned_fetch`): the replicas of a
fetch group (same stage and tp rank, one node) each keep 1/N of every streamed layer's bytes in their own host
store or file, and a fetch is a collective round: every rank reads its part and an all-gather assembles the layer
on all of them (partition.py). Rounds go in the cyclic layer order on one thread, so every member makes the same
rounds; a rank whose work ends keeps joining rounds in `close()` until every member has ended. Where the rounds run:
- gathered in host memory (an MPI group): on the one prefetch thread when MPI allows calls from several threads
  (a round reads the part and all-gathers it, `prefetch_layers` ahead), else on the main thread, unprefetched;
- gathered on the device (an NCCL group): the uploads of this rank's parts are prefetched like any layer's (not
  collective: any thread, any order), and the all-gather runs on the main thread when the layer is needed, in
  program order on the compute stream like every other collective. So the slow link (host or disk -> device)
  overlaps the compute, and the fast one (the GPUs' all-gather) takes its turn in the stream: an all-gather on a
  second stream could meet the main thread's tp or expert collectives in a different order on different GPUs,
  which NCCL does not guarantee to survive (its kernels wait for their peers).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ConfigError
from ..quant.formats import QuantizedTensor
from ..backend.transfer import Ready
from .partition import LayerImage

TIERS = ("device", "host", "disk")


def layer_tensors(obj, array_types=(np.ndarray,), found=None, seen=None) -> list:
    """Every (holder, key) whose value is a weight below a block: attributes holding arrays (`array_types`: the
    backend's, e.g. numpy's or cupy's ndarray), lists of arrays (expert stacks) and quantized tensors (host
    QuantizedTensors, or their device form). Walks the model's and the parallel layers' objects only."""
    found = [] if found is None else found
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    for key, value in vars(obj).items():
        if (isinstance(value, array_types) or _is_quantized(value)) and key not in ("cos", "sin"):
            found.append((obj, key))
        elif isinstance(value, list) and value and all(isinstance(v, array_types) for v in value):
            found.append((obj, key))
        elif _is_weight_holder(value):
            layer_tensors(value, array_types, found, seen)
    return found


def _is_quantized(value) -> bool:
    """A quantized weight: quant.formats.QuantizedTensor, or a backend's device form of one (a dataclass with the
    same q, scale and min parts, e.g. backend/cupy_quant.DeviceQuantizedTensor)."""
    return isinstance(value, QuantizedTensor) or (dataclasses.is_dataclass(value) and
                                                   all(hasattr(value, f) for f in ("q", "scale", "min")))


def _is_weight_holder(value) -> bool:
    module = type(value).__module__
    return (module.startswith("hpcinfer.model") or module.startswith("hpcinfer.parallel")) and \
        type(value).__name__ not in ("Dispatcher",)


def parts_of(value) -> list:
    """The arrays a weight slot's value is made of, in a fixed order (kind_of says how to put them back)."""
    if _is_quantized(value):
        return [value.q, value.scale] + ([] if value.min is None else [value.min])
    return list(value) if isinstance(value, list) else [value]


def kind_of(value) -> tuple:
    """How to put a slot back together: ("quant", the quantized tensor with its arrays taken out, has min),
    ("list", n) or ("array",)."""
    if _is_quantized(value):
        return ("quant", dataclasses.replace(value, q=None, scale=None, min=None), value.min is not None)
    return ("list", len(value)) if isinstance(value, list) else ("array",)


def assemble(kind: tuple, arrays: list):
    """parts_of's inverse: the slot's value from its arrays."""
    if kind[0] == "quant":
        _, empty, has_min = kind
        return dataclasses.replace(empty, q=arrays[0], scale=arrays[1], min=arrays[2] if has_min else None)
    return list(arrays) if kind[0] == "list" else arrays[0]


def assemble_slots(kinds: list, arrays: list) -> list:
    """The values of slots of these kinds from all their arrays in order (parts_of of each, concatenated)."""
    out, at = [], 0
    for kind in kinds:
        out.append(assemble(kind, arrays[at:at + part_count(kind)]))
        at += part_count(kind)
    return out


def part_count(kind: tuple) -> int:
    """How many arrays a slot of this kind is made of."""
    if kind[0] == "quant":
        return 3 if kind[2] else 2
    return kind[1] if kind[0] == "list" else 1


def _nbytes(value) -> int:
    return sum(int(a.nbytes) for a in parts_of(value))


class TierMemory:
    """What the offload tiers of one rank hold at once, part by part, and the peak of each tier's total: the two
    counters the budgets `device_memory` and `host_memory` are checked against after a run (the plan,
    budget.plan_bytes, before it). Parts on the device: "layers" (resident + streamed, WeightTiers),
    "embedding tables", "KV cache" (device caches and device rows, with the staging buffers) and "activations"
    (held hidden states, or device rows and staging buffers); on the host: "layers" (pinned host layers, or this
    rank's parts of them with partitioned fetch), "KV cache rows" and "activation rows". Updated from the prefetch
    threads too (a lock); `peak_parts[tier]` is the split of that tier's peak."""

    def __init__(self):
        self.parts: dict = {"device": {}, "host": {}}        # tier -> part -> bytes held now
        self.peak = {"device": 0, "host": 0}
        self.peak_parts: dict = {"device": {}, "host": {}}   # tier -> the parts at its peak
        self.lock = threading.Lock()

    def hold(self, tier: str, part: str, nbytes: int) -> None:
        """`part` of `tier` holds `nbytes` from now on (0 when freed)."""
        with self.lock:
            self.parts[tier][part] = int(nbytes)
            self._update(tier)

    def add(self, tier: str, part: str, nbytes: int) -> None:
        """`part` of `tier` holds `nbytes` more (fewer when negative)."""
        with self.lock:
            self.parts[tier][part] = self.parts[tier].get(part, 0) + int(nbytes)
            self._update(tier)

    def total(self, tier: str) -> int:
        with self.lock:
            return sum(self.parts[tier].values())

    def _update(self, tier: str) -> None:
        now = sum(self.parts[tier].values())
        if now > self.peak[tier]:
            self.peak[tier], self.peak_parts[tier] = now, dict(self.parts[tier])


def place_layers(num_layers: int, weights_gpu: float, weights_cpu: float) -> list[str]:
    """Tier of each layer from the placement percentages (FlexGen places weights at layer granularity): the first
    layers on the device, then host, then disk, in the proportions asked."""
    n_dev = round(num_layers * weights_gpu / 100)
    n_host = round(num_layers * (weights_gpu + weights_cpu) / 100) - n_dev
    return ["device"] * n_dev + ["host"] * n_host + ["disk"] * (num_layers - n_dev - n_host)


class WeightTiers:
    """The weights of a model's blocks across tiers, with `fetch(i)` / `release(i)` around each use.

    fetch_group: a CommGroup of the replicas that share each fetch (partitioned fetch), or None. threads_ok: the
    fetch group may be used from a prefetch thread (MPI_THREAD_MULTIPLE); if not, and the group gathers in host
    memory, rounds run on the main thread and nothing is prefetched. gather_on_device: the fetch group all-gathers
    device arrays (an NCCL group): each rank copies only its part to the device (prefetched) and the layer is
    assembled there by an all-gather on the main thread (else in host memory, then copied)."""

    def __init__(self, ops, blocks: list, tiers: list[str], disk_dir: str | None, prefetch_layers: int = 0,
                 fetch_group=None, threads_ok: bool = True, gather_on_device: bool = False):
        self.group = fetch_group if fetch_group is not None and fetch_group.size > 1 else None
        self.gather_on_device = self.group is not None and gather_on_device
        if self.group is not None and not threads_ok and not self.gather_on_device:
            prefetch_layers = 0
        self.ops, self.blocks, self.tiers, self.prefetch_layers = ops, blocks, tiers, prefetch_layers
        self.copies = ops.copy_engine()                   # pinned buffers, a copy stream and events on a GPU
        self.tensors: list = [[] for _ in blocks]         # layer -> [(holder, key)]
        self.kinds: list = [[] for _ in blocks]           # layer -> [kind_of each slot]
        self.layer_bytes = [0] * len(blocks)
        self.host: dict = {}                              # (layer, n) -> [pinned host arrays] (slot n's parts)
        self.disk: dict = {}                              # (layer, n) -> [file paths]
        self.images: dict = {}                            # layer -> LayerImage (partitioned fetch)
        self.disk_dir = disk_dir
        self.resident: set = set()
        self.pending: dict = {}                           # layer -> Future of its fetch
        rounds_on_thread = self.group is not None and not self.gather_on_device
        workers = 1 if rounds_on_thread else max(1, prefetch_layers)             # rounds keep one order
        # CUDA's current device is per host thread: the prefetch threads bind this rank's GPU (ops.use_device)
        self.pool = ThreadPoolExecutor(workers, initializer=ops.use_device) if prefetch_layers else None
        self.lock = threading.Lock()
        self.device_bytes = self.peak_bytes = 0
        self.memory = TierMemory()                        # what the tiers hold at once; the schedules add theirs
        self.bytes_from_host = self.bytes_from_disk = 0
        self.streamed = [i for i, t in enumerate(tiers) if t != "device"]
        self.cursor = 0                                   # partitioned: index in `streamed` of the next round
        self.closed = False

    def place(self, i: int) -> None:
        """Called once block i has loaded its weights: keep them (device tier) or move them to host or disk, so
        that loading never holds more than one streamed layer at a time."""
        self.tensors[i] = layer_tensors(self.blocks[i], (np.ndarray, self.ops.xp.ndarray))
        values = [getattr(h, k) for h, k in self.tensors[i]]
        self.kinds[i] = [kind_of(v) for v in values]
        self.layer_bytes[i] = sum(_nbytes(v) for v in values)
        if self.tiers[i] == "device":
            self.resident.add(i)
            self._on_device(self.layer_bytes[i])
        elif self.group is not None:
            arrays = [self.ops.to_host(a) for v in values for a in parts_of(v)]
            path = self._path(i, "part", self.group.rank) if self.tiers[i] == "disk" else None
            self.images[i] = LayerImage.build(arrays, self.group, self.tiers[i], path, self.copies.host_copy)
            self._drop(i)
            if self.tiers[i] == "host":                   # this rank's part and its flag byte
                self.memory.add("host", "layers", int(self.images[i].host.nbytes))
        else:
            self._offload(i, self.tiers[i])
            if self.tiers[i] == "host":
                self.memory.add("host", "layers", sum(int(a.nbytes) for n in range(len(self.tensors[i]))
                                                      for a in self.host[i, n]))

    def _on_device(self, nbytes: int) -> None:
        """The device holds `nbytes` more of layers (fewer when negative): the weights' peak and the tiers'."""
        with self.lock:
            self.device_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.device_bytes)
            self.memory.hold("device", "layers", self.device_bytes)

    # ---- placing -------------------------------------------------------------------------------------------
    def _offload(self, i: int, tier: str) -> None:
        """Move layer i's arrays out of the block into its tier (the block's attributes become None)."""
        for n, (holder, key) in enumerate(self.tensors[i]):
            parts = parts_of(getattr(holder, key))
            if tier == "host":
                self.host[i, n] = [self.copies.host_copy(self.ops.to_host(a)) for a in parts]
            else:
                self.disk[i, n] = [self._write(self._path(i, f"t{n:03d}", j), a) for j, a in enumerate(parts)]
        self._drop(i)

    def _drop(self, i: int) -> None:
        for holder, key in self.tensors[i]:
            setattr(holder, key, None)

    def _path(self, i: int, what: str, j: int) -> str:
        if self.disk_dir is None:
            raise ConfigError("[offload] weights on disk need [offload] disk_dir")
        return os.path.join(self.disk_dir, f"layer{i:04d}-{what}-{j:04d}.npy")

    def _write(self, path: str, array) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, self.ops.to_host(array))
        return path

    # ---- streaming -----------------------------------------------------------------------------------------
    def fetch(self, i: int) -> None:
        """Make layer i's weights usable now (by the work issued from now on: on a GPU the compute stream waits for
        the copies, the host does not), waiting for its prefetch if one is in flight, and start fetching
        the next `prefetch_layers` streamed layers, wrapping from the last layer of a token step to the first of
        the next (every schedule fetches the layers in this cyclic order; after the last step of a run, the
        wrapped prefetches are dropped by `close`)."""
        if i not in self.resident:
            self._install(i, self._take(i))
        if self.pool is None:
            return
        for j in self._ahead(i):
            if j not in self.resident and j not in self.pending:
                self.pending[j] = self._start(j)

    def _take(self, i: int) -> list:
        """Layer i's slot values from its prefetch, or read now."""
        future = self.pending.pop(i, None)
        if future is None and self.group is not None and not self.gather_on_device and self.pool is not None:
            future = self._start(i)                       # host rounds go through the one thread, in order
        fetched = future.result() if future is not None else self._read(i)
        if self.gather_on_device:                         # the part is (on its way) on the device: the round
            return self._round(i, working=True, part=fetched)[1]
        return fetched.arrays()

    def _ahead(self, i: int) -> list[int]:
        """The `prefetch_layers` streamed layers that follow layer i in the cyclic fetch order."""
        after = [j for j in self.streamed if j > i] + [j for j in self.streamed if j < i]
        return after[:self.prefetch_layers]

    def _start(self, i: int):
        return self.pool.submit(self._read, i)

    def release(self, i: int) -> None:
        """Drop layer i's streamed weights from the device (resident layers stay)."""
        if self.tiers[i] == "device" or i not in self.resident:
            return
        with self.copies.freeing():                      # its memory is reused after the work issued so far
            self._drop(i)
        self.resident.discard(i)
        self._on_device(-self.layer_bytes[i])

    def _read(self, i: int):
        """Start layer i's copies from its tier into new device arrays (runs on a prefetch thread too): host
        arrays are pinned and copied as they are, disk arrays are read from their memory map into pinned staging.
        With a fetch group: gathered on the device, the upload of this rank's part (the round comes in `_take`);
        gathered in host memory, the whole round."""
        self._on_device(self.layer_bytes[i])              # the bytes are on the device from now on
        if self.gather_on_device:
            return self._upload_part(i)
        if self.group is not None:
            return Ready(self._round(i, working=True)[1])
        slots = range(len(self.kinds[i]))
        if self.tiers[i] == "host":
            sources = [a for n in slots for a in self.host[i, n]]
        else:
            sources = [np.load(p, mmap_mode="r") for n in slots for p in self.disk[i, n]]
        self._count(i, sum(int(a.nbytes) for a in sources))
        return _Fetched(self.kinds[i], self.copies.upload(sources, pinned=self.tiers[i] == "host"))

    def _upload_part(self, i: int):
        """Start uploading this rank's part of layer i (gathered on the device; any thread)."""
        self._count(i, self.images[i].part)                # this rank's 1/N of the layer, from host or disk
        return self.images[i].upload_mine(self.copies)

    def _count(self, i: int, nbytes: int) -> None:
        with self.lock:
            if self.tiers[i] == "host":
                self.bytes_from_host += nbytes
            else:
                self.bytes_from_disk += nbytes

    def _round(self, i: int, working: bool, part=None) -> tuple[bool, list]:
        """One collective fetch round of layer i: (whether any member is still working, the slot values). part:
        gathered on the device, the Upload of this rank's part (made now if None)."""
        expected = self.streamed[self.cursor]
        assert i == expected, f"partitioned fetch out of order: layer {i}, the round is for layer {expected}"
        self.cursor = (self.cursor + 1) % len(self.streamed)
        image = self.images[i]
        if self.gather_on_device:                          # host -> device: only this rank's part
            mine = (part if part is not None else self._upload_part(i)).arrays()[0]
        else:
            self._count(i, image.part)                     # this rank's 1/N of the layer, from host or disk
            mine = image.read_mine()
        anyone, arrays = image.gather(mine, working)       # comm: the all-gather assembles the layer
        if not self.gather_on_device:                      # host -> device: the whole layer
            arrays = self.copies.upload(arrays, pinned=False).arrays()
        return anyone, assemble_slots(self.kinds[i], arrays)

    def _install(self, i: int, arrays: list) -> None:
        for (holder, key), value in zip(self.tensors[i], arrays):
            setattr(holder, key, value)
        self.resident.add(i)

    def close(self) -> None:
        """End streaming: drop prefetches still in flight; with a fetch group, join rounds until every member has
        ended (a member still generating needs this rank's part of each layer)."""
        if self.closed:
            return
        self.closed = True
        parts = {}                                        # gathered on the device: prefetched parts, for the rounds
        for i, future in list(self.pending.items()):
            future.result()                               # a host round in flight moves the cursor: wait for it
            parts[i] = future
            self._on_device(-self.layer_bytes[i])
        self.pending.clear()
        while self.group is not None and self.streamed:
            i = self.streamed[self.cursor]
            if self.gather_on_device:                     # this rank's parts still go ahead of the rounds
                for j in self._ahead(i) if self.pool is not None else ():
                    parts.setdefault(j, self.pool.submit(self._upload_part, j))
                part = parts.pop(i, None)
                anyone, _ = self._round(i, False, part.result() if part is not None else None)
            elif self.pool is not None:
                anyone, _ = self.pool.submit(self._round, i, False).result()
            else:
                anyone, _ = self._round(i, False)
            if not anyone:
                break
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.copies.close()


class _Fetched:
    """A layer's upload in flight: arrays() gives its slot values, usable by the compute issued next."""

    def __init__(self, kinds: list, upload):
        self.kinds, self.upload = kinds, upload

    def arrays(self) -> list:
        return assemble_slots(self.kinds, self.upload.arrays())
