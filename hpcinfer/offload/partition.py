"""Partitioned fetch (ZeRO-Inference with several ranks per node): a streamed layer as one flat byte image, split
into N equal parts over the N replicas of a fetch group. Each rank keeps only its part (in its host store or in
one file), reads only its part at each fetch, and an all-gather over the group assembles the whole image on every
member, so the slow link carries each byte of a layer once per group instead of once per rank.

Image layout: the layer's arrays (float matrices, expert stacks' arrays, quantized q / scale / min) one after
another, each at an offset aligned to ALIGN bytes; zero padding up to N equal parts. Each part is stored and
travels with one extra byte, the sender's "still working" flag, so that a rank whose generation has ended can keep
joining rounds until every member has ended (tiers.WeightTiers.close); storing it makes a part one contiguous
copy from its tier.

Where the image is assembled: in host memory (NumPy backend, or a CuPy backend whose fetch group is a plain MPI
group: the caller then copies the whole layer to the device), or on the device, when the caller uploads its part
and the group all-gathers device arrays (an NCCL group, as ZeRO-Inference does): then the slow host -> device link
also carries 1/N of the layer per rank, and the layer's arrays are device views of the device image. `gather` does
both: the image lives in the memory its buffer came from. The upload of a part (`upload_mine`) is this rank's own
business and may be prefetched; the all-gather is collective and runs in the same order on every member.

Shape legend: N members of the fetch group, P bytes of one part, I = N P bytes of the image.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

ALIGN = 64


@dataclass
class LayerImage:
    specs: list                  # [(dtype, shape, offset)] of the layer's arrays in the image
    part: int                    # P: bytes of each member's part
    group: object                # the fetch group (a CommGroup)
    host: np.ndarray | None      # this rank's part and its flag byte [P + 1] (host tier)
    path: str | None             # the file of this rank's part and its flag byte [P + 1] (disk tier)

    @classmethod
    def build(cls, arrays: list, group, tier: str, path: str, host_copy=np.copy) -> "LayerImage":
        """Lay out `arrays` (host arrays, in order) and keep this rank's part in `tier` (host: in the buffer
        `host_copy` makes, pinned on a GPU)."""
        specs, offset = [], 0
        for a in arrays:
            specs.append((a.dtype, a.shape, offset))
            offset += -(-int(a.nbytes) // ALIGN) * ALIGN
        part = max(1, -(-offset // group.size))
        image = np.zeros(part * group.size, np.uint8)                               # [I]
        for a, (_, _, at) in zip(arrays, specs):
            image[at:at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        mine = np.zeros(part + 1, np.uint8)                                         # [P + 1]
        mine[:-1] = image[group.rank * part:(group.rank + 1) * part]
        if tier == "host":
            return cls(specs, part, group, host_copy(mine), None)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, mine)
        return cls(specs, part, group, None, path)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds in its tier."""
        return self.part

    def stored(self) -> np.ndarray:
        """This rank's part and flag byte [P + 1] where they lie: the host buffer, or a memory map of the file."""
        return self.host if self.host is not None else np.load(self.path, mmap_mode="r")

    def read_mine(self) -> np.ndarray:
        """This rank's part, read from its tier into a host send buffer [P + 1] (the last byte for the flag)."""
        return np.array(self.stored())

    def upload_mine(self, copies):
        """Start copying this rank's part into a new device send buffer [P + 1] through the copy engine (pinned
        host part; a disk part through pinned staging); any thread. The Upload's arrays()[0] is the buffer, usable
        by the compute (and the collective) issued after that call."""
        return copies.upload([self.stored()], pinned=self.host is not None)

    def gather(self, buffer, working: bool) -> tuple[bool, list]:
        """All-gather the parts: (whether any member is still working, the layer's arrays as views of the
        assembled image). `buffer` is read_mine's, or a device copy of it when the group gathers device arrays:
        the image is assembled in that memory, and the arrays are views of it there."""
        buffer[-1] = 1 if working else 0
        parts = self.group.all_gather(buffer)                                       # [N, P + 1], buffer's memory
        image = parts[:, :-1].reshape(-1)                                           # [I] (a copy: drops the flags)
        held_as = (lambda dtype: dtype) if isinstance(image, np.ndarray) else _device_dtype
        arrays = [image[at:at + _nbytes(dtype, shape)].view(held_as(dtype)).reshape(shape)
                  for dtype, shape, at in self.specs]
        return bool(parts[:, -1].any()), arrays


def fetch_share(dp: int, tp: int, ranks_per_node: int) -> int:
    """Replicas of a partitioned fetch group: the dp ranks of one node that hold the same tp shard (each fetches
    1/f of a layer and the group all-gathers it)."""
    return min(dp, max(1, ranks_per_node // tp))


def _nbytes(dtype, shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _device_dtype(dtype):
    """A host dtype as device arrays hold it: bfloat16 as its uint16 bits (cupy has no bfloat16; the CuPy
    backend's to_host gives bfloat16 views of them, asarray takes them back as bits)."""
    return np.uint16 if np.dtype(dtype).name == "bfloat16" else dtype
