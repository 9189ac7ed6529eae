"""Devices and streams of the fake cupy (tests/helpers/emu_cupy/): Device, Stream (capture into a Graph that replays the
recorded work; a queue of async copies that run when the stream is flushed), Event (a mark in the queues),
no-op memory pools and allocators, and the fake `cupy.cuda.runtime` module."""

from __future__ import annotations

import contextlib
import types
import weakref

import numpy as np

from . import state
from .state import CUDARuntimeError


class Device:
    def __init__(self, device=None):
        self.id = state._state.device if device is None else int(device)
        if not 0 <= self.id < state._state.devices:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        self._previous = []

    def use(self):
        state._state.device = self.id

    def __enter__(self):
        self._previous.append(state._state.device)
        self.use()
        return self

    def __exit__(self, *exc):
        state._state.device = self._previous.pop()

    def synchronize(self):
        _device_synchronize("Device.synchronize()")

    @property
    def attributes(self):
        return {"MultiProcessorCount": state._state.sm_count, "MaxThreadsPerBlock": 1024, "WarpSize": 32,
                "MaxSharedMemoryPerBlock": 48 * 1024}

    compute_capability = property(lambda self: "90")
    pci_bus_id = property(lambda self: f"0000:{self.id + 1:02x}:00.0")
    mem_info = property(lambda self: (64 << 30, 80 << 30))

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id} (emulated)>"


class Graph:
    """A captured graph: launch() replays the recorded operations in order, on the same memory."""

    def __init__(self, ops):
        self._ops = list(ops)
        self._touched = [a for op in self._ops for a in getattr(op, "touched", ())]

    def launch(self, stream=None):
        state._state.device_op("Graph.launch")
        state._state.order_before(stream or state._state.current())
        state._state.check_pending(self._touched, "Graph.launch")
        for op in self._ops:
            op()

    def upload(self, stream=None):
        pass

    def __len__(self):
        return len(self._ops)


class Event:
    """A mark in the copy queues of the stream it was recorded on (of every blocking stream, when recorded on the
    legacy null stream): done once those queues have run past it."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._marks: dict = {}          # stream -> how many copies had been queued on it at the record

    def record(self, stream=None):
        stream = stream or state._state.current()
        with state._state.lock:
            if stream.is_null:
                self._marks = {s: s._enqueued for s in state._state.queued if not s.non_blocking}
            else:
                self._marks = {stream: stream._enqueued}

    def synchronize(self):
        state._state.host_sync("Event.synchronize()")
        self._flush()

    def _flush(self):
        for stream, mark in list(self._marks.items()):
            stream._flush(mark)

    @property
    def done(self) -> bool:
        """True once the queued copies before the record have run (a query: runs nothing). Under the lock: another
        thread may be running them (a pinned buffer is reused on this answer)."""
        with state._state.lock:
            return all(stream._flushed >= mark for stream, mark in list(self._marks.items()))


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.is_null, self.non_blocking = null, non_blocking
        self._ops, self._invalid = None, None
        self._queue: list = []              # async copies not yet run, in issue order
        self._enqueued = self._flushed = 0  # copies ever queued / run (events mark _enqueued)
        if not null:
            _streams[id(self)] = self           # stream_of(ptr): raw-pointer APIs name streams by handle

    ptr = property(lambda self: 0 if self.is_null else id(self))

    def __enter__(self):
        state._state.stack.append(self)
        return self

    def __exit__(self, *exc):
        state._state.stack.pop()

    def use(self):
        state._state.base = self
        return self

    def begin_capture(self, mode=None):
        if self.is_null:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: the legacy null stream cannot be captured")
        if state._state.capturing is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: a stream capture is already in progress")
        state._state.capturing, self._ops, self._invalid = self, [], None

    def end_capture(self):
        if state._state.capturing is not self:
            raise CUDARuntimeError("cudaErrorIllegalState: this stream is not capturing")
        state._state.capturing = None
        ops, self._ops = self._ops, None
        if self._invalid:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureInvalidated: the capture was invalidated by an earlier "
                                   f"error ({self._invalid})")
        return Graph(ops)

    def is_capturing(self):
        return state._state.capturing is self

    def synchronize(self):
        state._state.host_sync("Stream.synchronize()")
        state._state.order_before(self)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        """Work issued on this stream from now on comes after the event: device work runs eagerly here, so the
        copies the event marks run now."""
        event._flush()

    def launch_host_func(self, callback, arg):
        state._state.host_sync("Stream.launch_host_func")
        state._state.order_before(self)
        callback(arg)

    @property
    def done(self) -> bool:
        return not self._queue

    def _enqueue(self, copy):
        with state._state.lock:
            self._queue.append(copy)
            self._enqueued += 1
            state._state.queued.add(self)

    def _flush(self, upto=None):
        """Run the queued copies, in order, up to the `upto`-th ever queued (all when None)."""
        with state._state.lock:
            while self._queue and (upto is None or self._flushed < upto):
                copy = self._queue.pop(0)
                if not self._queue:
                    state._state.queued.discard(self)
                copy.run()
                self._flushed += 1          # after the copy ran: an event is done only then (cudaEventQuery)

    def __repr__(self):
        return f"<Stream {self.ptr} (emulated)>"


_streams = weakref.WeakValueDictionary()
Stream.null = Stream(null=True)


def stream_of(ptr: int) -> Stream:
    """The stream whose handle (Stream.ptr) is `ptr`: 0 is the null stream."""
    stream = Stream.null if ptr == 0 else _streams.get(ptr)
    if stream is None:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no stream has handle {ptr}")
    return stream


def get_current_stream(device_id=None):
    return state._state.current()


def _device_synchronize(what: str):
    state._state.host_sync(what)
    state._state.flush_all()


class _Memory:
    def __init__(self, nbytes):
        self.size, self._buf = nbytes, np.empty(max(int(nbytes), 1), dtype=np.uint8)
        self.ptr = self._buf.ctypes.data


class MemoryPool:
    def __init__(self, allocator=None):
        self._used = 0

    def malloc(self, nbytes):
        self._used += int(nbytes)
        return _Memory(nbytes)

    def used_bytes(self):
        return self._used

    def total_bytes(self):
        return self._used

    def free_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def n_free_blocks(self):
        return 0

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0


class PinnedMemoryPool(MemoryPool):
    pass


_default_pool, _pinned_pool = MemoryPool(), PinnedMemoryPool()


@contextlib.contextmanager
def using_allocator(allocator=None):
    yield


def _runtime_module():
    m = types.ModuleType("cupy.cuda.runtime")
    m.CUDARuntimeError = CUDARuntimeError
    m.getDeviceCount = lambda: state._state.devices
    m.getDevice = lambda: state._state.device
    m.setDevice = lambda i: Device(i).use()
    m.deviceSynchronize = lambda: _device_synchronize("cudaDeviceSynchronize")
    m.memcpyHostToDevice, m.memcpyDeviceToHost = 1, 2
    m.memGetInfo = lambda: (64 << 30, 80 << 30)
    m.runtimeGetVersion = lambda: 12080
    m.driverGetVersion = lambda: 12080
    m.is_hip = False
    m.getDeviceProperties = lambda i: {"name": b"Emulated CUDA device (CPU)", "totalGlobalMem": 80 << 30,
                                       "multiProcessorCount": state._state.sm_count, "major": 9, "minor": 0}
    return m
