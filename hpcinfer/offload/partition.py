"""Partitioned fetch (ZeRO-Inference with several ranks per node): a streamed layer as one flat byte image, split
into N equal parts over the N replicas of a fetch group. Each rank keeps only its part (in its host store or in
one file), reads only its part at each fetch, and an all-gather over the group assembles the whole image on every
member, so the slow link carries each byte of a layer once per group instead of once per rank.

Image layout: the layer's arrays (float matrices, expert stacks' arrays, quantized q / scale / min) one after
another, each at an offset aligned to ALIGN bytes; zero padding up to N equal parts. Each part travels with one
extra byte, the sender's "still working" flag, so that a rank whose generation has ended can keep joining rounds
until every member has ended (tiers.WeightTiers.close).

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
    host: np.ndarray | None      # this rank's part [P] (host tier)
    path: str | None             # the file of this rank's part (disk tier)

    @classmethod
    def build(cls, arrays: list, group, tier: str, path: str) -> "LayerImage":
        """Lay out `arrays` (host arrays, in order) and keep this rank's part in `tier`."""
        specs, offset = [], 0
        for a in arrays:
            specs.append((a.dtype, a.shape, offset))
            offset += -(-int(a.nbytes) // ALIGN) * ALIGN
        part = max(1, -(-offset // group.size))
        image = np.zeros(part * group.size, np.uint8)                               # [I]
        for a, (_, _, at) in zip(arrays, specs):
            image[at:at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        mine = image[group.rank * part:(group.rank + 1) * part]                     # [P]
        if tier == "host":
            return cls(specs, part, group, mine.copy(), None)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, mine)
        return cls(specs, part, group, None, path)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds in its tier."""
        return self.part

    def read_mine(self) -> np.ndarray:
        """This rank's part, read from its tier into a send buffer [P + 1] (the last byte for the flag)."""
        buffer = np.empty(self.part + 1, np.uint8)
        buffer[:-1] = self.host if self.host is not None else np.load(self.path, mmap_mode="r")
        return buffer

    def gather(self, buffer: np.ndarray, working: bool) -> tuple[bool, list]:
        """All-gather the parts: (whether any member is still working, the layer's arrays as views of the
        assembled image)."""
        buffer[-1] = 1 if working else 0
        parts = self.group.all_gather(buffer)                                       # [N, P + 1]
        image = np.ascontiguousarray(parts[:, :-1]).reshape(-1)                     # [I]
        arrays = [image[at:at + _nbytes(dtype, shape)].view(dtype).reshape(shape) for dtype, shape, at in self.specs]
        return bool(parts[:, -1].any()), arrays


def _nbytes(dtype, shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
