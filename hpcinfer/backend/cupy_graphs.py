"""CUDA graphs for decode steps on the CuPy backend: `DeviceStep` (a decode step whose slots and starts live in
device buffers, with a fixed KV-length bucket, so attention reads no host value), `kv_bucket` (the bucket of a
length) and `DecodeGraph` (capture a decode step once per (batch size, bucket), then replay it with new inputs
copied into the captured buffers). generate/graphs.py drives it; tests/generate/test_cuda_graphs.py and
tests/backend/test_cupy_emulated.py check it on the CPU fake of cupy (tests/helpers/emu_cupy/).

Shape legend: S=sequences in the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .interface import StepLayout

log = logging.getLogger("hpcinfer")


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
      (generate/graphs.py drives it; tests/generate/test_cuda_graphs.py checks it on the CPU fake of cupy);
    - the step must be idempotent for equal inputs: the first call of a key runs it eagerly (a warm-up that
      compiles kernels and lets the pool allocate), then captures, then replays, so the KV append happens twice at
      the same position with the same values;
    - no cuBLAS: CuPy refuses any cuBLAS call while a stream captures (NotImplementedError). A key whose warm-up
      called cuBLAS (`CupyOps.library_calls` moved: the step left the cuda_src/ kernels, e.g. more than
      SBI_MAX_TOKENS sequences, GQA groups or head dims past the attention kernel's limits, quantized weights on
      the tiled path) is never captured: it runs eagerly from then on (`eager_keys`, `eager_steps`), said once in
      the log. So does a key whose capture fails for any other reason (logged with the error): a graph never
      ends a job;
    - collectives inside are allowed only over NCCL (they are captured on the capture stream; every rank of the
      communicator must replay the same graphs in the same order, which holds when all tp ranks step together:
      the eager/captured decision depends only on shapes, the same on every tp rank); MPI calls (comm = "mpi")
      cannot be captured;
    - memory allocated during capture comes from a pool private to this object and stays reserved until
      `close()`; the returned output is a static buffer, overwritten by the next replay of the same key;
    - the graphs hold the addresses of every array the step read or wrote (the KV cache's included): those arrays
      must stay allocated, and be reused in place, for as long as the graphs are replayed.
    """

    def __init__(self, ops, smallest_bucket: int = 64):                  # ops: a CupyOps
        cp = ops.xp
        self.ops, self.smallest_bucket = ops, smallest_bucket
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.captured: dict[tuple, _Captured] = {}
        self.captures = 0            # graphs captured by this object, closed ones included (metrics)
        self.eager_keys: dict[tuple, str] = {}   # keys that run eagerly -> why
        self.eager_steps = 0         # steps run eagerly under eager_keys, warm-ups included (metrics)

    def key(self, starts) -> tuple[int, int]:
        starts = np.asarray(starts)
        return len(starts), kv_bucket(int(starts.max()) + 1, self.smallest_bucket)

    def __call__(self, step_fn, inputs: dict, slots, starts):
        """Run the decode step for sequences `slots` (host [S]) at positions `starts` (host [S]) with `inputs`;
        returns the step's output (a static device buffer for a captured key: copy it to keep it past the next
        replay)."""
        cp = self.ops.xp
        key = self.key(starts)
        if key in self.eager_keys:
            self.eager_steps += 1
            device_inputs = {name: cp.asarray(value) for name, value in inputs.items()}
            return step_fn(device_inputs, StepLayout.build(slots, starts, np.ones(len(starts), dtype=np.int64)))
        entry = self.captured.get(key)
        if entry is None:
            entry, output = self._capture(key, step_fn, inputs, slots, starts)
            if entry is None:
                return output                                        # the warm-up's output: this step is done
        for name, value in inputs.items():
            if isinstance(value, cp.ndarray):
                cp.copyto(entry.inputs[name], value)
            else:
                entry.inputs[name].set(np.ascontiguousarray(value, dtype=entry.inputs[name].dtype))
        entry.slots.set(np.asarray(slots, dtype=np.int64))
        entry.starts.set(np.asarray(starts, dtype=np.int64))
        entry.graph.launch(stream=cp.cuda.get_current_stream())
        return entry.output

    def _capture(self, key, step_fn, inputs, slots, starts) -> tuple[_Captured | None, object]:
        """(the captured entry, None), or (None, the warm-up's output) when the key must run eagerly."""
        cp = self.ops.xp
        S, kv_len = key
        static = {name: cp.array(value, copy=True) for name, value in inputs.items()}     # host or device
        slots_d = cp.asarray(np.asarray(slots, dtype=np.int64))
        starts_d = cp.asarray(np.asarray(starts, dtype=np.int64))
        step = DeviceStep(np.asarray(slots, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                          np.ones(S, dtype=np.int64), slots_d=slots_d, starts_d=starts_d, kv_len=kv_len)
        library_calls = self.ops.library_calls
        warm = step_fn(static, step)                                 # warm-up, eager
        cp.cuda.get_current_stream().synchronize()
        if self.ops.library_calls != library_calls:
            return None, self._run_eagerly(key, f"the step calls cuBLAS ({self.ops.library_calls - library_calls} "
                                                f"matmuls outside the cuda_src/ kernels), which CuPy cannot capture",
                                           warm)
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                output = step_fn(static, step)
            except Exception as exc:  # noqa: BLE001 - any capture failure: this key runs eagerly, the job goes on
                try:
                    self.stream.end_capture()                        # leave capture mode; the partial graph is dropped
                except Exception:  # noqa: BLE001 - an invalidated capture raises here too; the first error is reported
                    pass
                return None, self._run_eagerly(key, f"capturing it failed: {type(exc).__name__}: {exc}", warm)
            graph = self.stream.end_capture()
        entry = _Captured(graph, static, slots_d, starts_d, output)
        self.captured[key] = entry
        self.captures += 1
        return entry, None

    def _run_eagerly(self, key, why: str, warm_output):
        """Mark `key` eager (logged once per DecodeGraph, and per key at debug level); the warm-up's output stands
        as this step's result (in a failed capture CUDA only recorded, so nothing ran twice on the device)."""
        if not self.eager_keys:
            log.warning("cuda_graphs: decode steps of %d sequences (KV bucket %d) run eagerly, not from a CUDA "
                        "graph: %s; further such keys are counted in the metrics (cuda_graphs.eager_steps_per_rank)",
                        key[0], key[1], why)
        else:
            log.debug("cuda_graphs: batch %d, KV bucket %d runs eagerly: %s", key[0], key[1], why)
        self.eager_keys[key] = why
        self.eager_steps += 1
        return warm_output

    def close(self) -> None:
        """Drop the graphs and hand their private memory pool back to the device."""
        self.captured.clear()
        self.pool.free_all_blocks()
