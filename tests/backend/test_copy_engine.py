"""The copy engines (backend/transfer.py, backend/cupy_transfer.py) on their own: windows of a KV cache move as
one pitched 2D copy, uploads and downloads of windows give what the NumPy engine gives, a read before the copy's
event is refused by the cupy stand-in (tests/helpers/emu_cupy/), and a download's source may be overwritten only after
fence()."""

from __future__ import annotations

import numpy as np
import pytest

import emu_cupy as emu
from hpcinfer.backend.cupy_transfer import pitched
from hpcinfer.backend.transfer import HostCopies

SHAPE = (3, 2, 10, 4)                                  # [N, Hkv, Lmax, hd]


def test_pitched_sees_a_window_of_positions_as_rows_at_one_pitch():
    a = np.zeros(SHAPE, np.float32)
    assert pitched(a) == (a.nbytes, 1, a.nbytes)
    assert pitched(a[:, :, 2:7]) == (5 * 4 * 4, 3 * 2, 10 * 4 * 4)             # a row per (sequence, head)
    assert pitched(a[:2, :, :1]) == (4 * 4, 2 * 2, 10 * 4 * 4)
    assert pitched(a[:1, :, 3:5]) == (2 * 4 * 4, 2, 10 * 4 * 4)                # size-1 axes move nothing
    with pytest.raises(ValueError, match="not rows at one pitch"):
        pitched(a[:, :, 2:7, :2])                                                # a row is not contiguous
    with pytest.raises(ValueError, match="not rows at one pitch"):
        pitched(np.zeros((4, 6, 5), np.float32)[::2, :3, :2])                  # two pitches


def host_rows(copies):
    rows = copies.host_buffer(SHAPE, np.float32)
    rows[...] = np.arange(rows.size, dtype=np.float32).reshape(SHAPE)
    return rows


def test_windows_move_as_on_the_numpy_engine(emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    copies, cp = CupyOps(device=0).copy_engine(), emu_cupy
    numpy_device = np.zeros((4, *SHAPE[1:]), np.float32)
    HostCopies().upload_into(numpy_device[:3, :, 1:6], host_rows(HostCopies())[:, :, 1:6])
    device = cp.zeros((4, *SHAPE[1:]), np.float32)
    copies.upload_into(device[:3, :, 1:6], host_rows(copies)[:, :, 1:6]).arrays()
    assert np.array_equal(device.get(), numpy_device)
    device += 1
    out = host_rows(copies)
    download = copies.download(device[:3, :, 4:9], out[:, :, 4:9])
    download.wait()
    want = host_rows(HostCopies())
    want[:, :, 4:9] = numpy_device[:3, :, 4:9] + 1
    assert np.array_equal(out, want)
    assert emu._state.pageable_async_copies == 0 and emu._state.async_copies == 2


def test_a_window_read_before_its_copys_event_is_refused(emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    copies, cp = CupyOps(device=0).copy_engine(), emu_cupy
    device = cp.zeros(SHAPE, np.float32)
    upload = copies.upload_into(device[:, :, 2:5], host_rows(copies)[:, :, 2:5])
    with pytest.raises(emu.StreamOrderError, match="pending"):
        device.sum()                                                             # no wait: refused
    upload.arrays()
    assert float(device.sum()) == float(host_rows(HostCopies())[:, :, 2:5].sum())


def test_a_downloads_source_is_overwritten_only_after_fence(emu_cupy):
    """The stand-in runs a download when its stream is flushed and reads the device memory then: overwriting the
    source first (no fence) gives the new values in the host buffer, after fence() the values it had."""
    from hpcinfer.backend.cupy_ops import CupyOps

    copies, cp = CupyOps(device=0).copy_engine(), emu_cupy
    for fenced in (False, True):
        device = cp.full(SHAPE, 7.0, dtype=np.float32)
        out = copies.host_buffer(SHAPE, np.float32)
        download = copies.download(device[:, :, :3], out[:, :, :3])
        if fenced:
            download.fence()
        device[...] = 9.0                                                        # the next batch's compute
        download.wait()
        assert np.all(out[:, :, :3] == (7.0 if fenced else 9.0))
