"""The CuPy backend's copy engine (the interface is backend/transfer.py): pinned host buffers, one non-blocking
copy stream per direction (host -> device `h2d`, device -> host `d2h`), CUDA events between them and the compute
stream, and a pool of pinned staging buffers (backend/pinned_pool.py) for sources that are not pinned.

    upload    (any thread)  [h2d] wait(reuse_after) -> allocate -> memcpyAsync H2D -> record(done)
              (compute)     Upload.arrays(): [compute stream] wait(done)      the host does not block
    freeing   (compute)     [compute stream] record(reuse_after), then the uploaded arrays are dropped
    upload_into (compute)   [compute stream] record(ready) ; [h2d] wait(ready) -> memcpyAsync H2D -> record(done)
    download  (compute)     [compute stream] record(ready) ; [d2h] wait(ready) -> memcpyAsync D2H -> record(done)
                            Download.wait(): the host blocks on done; Download.fence(): [compute stream] wait(done),
                            before kernels that overwrite the downloaded array
    fetched   (compute)     download into a pooled pinned buffer, wait; the host reads it inside the `with`

Why the events are where they are:
- The compute stream waits on `done` before the kernels that read an upload: the copy overlaps the compute issued
  before (the previous layer), never the compute that needs it.
- One stream per direction: a layer's weights and the next batch's KV going up overlap the previous batch's KV
  and activations going down (PCIe is full duplex), and neither waits behind the other in one queue. The two
  directions are ordered only through the compute stream: an upload from a host buffer that a download wrote
  must come after that download's wait() (the host) or fence() (the compute stream, which upload_into's `ready`
  follows); the offload schedules wait() before they load what they stored (generate/host_kv.py,
  offload/activations.py), and the cupy stand-in refuses an upload whose host bytes change before it ran.
- CuPy's memory pool keeps a free list per stream, and the uploads allocate on the h2d stream: memory freed when
  a layer's weights are dropped goes back to that stream's list, and the next upload may get it while the
  compute stream's kernels still read the old layer. So every upload first waits on `reuse_after`, recorded on the
  compute stream when the last arrays were dropped (after the work that read them was issued); the lock makes
  "wait, then allocate" and "record, then drop" atomic with respect to each other.
- A pinned source must not change before its copy has run: the host tier's buffers never change, and a source
  that is not pinned (disk tier: a memory map) is first copied into a staging buffer of the pool, which takes it
  back with the copy's `done` event and hands it out again only once that event is done.
- No copy on the hot path reads or writes pageable memory: CUDA would stage it synchronously (the host blocks and
  nothing overlaps). tests/helpers/emu_cupy/pageable.py logs every such copy, and tests/offload/
  test_no_pageable_copies.py holds the offload decode loops to none.
- A window of an array (a KV cache's positions [N, H, lo:hi, X]) is not contiguous: it moves as one pitched 2D
  copy (cudaMemcpy2DAsync: a row per (sequence, head), the pitch of each side's own layout), not row by row.
- The copy streams are non-blocking: the legacy default stream (where the compute runs unless a stream is made
  current) does not serialize with them, which a blocking stream would, and overlap would be lost.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from .cupy_dtypes import BF16_BITS, is_bf16
from .pinned_pool import PinnedPool, packed_offsets

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2      # cudaMemcpyKind


def _bits(host: np.ndarray) -> np.ndarray:
    """bfloat16 host arrays travel as their uint16 bits (the device storage of bfloat16)."""
    return host.view(BF16_BITS) if is_bf16(host.dtype) else host


def pitched(a) -> tuple[int, int, int]:
    """(row bytes, rows, pitch) of a host or device array seen as rows of contiguous bytes at one pitch: a
    contiguous array is one row; a slice along one axis of a contiguous array (a KV cache's window of positions
    [N, H, lo:hi, X]) has a row per index of the axes before that one. ValueError for other layouts."""
    if a.flags.c_contiguous:
        return a.nbytes, 1, a.nbytes
    axes = [(n, st) for n, st in zip(a.shape, a.strides) if n != 1]          # size-1 axes do not move memory
    width = a.itemsize
    while axes and axes[-1][1] == width:                                     # the contiguous trailing axes
        width *= axes.pop()[0]
    if not axes or any(st != n * inner for (_, st), (n, inner) in zip(axes, axes[1:])):
        raise ValueError(f"an array of shape {a.shape} and strides {a.strides} is not rows at one pitch")
    return width, int(np.prod([n for n, _ in axes], dtype=np.int64)), axes[-1][1]


class Upload:
    """Host -> device copies in flight: arrays() makes the compute stream wait for them (fence()), and gives them."""

    def __init__(self, arrays: list, done, compute):
        self._arrays, self.done, self.compute = arrays, done, compute

    def fence(self) -> None:
        self.compute.wait_event(self.done)

    def arrays(self) -> list:
        self.fence()
        return self._arrays


class Download:
    """A device -> host copy in flight: wait() blocks the host until `out` holds the device array's values;
    fence() makes the compute stream wait for it (the host does not), before work that overwrites the source."""

    def __init__(self, out: np.ndarray, done, source, compute):
        self.out, self.done, self._source, self.compute = out, done, source, compute   # source alive till copied

    def fence(self) -> None:
        self.compute.wait_event(self.done)

    def wait(self) -> np.ndarray:
        self.done.synchronize()
        self._source = None
        return self.out


class StreamCopies:
    """Pinned buffers and a copy stream per direction for one rank's GPU. Build it on the compute thread: the
    stream current there is the compute stream the copies are ordered against."""

    def __init__(self, ops):
        self.cp = cp = ops.xp
        import cupyx

        self._empty_pinned = cupyx.empty_pinned
        self.compute = cp.cuda.get_current_stream()
        self.h2d = cp.cuda.Stream(non_blocking=True)
        self.d2h = cp.cuda.Stream(non_blocking=True)
        self.pool = PinnedPool(cupyx.empty_pinned)   # staging for sources that are not pinned
        self.lock = threading.Lock()
        self.reuse_after = None           # event on the compute stream: work issued before the last drop

    def host_buffer(self, shape, dtype) -> np.ndarray:
        """A pinned host array (bfloat16: pinned uint16 viewed as bfloat16)."""
        dtype = np.dtype(dtype)
        bits = self._empty_pinned(shape, dtype=BF16_BITS if is_bf16(dtype) else dtype)
        return bits.view(dtype)

    def host_copy(self, array) -> np.ndarray:
        array = np.asarray(array)
        out = self.host_buffer(array.shape, array.dtype)
        out[...] = array
        return out

    def upload(self, host_arrays: list, pinned: bool = True) -> Upload:
        """Start copying `host_arrays` into new device arrays. pinned=False: the sources are not pinned (e.g.
        memory maps of the disk tier): they are read into a pooled pinned staging buffer first."""
        buffer, sources = (None, list(host_arrays)) if pinned else self.pool.staged(host_arrays)
        with self.lock:
            if self.reuse_after is not None:
                self.h2d.wait_event(self.reuse_after)
            with self.h2d:
                arrays = [self.cp.empty(a.shape, dtype=_bits(a).dtype) for a in sources]
                for device, host in zip(arrays, sources):
                    device.set(_bits(_contiguous(host)), stream=self.h2d)
                done = self.h2d.record()
        if buffer is not None:
            self.pool.give(buffer, done)
        return Upload(arrays, done, self.compute)

    def upload_into(self, device_array, host_array: np.ndarray, pinned: bool = True) -> Upload:
        """Start copying `host_array` into the existing `device_array` (contiguous, or a window), after the
        compute issued so far (which may still read what it holds). pinned=False: staged as in upload."""
        buffer, (source,) = (None, (host_array,)) if pinned else self.pool.staged([host_array])
        self.h2d.wait_event(self.compute.record())
        if device_array.flags.c_contiguous and source.flags.c_contiguous:
            device_array.set(_bits(source), stream=self.h2d)
        else:                                          # a window: one pitched copy
            self._copy_2d(device_array.data.ptr, device_array, source.ctypes.data, source, HOST_TO_DEVICE)
        done = self.h2d.record()
        if buffer is not None:
            self.pool.give(buffer, done)
        return Upload([device_array], done, self.compute)

    def download(self, device_array, out: np.ndarray) -> Download:
        """Start copying `device_array` into the pinned host array `out`, after the compute issued so far."""
        self.d2h.wait_event(self.compute.record())
        if device_array.flags.c_contiguous and out.flags.c_contiguous:
            device_array.get(stream=self.d2h, out=_bits(out), blocking=False)
        else:                                          # a window: one pitched copy
            self._copy_2d(out.ctypes.data, out, device_array.data.ptr, device_array, DEVICE_TO_HOST)
        return Download(out, self.d2h.record(), device_array, self.compute)

    @contextlib.contextmanager
    def fetched(self, device_arrays: list):
        """The values of `device_arrays` (after the compute issued so far) in pinned host views of one pooled
        buffer, for the body of the `with` (the host blocks until they are there); the buffer goes back after."""
        offsets, total = packed_offsets([a.nbytes for a in device_arrays])
        buffer = self.pool.take(total)
        outs = [buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape) for a, at in zip(device_arrays, offsets)]
        downloads = [self.download(_contiguous_device(a), out) for a, out in zip(device_arrays, outs)]
        try:
            yield [d.wait() for d in downloads]
        finally:
            self.pool.give(buffer)

    def _copy_2d(self, dst_ptr: int, dst, src_ptr: int, src, kind: int) -> None:
        (width, rows, dst_pitch), (src_width, src_rows, src_pitch) = pitched(dst), pitched(src)
        if (width, rows) != (src_width, src_rows) or dst.shape != src.shape:
            raise ValueError(f"copy between shapes {src.shape} and {dst.shape}")
        stream = self.h2d if kind == HOST_TO_DEVICE else self.d2h
        self.cp.cuda.runtime.memcpy2DAsync(dst_ptr, dst_pitch, src_ptr, src_pitch, width, rows, kind, stream.ptr)

    @contextlib.contextmanager
    def freeing(self):
        """Drop uploaded arrays inside this: later uploads reuse their memory only after the work issued so far."""
        with self.lock:
            self.reuse_after = self.compute.record()
            yield

    def close(self) -> None:
        self.h2d.synchronize()
        self.d2h.synchronize()


def _contiguous(host: np.ndarray) -> np.ndarray:
    """A pinned source as it is: a copy of a non-contiguous one would be pageable (use a window's upload_into)."""
    if not host.flags.c_contiguous:
        raise ValueError(f"upload: a host array of shape {host.shape} and strides {host.strides} is not "
                         "contiguous (its copy would be pageable): stage it (pinned=False) or use upload_into")
    return host


def _contiguous_device(device_array):
    """fetched() reads whole arrays: a non-contiguous one is made contiguous on the compute stream first."""
    return device_array if device_array.flags.c_contiguous else device_array.copy()
