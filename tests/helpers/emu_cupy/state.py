"""The fake cupy's errors and its one mutable state (tests/helpers/emu_cupy/): current device, the per-thread stream
stack, the capture in progress, the async-copy bookkeeping (streams with queued copies, device memory with a pending
host -> device copy, pinned host buffers, counters), and the fake module of the latest build(). Other modules of
the package read `state._state` and `state._fake` at call time (never a copy), so build() and install() can swap
them here."""

from __future__ import annotations

import threading
import weakref

import numpy as np
from numpy.lib.array_utils import byte_bounds

POISON_BYTE = 0xFF          # cp.empty memory: NaN in every float dtype (and bfloat16 bits), -1 in signed ints
GUARD_BYTES = 4096          # poisoned margins around each allocation a kernel gets (see kernels._guarded_launch)


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError."""


class StreamOrderError(AssertionError):
    """A stream-ordering bug that a GPU does not report (it computes with garbage instead): device memory used
    while an async host -> device copy into it is pending on another stream, or the host buffer of such a copy
    changed before the copy ran. An AssertionError, so that no `except RuntimeError` in the code under test hides
    it."""


class CompileException(Exception):
    """As cupy.cuda.compiler.CompileException."""

    def __init__(self, msg, source=None, name=None, options=(), backend="nvrtc"):
        super().__init__(msg)
        self.source, self.name, self.options, self.backend = source, name, options, backend


def poison(a: np.ndarray):
    """Fill a C-contiguous array's bytes with POISON_BYTE (NaN / -1), as uninitialised memory."""
    if a.size and a.flags.c_contiguous:
        a.reshape(-1).view(np.uint8).fill(POISON_BYTE)


def _bounds(a: np.ndarray):
    return byte_bounds(a) if a.size else None


class _State:
    def __init__(self, devices: int = 1, sm_count: int = 2):
        self.devices, self.sm_count, self.device = devices, sm_count, 0
        self._local = threading.local()  # per host thread, as cupy's: .stack and .base (see the properties)
        self.capturing = None           # the stream whose capture is in progress (global, as CUDA's global mode)
        self.lock = threading.RLock()   # guards the copy queues and the registries below
        self.queued: set = set()        # streams with async copies not yet run
        self.pending: list = []         # async host -> device copies not yet run (.lo, .hi, .stream)
        self.pinned: list = []          # (weakref to a pinned host array, lo, hi)
        self.async_copies = 0           # async copies between device and pinned host memory that have run
        self.async_copy_bytes = 0       # their bytes
        self.pageable_async_copies = 0  # set(stream=...) / get(stream=..., blocking=False) with pageable host memory
        self.pageable_copies: list = []  # every host <-> device copy with pageable host memory (pageable.py)

    # --- the current stream (per host thread)
    @property
    def stack(self) -> list:
        """Streams entered with `with stream:` on this thread."""
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @property
    def base(self):
        """The stream made current on this thread with .use() (None: the null stream)."""
        return getattr(self._local, "base", None)

    @base.setter
    def base(self, stream):
        self._local.base = stream

    def current(self):
        from .devices import Stream

        return self.stack[-1] if self.stack else (self.base or Stream.null)

    # --- capture
    def device_op(self, what: str):
        """Called before device work: returns the op list to record into (or None), or raises when a capture is
        in progress on another stream (CUDA's global capture mode forbids that)."""
        capturing = self.capturing
        if capturing is None:
            return None
        if self.current() is not capturing:
            self._fail(capturing, "cudaErrorStreamCaptureImplicit", f"{what} on another stream")
        return capturing._ops

    def device_work(self, what: str, stream=None):
        """device_op(), then run the queued copies that this work (on `stream`, default the current one) comes
        after: device work runs eagerly here, so what it is stream-ordered after must have run."""
        ops = self.device_op(what)
        self.order_before(stream or self.current())
        return ops

    def library_call(self, what: str):
        """A cuBLAS (or cuRAND) call: CuPy 14 refuses it while the current stream captures, before anything reaches
        the library (cupy/cuda/cublas.pyx setStream: NotImplementedError; cupy/cupy#6290). The capture itself
        stays valid: nothing was enqueued."""
        if self.capturing is not None and self.current() is self.capturing:
            raise NotImplementedError(f"calling cuBLAS API during stream capture is currently unsupported ({what})")

    def host_sync(self, what: str):
        """A host <-> device transfer or a host sync: not allowed while a stream captures."""
        if self.capturing is not None:
            self._fail(self.capturing, "cudaErrorStreamCaptureUnsupported", what)

    @staticmethod
    def _fail(stream, code: str, what: str):
        reason = (f"{code}: operation not permitted when stream is capturing ({what} during CUDA graph capture: "
                  "no host <-> device copy or sync may happen inside a captured region)")
        stream._invalid = stream._invalid or reason
        raise CUDARuntimeError(reason)

    # --- async copies
    def order_before(self, stream):
        """Run the queued copies that work on `stream` comes after: the stream's own (stream order) and, for the
        legacy null stream, those of every blocking stream (non_blocking=False)."""
        if not self.queued:
            return
        with self.lock:
            streams = [s for s in self.queued if not s.non_blocking] if stream.is_null else [stream]
        for s in streams:
            s._flush()

    def flush_all(self):
        """Device synchronize: every queued copy of every stream runs."""
        with self.lock:
            streams = list(self.queued)
        for s in streams:
            s._flush()

    def pending_hits(self, arrays, allow=None) -> list:
        """The pending host -> device copies (not on stream `allow`) whose destination overlaps these arrays."""
        if not self.pending:
            return []
        with self.lock:
            spans = [b for b in (_bounds(a) for a in arrays if isinstance(a, np.ndarray)) if b]
            return [c for c in self.pending if c.stream is not allow and any(lo < c.hi and c.lo < hi
                                                                              for lo, hi in spans)]

    def check_pending(self, arrays, what: str, allow=None):
        """Raise StreamOrderError when `what` uses device memory that a pending async copy is writing."""
        hits = self.pending_hits(arrays, allow)
        if hits:
            raise_pending(hits, what)

    # --- pinned host memory
    def pin(self, array: np.ndarray):
        with self.lock:
            self.pinned = [p for p in self.pinned if p[0]() is not None]
            if array.size:
                self.pinned.append((weakref.ref(array), *byte_bounds(array)))

    def is_pinned(self, array) -> bool:
        if not isinstance(array, np.ndarray) or not array.size:
            return False
        lo, hi = byte_bounds(array)
        with self.lock:
            return any(ref() is not None and plo <= lo and hi <= phi for ref, plo, phi in self.pinned)


def raise_pending(hits, what: str):
    streams = ", ".join(sorted({repr(c.stream) for c in hits}))
    raise StreamOrderError(f"device memory read/written ({what}) while an async host->device copy into it is "
                           f"pending on stream {streams}: wait on the copy's event first (stream.wait_event) or "
                           "synchronize")


_state = _State()
_fake = None                # the cupy module of the latest build()
