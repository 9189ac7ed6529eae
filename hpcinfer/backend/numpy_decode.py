"""Decode attention of the NumPy backend: one new token per sequence over its cached rows, on the rank's threads.

A decode step's attention is, per sequence and KV head, two GEMMs with as many rows as the head's query group (3
for SmolLM2): far below OpenBLAS's threading threshold, so BLAS runs each on one core and the step reads K and V at
one core's bandwidth (about 19 GB/s of the machine's 42 here; issue 23, bench/results/cpu-ops-*.md). The sequences
are independent, so they are split into contiguous row blocks, one per thread (the caller's and `threads - 1`
workers of a pool; np.matmul releases the GIL): each sequence's arithmetic is the one it has alone, so the result
is bit for bit the single-threaded one whatever the split. A short step stays on the caller's thread
(MIN_PART_BYTES).

The scores and the scaled queries live in buffers reused from step to step (one per thread, grown to the longest
step seen): a decode step allocates only its output and a few [S, Hkv, g, 1] reductions.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

F32 = np.float32
MIN_PART_BYTES = 1 << 20  # K/V bytes a thread must read for a split to pay: a hand-off to a worker costs ~50 us,
                          # what one core reads of 1 MiB (a step of 8 x 128 positions of SmolLM2 is break-even)


def usable_cores() -> int:
    """The cores this process may run on (OpenBLAS's own default thread count)."""
    return len(os.sched_getaffinity(0))


class DecodeAttention:
    """q [S, H, hd] over keys, values [S, Hkv, L, hd], of which sequence s reads its first lengths[s] positions ->
    [S, H*hd], the sequences split over `threads` threads."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._scratch: dict = {}                              # (part, name) -> flat float32 buffer

    def __call__(self, q, keys, values, lengths, scale: float) -> np.ndarray:
        S, heads, hd = q.shape
        out = np.empty((S, heads * hd), dtype=F32)
        work = (keys.nbytes + values.nbytes) // MIN_PART_BYTES
        bounds = np.linspace(0, S, max(1, min(self.threads, S, work)) + 1).astype(int)  # [parts + 1] row blocks
        parts = [(p, int(a), int(b)) for p, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        futures = [self._workers().submit(self._rows, p, q[a:b], keys[a:b], values[a:b], lengths[a:b], scale,
                                          out[a:b]) for p, a, b in parts[1:]]
        p, a, b = parts[0]                                    # the caller's own block
        try:
            self._rows(p, q[a:b], keys[a:b], values[a:b], lengths[a:b], scale, out[a:b])
        finally:
            wait(futures)                                     # no worker outlives the call (its scratch is reused)
        for future in futures:
            future.result()                                   # re-raises a worker's exception here
        return out

    def _rows(self, part: int, q, keys, values, lengths, scale: float, out) -> None:
        """One row block: out [s, H*hd] (a view of the step's output) = softmax(q K^T, masked) V."""
        s, heads, hd = q.shape
        kv_heads, L = keys.shape[1], keys.shape[2]
        group = heads // kv_heads
        qg = np.multiply(q, F32(scale), out=self._view(part, "q", q.shape)).reshape(s, kv_heads, group, hd)
        scores = np.matmul(qg, keys.transpose(0, 1, 3, 2), out=self._view(part, "scores", (s, kv_heads, group, L)))
        for row in np.flatnonzero(lengths < L):              # positions past a sequence's length weigh 0
            scores[row, :, :, int(lengths[row]):] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        np.matmul(scores, values, out=out.reshape(s, kv_heads, group, hd))

    def _view(self, part: int, name: str, shape: tuple) -> np.ndarray:
        """A float32 array of `shape` over this thread's reused buffer `name`."""
        size = int(np.prod(shape))
        buffer = self._scratch.get((part, name))
        if buffer is None or buffer.size < size:
            buffer = self._scratch[(part, name)] = np.empty(max(size, 2 * (0 if buffer is None else buffer.size)),
                                                            dtype=F32)
        return buffer[:size].reshape(shape)

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hpcinfer-attention")
        return self._pool
