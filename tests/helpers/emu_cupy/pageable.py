"""Host <-> device copies with pageable host memory in the fake cupy (tests/helpers/emu_cupy/), synchronous ones
included: every such copy is logged in `state._state.pageable_copies` as a `PageableCopy` (direction, bytes, what
made it).

Why all of them, as CUDA sees them: a copy between device memory and host memory that is not page-locked is
staged by the driver through its own pinned buffer, synchronously with the host (cudaMemcpyAsync from pageable
memory returns only once the source was staged, and overlaps nothing); CuPy's `cupy.asarray(numpy_array)` of
pageable memory first copies it on the host into a pinned transfer buffer (`_alloc_async_transfer_buffer` in
cupy/_core/core.pyx) and `ndarray.get()` into a new NumPy array is a synchronous cudaMemcpy into pageable memory.
Pinned means what CuPy's `pinned_memory.is_memory_pinned` asks CUDA (cudaPointerGetAttributes: memory type host):
memory from `cupyx.empty_pinned` / `zeros_pinned` (a PinnedMemoryPointer), or a view inside it; here a host array
is pinned when all of its bytes lie inside one registered pinned buffer (state.is_pinned; CUDA asks only about the
first byte, so this is the stricter of the two).

`watch()` gives the copies made while it is open, for a test that holds a hot path (an offload decode loop) to none.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from . import state

HOST_TO_DEVICE, DEVICE_TO_HOST = "host->device", "device->host"


@dataclasses.dataclass(frozen=True)
class PageableCopy:
    direction: str                  # HOST_TO_DEVICE or DEVICE_TO_HOST
    nbytes: int
    what: str                       # the call that made it ("cupy.asarray", "ndarray.get()", ...)
    kind: str = "?"                 # the host data's dtype kind ("f" float, "i" int, ...; "?" unknown)


def note(host, nbytes: int, direction: str, what: str) -> None:
    """Log a host <-> device copy of `nbytes` whose host side is `host` (an array, a scalar or None for a new
    array) unless that host memory is pinned."""
    if isinstance(host, np.ndarray) and state._state.is_pinned(host):
        return
    kind = host.dtype.kind if isinstance(host, np.ndarray) else "?"
    with state._state.lock:
        state._state.pageable_copies.append(PageableCopy(direction, int(nbytes), what, kind))


def upload(host, what: str) -> None:
    """A host -> device copy from `host` (anything cupy would upload: arrays, lists, scalars)."""
    array = host if isinstance(host, np.ndarray) else np.asarray(host)
    note(host, array.nbytes, HOST_TO_DEVICE, what)


def download_of(device, out, what: str) -> None:
    """download() of a device array (its bytes and dtype) into `out` (None: a new array or a scalar)."""
    if out is None:
        note(np.empty(0, device.dtype), device.nbytes, DEVICE_TO_HOST, what)   # a new pageable array
    else:
        note(out, device.nbytes, DEVICE_TO_HOST, what)


@contextlib.contextmanager
def watch():
    """The pageable copies made inside the block (a list filled as they happen)."""
    start = len(state._state.pageable_copies)
    made: list = []
    try:
        yield made
    finally:
        made.extend(state._state.pageable_copies[start:])


def upload_parts(x, what: str) -> None:
    """The host arrays and lists in an index or value (nested tuples): each a host -> device copy."""
    if isinstance(x, tuple):
        for part in x:
            upload_parts(part, what)
    elif (isinstance(x, np.ndarray) and x.ndim > 0) or isinstance(x, list):
        upload(x, what)
