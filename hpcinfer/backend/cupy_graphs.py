"""CUDA graphs for decode steps on the CuPy backend: `DeviceStep` (a decode step whose slots and starts live in
device buffers, with a fixed KV-length bucket, so attention reads no host value), `PagedDeviceStep` (the same over
a paged KV cache: block tables of a fixed width and lengths in device buffers too), `kv_bucket` (the bucket of a
length), `batch_bucket` (the padded size of a paged decode step) and `DecodeGraph` (capture a decode step once per
(batch size, bucket), then replay it with new inputs copied into the captured buffers). generate/graphs.py drives
it; tests/generate/test_cuda_graphs.py, tests/generate/test_paged_graphs.py and tests/backend/test_cupy_emulated.py
check it on the CPU fake of cupy (tests/helpers/emu_cupy/).

Shape legend: S=sequences in the step, B=blocks of a paged step's tables (its KV bucket / block size).
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

    @classmethod
    def upload(cls, xp, layout: StepLayout, kv_len: int, **device) -> "DeviceStep":
        """The device step of a host decode `layout` (its values in new device buffers: the warm-up's and the
        capture's), reading `kv_len` positions; `device`: a subclass's own buffers."""
        return cls(layout.slots, layout.starts, layout.counts, layout.tables, layout.block_size,
                   slots_d=xp.asarray(np.asarray(layout.slots, dtype=np.int64)),
                   starts_d=xp.asarray(np.asarray(layout.starts, dtype=np.int64)), kv_len=kv_len, **device)

    def load(self, layout: StepLayout) -> None:
        """Write the values of a host `layout` of the same key (sequences, bucket) into the buffers, before a
        replay. The host fields keep the capture's values: nothing in a graph reads them."""
        self.slots_d.set(np.asarray(layout.slots, dtype=np.int64))
        self.starts_d.set(np.asarray(layout.starts, dtype=np.int64))


@dataclass(frozen=True)
class PagedDeviceStep(DeviceStep):
    """A decode step over a paged KV cache (StepLayout.paged) whose block tables and lengths also live in device
    buffers: tables of a fixed width, the KV bucket's blocks (B = kv_len / block_size, -1 past a sequence's
    blocks: the paged decode kernel reads no entry past a length), so that backend/cupy_paged.py's decode reads no
    host value and the step can be captured and replayed with other tables of the same key."""

    tables_d: object = None      # [S, B] int32 device
    lengths_d: object = None     # [S] int32 device: starts + 1, the positions each new token attends

    @classmethod
    def upload(cls, xp, layout: StepLayout, kv_len: int, **device) -> "PagedDeviceStep":
        tables = fixed_width(layout.tables, -(-kv_len // layout.block_size))                     # [S, B]
        host = StepLayout.paged(tables, layout.block_size, layout.starts, layout.counts)
        return super().upload(xp, host, kv_len, tables_d=xp.asarray(tables),
                              lengths_d=xp.asarray(decode_lengths(layout)), **device)

    def load(self, layout: StepLayout) -> None:
        super().load(layout)
        self.tables_d.set(fixed_width(layout.tables, self.tables_d.shape[1]))
        self.lengths_d.set(decode_lengths(layout))


def fixed_width(tables, width: int) -> np.ndarray:
    """Block tables [S, b] -> [S, width] int32, -1 past the given columns. Columns past `width` are dropped: a
    decode step of KV bucket kv_len reads no position at or past it, so no block past kv_len / block_size."""
    tables = np.asarray(tables, dtype=np.int32)
    out = np.full((tables.shape[0], width), -1, dtype=np.int32)
    kept = min(width, tables.shape[1])
    out[:, :kept] = tables[:, :kept]
    return out


def decode_lengths(layout: StepLayout) -> np.ndarray:
    """[S] int32: the positions each decode token attends, start + 1 (its own row the last)."""
    return (np.asarray(layout.starts) + 1).astype(np.int32)


def batch_bucket(sequences: int) -> int:
    """The rows a paged decode step of `sequences` is padded to under a CUDA graph: the next power of two. The
    linears' GEMV kernel (cupy_sbi.TOKEN_BUCKETS) is compiled for 1, 2, 4, 8 and 16 rows, so a step of 3 rows
    already runs the 4-row variant and reads the same weights (a decode step's cost): the padding costs little,
    and a running set that shrinks and grows needs about log2(batch_size) graphs per KV bucket."""
    bucket = 1
    while bucket < sequences:
        bucket *= 2
    return bucket


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
    step: DeviceStep             # its device buffers (slots, starts; a paged step's tables and lengths) are static
    output: object               # static device buffer the graph writes


class DecodeGraph:
    """Capture a decode step once per (batch size, KV-length bucket) with CUDA stream capture; replay it after
    copying the new inputs into the captured (static) buffers.

    `step_fn(inputs, step)` must compute the step from device arrays only: `inputs` (name -> device array, same
    shapes and dtypes at every call of one key) and `step` (a DeviceStep, or a PagedDeviceStep for a paged layout
    (`run`): its device buffers and kv_len are what attention reads; its host fields hold the capture-time values
    and must not steer the computation).
    Constraints (checked by CUDA at capture, where possible):
    - no host <-> device copy, no host sync (`int(x)`, boolean masks, `.get()`, `cupy.asarray(numpy)`) inside:
      the model reads the step's positions from `DeviceStep.positions` (device; rotary and learned positions
      gather on the device), the token ids from `inputs`, and takes no last-token gather in a decode step
      (generate/graphs.py drives it; tests/generate/test_cuda_graphs.py checks it on the CPU fake of cupy);
    - the step must be idempotent for equal inputs: the first call of a key runs it eagerly (a warm-up that
      compiles kernels and lets the pool allocate), then captures, then replays, so the KV append happens twice at
      the same position with the same values;
    - no cuBLAS: CuPy refuses any cuBLAS call while a stream captures (NotImplementedError). A key whose warm-up
      called cuBLAS (`CupyOps.library_calls` moved: the step left the cuda_src/ kernels, e.g. more than 64
      sequences (cupy_tc_gemm.TC_MAX_TOKENS; more than SBI_MAX_TOKENS with float32 weights), GQA groups or head
      dims past the attention kernel's limits, quantized weights on the tiled path) is never captured: it runs eagerly from then on (`eager_keys`, `eager_steps`), said once in
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
        return self.run(step_fn, inputs, StepLayout.build(slots, starts, np.ones(len(starts), dtype=np.int64)))

    def run(self, step_fn, inputs: dict, layout: StepLayout, eager: tuple | None = None):
        """Run the decode step of a host `layout` (dense, or paged: then step_fn gets a PagedDeviceStep) with
        `inputs`, as __call__. eager: (inputs, layout) to run instead on a key that runs eagerly (a padded paged
        step's real rows: padding only pays under a graph); the default is these."""
        cp = self.ops.xp
        key = self.key(layout.starts)
        if key in self.eager_keys:
            self.eager_steps += 1
            inputs, layout = eager if eager is not None else (inputs, layout)
            return step_fn({name: cp.asarray(value) for name, value in inputs.items()}, layout)
        entry = self.captured.get(key)
        if entry is None:
            entry, output = self._capture(key, step_fn, inputs, layout)
            if entry is None:
                return output                                        # the warm-up's output: this step is done
        for name, value in inputs.items():
            if isinstance(value, cp.ndarray):
                cp.copyto(entry.inputs[name], value)
            else:
                entry.inputs[name].set(np.ascontiguousarray(value, dtype=entry.inputs[name].dtype))
        entry.step.load(layout)
        entry.graph.launch(stream=cp.cuda.get_current_stream())
        return entry.output

    def _capture(self, key, step_fn, inputs, layout: StepLayout) -> tuple[_Captured | None, object]:
        """(the captured entry, None), or (None, the warm-up's output) when the key must run eagerly."""
        cp = self.ops.xp
        static = {name: cp.array(value, copy=True) for name, value in inputs.items()}     # host or device
        step = (PagedDeviceStep if layout.is_paged else DeviceStep).upload(cp, layout, key[1])
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
        entry = _Captured(graph, static, step, output)
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
