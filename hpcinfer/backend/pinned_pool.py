"""Pinned staging buffers reused across copies (the CuPy copy engine's, backend/cupy_transfer.py).

A copy from memory that is not pinned (the disk tier's memory maps, a layer gathered in host memory, CPU
delegation's queries and outputs) goes through a pinned staging buffer: CUDA would otherwise stage it itself,
synchronously, through a driver buffer, and overlap nothing. Pinning memory costs (cudaHostAlloc maps and locks
pages: milliseconds for a layer's worth), so the buffers are kept and handed out again, each once the copy that
last used it has run (its event is done). A buffer in use stays out of the pool; the pool grows only while every
buffer that fits is still in flight, so it holds about as many buffers as there are copies in flight at once
(the prefetch depth), at sizes rounded up to a power of two (a layer's upload finds the last layer's buffer).
"""

from __future__ import annotations

import threading

import numpy as np

MIN_BYTES = 1 << 16          # the smallest buffer (small copies share one size class)
ALIGN = 512                  # each array of a multi-array staging buffer starts at a multiple of this


def size_class(nbytes: int) -> int:
    """The buffer size a request of `nbytes` gets: the next power of two, at least MIN_BYTES."""
    return max(MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())


def packed_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of arrays of these byte sizes laid one after another, each aligned to ALIGN; the total bytes."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-int(n) // ALIGN) * ALIGN
    return offsets, end


class PinnedPool:
    """Pinned uint8 buffers: take(nbytes) gives one no copy still uses, give(buffer, event) returns it with the
    event after which it may be reused (None: at once)."""

    def __init__(self, empty_pinned):
        self._empty_pinned = empty_pinned
        self._lock = threading.Lock()
        self._free: list = []                 # [(buffer, event or None)]: not handed out
        self.allocated = 0                    # buffers ever pinned (a test or a report reads it)
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A pinned uint8 buffer of at least `nbytes` whose last copy has run: the smallest such free one, else a
        new one."""
        with self._lock:
            fits = [(b.nbytes, k) for k, (b, event) in enumerate(self._free)
                    if b.nbytes >= nbytes and (event is None or event.done)]
            if fits:
                return self._free.pop(min(fits)[1])[0]
            self.allocated += 1
            size = size_class(nbytes)
            self.allocated_bytes += size
        return self._empty_pinned((size,), dtype=np.uint8)

    def give(self, buffer: np.ndarray, event=None) -> None:
        with self._lock:
            self._free.append((buffer, event))

    def staged(self, arrays: list) -> tuple[np.ndarray, list]:
        """(a buffer, its views holding copies of `arrays`, C-contiguous, dtypes and shapes kept)."""
        host = [np.asarray(a) for a in arrays]
        offsets, total = packed_offsets([a.nbytes for a in host])
        buffer = self.take(total)
        views = []
        for a, at in zip(host, offsets):
            view = buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            views.append(view)
        return buffer, views

    @property
    def free_buffers(self) -> int:
        return len(self._free)
