"""CUDA graphs for decode steps on the CuPy backend: `DeviceStep` (a decode step whose slots and starts live in
device buffers, with a fixed KV-length bucket, so attention reads no host value), `kv_bucket` (the bucket of a
length) and `DecodeGraph` (capture a decode step once per (batch size, bucket), then replay it with new inputs
copied into the captured buffers). generate/graphs.py drives it; tests/test_cuda_graphs.py and
tests/test_cupy_emulated.py check it on the CPU fake of cupy (tests/emu_cupy/).

Shape legend: S=sequences in the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .ops import StepLayout

if TYPE_CHECKING:
    from .cupy_ops import CupyOps


@dataclass(frozen=True)
class DeviceStep(StepLayout):
    """A decode step whose slots and starts also live in device buffers, with a fixed number of cached positions
    read (`kv_len`, a bucket >= every sequence's length). `attention` then reads no host metadata, so the step can
    be captured in a CUDA graph and replayed with new values written into the same buffers (DecodeGraph)."""

    slots_d: object = None       # [S] int64 device
    starts_d: object = None      # [S] int64 device
    kv_len: int = 0

    @property
    def positions(self):
        """[S] int64 device: one new token per sequence, at its start (the model's rotary and learned-position
        lookups then gather on the device from the graph's own buffer)."""
        return self.starts_d


def kv_bucket(length: int, smallest: int = 64) -> int:
    """Positions a captured decode step reads: the next power of two >= length (at least `smallest`), so a
    generation of n tokens needs about log2(n) graphs per batch size."""
    bucket = smallest
    while bucket < length:
        bucket *= 2
    return bucket


@dataclass
class _Captured:
    graph: object
    inputs: dict                 # name -> static device buffer the graph reads
    slots: object                # [S] int64 static device buffer
    starts: object               # [S] int64 static device buffer
    output: object               # static device buffer the graph writes


class DecodeGraph:
    """Capture a decode step once per (batch size, KV-length bucket) with CUDA stream capture; replay it after
    copying the new inputs into the captured (static) buffers.

    `step_fn(inputs, step)` must compute the step from device arrays only: `inputs` (name -> device array, same
    shapes and dtypes at every call of one key) and `step` (a DeviceStep: its device slots/starts and kv_len are
    what attention reads; its host fields hold the capture-time values and must not steer the computation).
    Constraints (checked by CUDA at capture, where possible):
    - no host <-> device copy, no host sync (`int(x)`, boolean masks, `.get()`, `cupy.asarray(numpy)`) inside:
      the model reads the step's positions from `DeviceStep.positions` (device; rotary and learned positions
      gather on the device), the token ids from `inputs`, and takes no last-token gather in a decode step
      (generate/graphs.py drives it; tests/test_cuda_graphs.py checks it on the CPU fake of cupy);
    - the step must be idempotent for equal inputs: the first call runs it eagerly (a warm-up that compiles
      kernels and lets cuBLAS allocate), then captures, then replays, so the KV append happens twice at the same
      position with the same values;
    - collectives inside are allowed only over NCCL (they are captured on the capture stream; every rank of the
      communicator must replay the same graphs in the same order, which holds when all tp ranks step together);
      MPI calls (comm = "mpi") cannot be captured;
    - memory allocated during capture comes from a pool private to this object and stays reserved until
      `close()`; the returned output is a static buffer, overwritten by the next replay of the same key;
    - the graphs hold the addresses of every array the step read or wrote (the KV cache's included): those arrays
      must stay allocated, and be reused in place, for as long as the graphs are replayed.
    """

    def __init__(self, ops: CupyOps, smallest_bucket: int = 64):
        cp = ops.xp
        self.ops, self.smallest_bucket = ops, smallest_bucket
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.captured: dict[tuple, _Captured] = {}
        self.captures = 0            # graphs captured by this object, closed ones included (metrics)

    def key(self, starts) -> tuple[int, int]:
        starts = np.asarray(starts)
        return len(starts), kv_bucket(int(starts.max()) + 1, self.smallest_bucket)

    def __call__(self, step_fn, inputs: dict, slots, starts):
        """Run the decode step for sequences `slots` (host [S]) at positions `starts` (host [S]) with `inputs`;
        returns the step's output (a static device buffer; copy it to keep it past the next replay)."""
        cp = self.ops.xp
        key = self.key(starts)
        entry = self.captured.get(key)
        if entry is None:
            entry = self._capture(key, step_fn, inputs, slots, starts)
        for name, value in inputs.items():
            if isinstance(value, cp.ndarray):
                cp.copyto(entry.inputs[name], value)
            else:
                entry.inputs[name].set(np.ascontiguousarray(value, dtype=entry.inputs[name].dtype))
        entry.slots.set(np.asarray(slots, dtype=np.int64))
        entry.starts.set(np.asarray(starts, dtype=np.int64))
        entry.graph.launch(stream=cp.cuda.get_current_stream())
        return entry.output

    def _capture(self, key, step_fn, inputs, slots, starts) -> _Captured:
        cp = self.ops.xp
        S, kv_len = key
        static = {name: cp.array(value, copy=True) for name, value in inputs.items()}     # host or device
        slots_d = cp.asarray(np.asarray(slots, dtype=np.int64))
        starts_d = cp.asarray(np.asarray(starts, dtype=np.int64))
        step = DeviceStep(np.asarray(slots, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                          np.ones(S, dtype=np.int64), slots_d, starts_d, kv_len)
        step_fn(static, step)                                        # warm-up, eager
        cp.cuda.get_current_stream().synchronize()
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                output = step_fn(static, step)
            except Exception as exc:
                try:
                    self.stream.end_capture()
                except Exception:  # noqa: BLE001 - the capture is already broken; report the first error
                    pass
                raise RuntimeError(f"decode step for batch {S}, KV bucket {kv_len} cannot be captured in a CUDA "
                                   f"graph: {exc}") from exc
            graph = self.stream.end_capture()
        entry = _Captured(graph, static, slots_d, starts_d, output)
        self.captured[key] = entry
        self.captures += 1
        return entry

    def close(self) -> None:
        """Drop the graphs and hand their private memory pool back to the device."""
        self.captured.clear()
        self.pool.free_all_blocks()
