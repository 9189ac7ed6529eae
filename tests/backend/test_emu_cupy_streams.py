"""The CuPy stand-in's model of streams, events and pinned memory (tests/helpers/emu_cupy/): async copies queued on a
stream run only when it is flushed (synchronize, an event's synchronize or wait_event, device synchronize, null-stream
work for blocking streams), so a missing wait or a reused pinned buffer fails here as it would compute garbage on a
GPU."""

import threading

import numpy as np
import pytest

from emu_cupy import state
from emu_cupy.state import StreamOrderError


@pytest.fixture
def cp(emu_cupy):
    return emu_cupy


@pytest.fixture
def cupyx(emu_cupy):
    import cupyx

    return cupyx


def _pinned(cupyx, values):
    h = cupyx.empty_pinned(np.shape(values), dtype=np.float32)
    h[...] = values
    return h


def _upload(cp, cupyx, values, stream):
    """The copy half of the protocol: a pinned source, a device buffer, the copy queued on `stream`, an event."""
    h = _pinned(cupyx, values)
    with stream:
        d = cp.empty(h.shape, dtype=np.float32)
    d.set(h, stream=stream)
    return h, d, stream.record()


def test_correct_copy_protocol_gives_the_values(cp, cupyx):
    copy, compute = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    h, d, ev = _upload(cp, cupyx, values, copy)
    with compute:
        compute.wait_event(ev)
        y = d * 2 + 1
        got = y.get()
    np.testing.assert_array_equal(got, values * 2 + 1)
    assert ev.done
    assert (state._state.async_copies, state._state.async_copy_bytes) == (1, values.nbytes)
    assert state._state.pageable_async_copies == 0


def test_reading_before_the_wait_raises_and_memory_is_poisoned(cp, cupyx):
    copy, compute = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    h, d, ev = _upload(cp, cupyx, np.ones((4, 8), np.float32), copy)
    assert np.isnan(d._a).all()                        # the copy has not arrived
    with compute:
        with pytest.raises(StreamOrderError, match="pending on stream"):
            d * 2
        with pytest.raises(StreamOrderError, match="pending"):
            cp.copyto(cp.empty_like(d), d)
        with pytest.raises(StreamOrderError, match="pending"):
            d[1:3] = 0.0                                # a write races the copy too
        row = d[1]                                      # a view reads nothing: allowed
        assert row.shape == (8,)
        with pytest.raises(StreamOrderError, match="pending"):
            row.sum()                                   # views share the pending memory
        with pytest.raises(StreamOrderError, match="pending"):
            d.get()
    assert not ev.done
    compute.wait_event(ev)
    np.testing.assert_array_equal(d.get(), np.ones((4, 8), np.float32))


def test_only_the_pending_part_of_an_allocation_is_guarded(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    big = cp.zeros((2, 4), dtype=np.float32)
    ev0 = copy.record()
    big[1].set(_pinned(cupyx, np.full(4, 5, np.float32)), stream=copy)
    np.testing.assert_array_equal((big[0] + 1).get(), np.ones(4, np.float32))   # row 0: no copy into it
    with pytest.raises(StreamOrderError):
        big[1] + 1
    assert ev0.done and not copy.record().done


def test_kernel_reading_before_the_wait_raises(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    twice = cp.ElementwiseKernel("float32 x", "float32 y", "y = 2.0f * x", "emu_streams_twice")
    h, d, ev = _upload(cp, cupyx, np.arange(6, dtype=np.float32), copy)
    with pytest.raises(StreamOrderError, match="ElementwiseKernel emu_streams_twice"):
        twice(d)
    cp.cuda.get_current_stream().wait_event(ev)
    np.testing.assert_array_equal(twice(d).get(), 2 * np.arange(6, dtype=np.float32))


def test_work_on_the_copy_stream_itself_is_ordered_after_the_copy(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    h, d, ev = _upload(cp, cupyx, np.arange(5, dtype=np.float32), copy)
    with copy:
        y = d + 1                                       # stream order: the copy ran first
    np.testing.assert_array_equal(y._a, np.arange(5, dtype=np.float32) + 1)
    assert ev.done


def test_changing_the_pinned_source_before_the_copy_ran_raises_at_the_flush(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    h, d, ev = _upload(cp, cupyx, np.zeros(16, np.float32), copy)
    h[3] = 7.0                                          # reused before the copy's event completed
    with pytest.raises(StreamOrderError, match="changed before the copy ran"):
        copy.synchronize()
    h2, d2, ev2 = _upload(cp, cupyx, np.zeros(16, np.float32), copy)
    ev2.synchronize()                                   # the right order: wait, then reuse
    h2[3] = 7.0
    copy.synchronize()
    np.testing.assert_array_equal(d2.get(), np.zeros(16, np.float32))


def test_device_to_host_out_is_poisoned_until_synchronize_and_copies_late(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    src = cp.asarray(np.full(6, 3, np.float32))
    out = cupyx.zeros_pinned((6,), np.float32)
    assert src.get(stream=copy, out=out, blocking=False) is out
    assert np.isnan(out).all()
    src += 1                                            # later work on another stream, no wait: the copy sees it
    copy.synchronize()
    np.testing.assert_array_equal(out, np.full(6, 4, np.float32))
    out2 = cupyx.empty_pinned((6,), np.float32)
    src.get(stream=copy, out=out2, blocking=True)       # copies and synchronizes
    np.testing.assert_array_equal(out2, np.full(6, 4, np.float32))
    assert state._state.async_copies == 1 and state._state.pageable_async_copies == 0   # blocking: not async


def test_null_stream_work_flushes_blocking_streams_but_not_non_blocking_ones(cp, cupyx):
    blocking, non_blocking = cp.cuda.Stream(), cp.cuda.Stream(non_blocking=True)
    h1, d1, ev1 = _upload(cp, cupyx, np.ones(4, np.float32), blocking)
    h2, d2, ev2 = _upload(cp, cupyx, np.ones(4, np.float32), non_blocking)
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
    assert not ev1.done and not ev2.done
    cp.zeros(3, dtype=np.float32)                       # any device work on the legacy null stream
    assert ev1.done and not ev2.done
    np.testing.assert_array_equal((d1 * 2).get(), np.full(4, 2, np.float32))
    with pytest.raises(StreamOrderError):
        d2 * 2


def test_device_synchronize_flushes_every_stream(cp, cupyx):
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    events = [_upload(cp, cupyx, np.ones(3, np.float32), s)[2] for s in streams]
    cp.cuda.Device().synchronize()
    assert all(ev.done for ev in events)
    ev = _upload(cp, cupyx, np.ones(3, np.float32), streams[0])[2]
    cp.cuda.runtime.deviceSynchronize()
    assert ev.done


def test_event_done_is_a_query_and_marks_a_point_in_the_queue(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    assert copy.record().done                           # nothing pending: done at once
    h1, d1, ev1 = _upload(cp, cupyx, np.ones(4, np.float32), copy)
    ev_timing_off = cp.cuda.Event(disable_timing=True)
    ev_timing_off.record(copy)
    h2, d2, ev2 = _upload(cp, cupyx, np.full(4, 2, np.float32), copy)
    for _ in range(3):
        assert not ev1.done and not ev_timing_off.done  # querying runs nothing
    assert np.isnan(d1._a).all()
    ev1.synchronize()                                   # up to ev1 only
    assert ev1.done and ev_timing_off.done and not ev2.done
    np.testing.assert_array_equal(d1.get(), np.ones(4, np.float32))
    with pytest.raises(StreamOrderError):
        d2.get()
    copy.synchronize()
    assert ev2.done
    np.testing.assert_array_equal(d2.get(), np.full(4, 2, np.float32))


def test_current_stream_is_per_thread(cp):
    s, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    entered, release, seen = threading.Event(), threading.Event(), {}

    def worker():
        with s:
            seen["inside"] = cp.cuda.get_current_stream()
            entered.set()
            release.wait(10)
        other.use()
        seen["after_use"] = cp.cuda.get_current_stream()

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null     # the thread's `with s:` is not ours
    release.set()
    t.join(10)
    assert seen == {"inside": s, "after_use": other}
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null     # nor its .use()


def test_pageable_copies_run_at_once_and_are_counted(cp, cupyx):
    copy = cp.cuda.Stream(non_blocking=True)
    d = cp.empty((4,), dtype=np.float32)
    d.set(np.full(4, 9, np.float32), stream=copy)       # pageable: synchronous, nothing pending
    np.testing.assert_array_equal((d + 0).get(), np.full(4, 9, np.float32))
    out = np.empty(4, np.float32)
    d.get(stream=copy, out=out, blocking=False)
    np.testing.assert_array_equal(out, np.full(4, 9, np.float32))
    assert state._state.pageable_async_copies == 2 and state._state.async_copies == 0
    buf = cupyx.zeros_pinned((2, 4), np.float32)
    d.set(buf[1], stream=copy)                          # a view of a pinned buffer is pinned
    assert state._state.pageable_async_copies == 2 and not copy.record().done


def test_copies_without_a_stream_stay_synchronous(cp, cupyx):
    d = cp.empty((3,), dtype=np.float32)
    d.set(_pinned(cupyx, [1, 2, 3]))
    np.testing.assert_array_equal(d._a, [1, 2, 3])
    out = cupyx.empty_pinned((3,), np.float32)
    d.get(out=out)
    np.testing.assert_array_equal(out, [1, 2, 3])
    assert not state._state.queued and state._state.async_copies == 0


def test_async_copy_during_capture_raises(cp, cupyx):
    g = cp.cuda.Stream(non_blocking=True)
    d = cp.zeros((2,), dtype=np.float32)
    with g:
        g.begin_capture()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="StreamCaptureUnsupported"):
            d.set(_pinned(cupyx, [1, 2]), stream=g)
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
            g.end_capture()


def test_graph_replay_reading_pending_memory_raises(cp, cupyx):
    g, copy = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros((4,), dtype=np.float32)
    with g:
        y = cp.empty_like(x)
        g.begin_capture()
        cp.multiply(x, 3, out=y)
        graph = g.end_capture()
    x.set(_pinned(cupyx, [1, 2, 3, 4]), stream=copy)
    ev = copy.record()
    with pytest.raises(StreamOrderError, match="Graph.launch"):
        graph.launch(stream=g)
    g.wait_event(ev)
    graph.launch(stream=g)
    np.testing.assert_array_equal(y.get(), [3, 6, 9, 12])


def test_prefetch_thread_copies_then_main_waits(cp, cupyx):
    import queue

    copy, ready = cp.cuda.Stream(non_blocking=True), queue.Queue()
    layers = [np.full((2, 3), i, np.float32) for i in range(4)]

    def prefetch():
        for values in layers:
            ready.put(_upload(cp, cupyx, values, copy))          # `with copy:` on this thread only

    t = threading.Thread(target=prefetch)
    t.start()
    total = cp.zeros((2, 3), dtype=np.float32)
    for _ in layers:
        h, d, ev = ready.get(timeout=10)
        assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
        cp.cuda.get_current_stream().wait_event(ev)
        total += d
    t.join(10)
    np.testing.assert_array_equal(total.get(), np.full((2, 3), 6, np.float32))
    assert state._state.async_copies == 4 and state._state.pageable_async_copies == 0
