"""cupy.cuda.runtime.memcpy2DAsync in the fake cupy (tests/helpers/emu_cupy/): `height` rows of `width` bytes between
two pitched memory areas, given as raw addresses as CUDA takes them. The fake's device memory is host memory, so both
addresses are this process's: each side becomes a NumPy view [height, width] of uint8 over its rows, and the copy
is queued on the stream like any async copy (arrays.upload_async / download_async: pinned host memory queued,
pageable run now and counted, pending device rows guarded)."""

from __future__ import annotations

import ctypes

import numpy as np

from . import arrays, devices
from .state import CUDARuntimeError

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2          # cudaMemcpyKind


def rows(address: int, pitch: int, width: int, height: int) -> np.ndarray:
    """The [height, width] uint8 view of the rows at `address`, `pitch` bytes apart."""
    span = pitch * (height - 1) + width
    flat = np.frombuffer((ctypes.c_uint8 * span).from_address(address), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(flat, shape=(height, width), strides=(pitch, 1))


def memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
    if width > dpitch or width > spitch:
        raise CUDARuntimeError("cudaErrorInvalidPitchValue: width exceeds a pitch")
    if not height or not width:
        return
    on = devices.stream_of(stream)
    if kind == HOST_TO_DEVICE:
        arrays.upload_async(rows(dst, dpitch, width, height), rows(src, spitch, width, height), on,
                            "runtime.memcpy2DAsync into")
    elif kind == DEVICE_TO_HOST:
        arrays.download_async(rows(src, spitch, width, height), rows(dst, dpitch, width, height), on,
                              "runtime.memcpy2DAsync from")
    else:
        raise NotImplementedError(f"memcpy2DAsync kind {kind}: the fake copies host <-> device only")
