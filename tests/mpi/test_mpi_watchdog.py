"""The watchdog in process, at 2 and 4 ranks (comm/watchdog.py): a late rank makes its peers' waits time out
with its world rank named, in polling mode (CommTimeout raised; the late rank sleeps outside MPI and cannot answer,
or waits in another group's operation and answers with a count behind theirs) and in threaded mode (the monitor
thread reports; the late rank's monitor answers). Then it arrives, and every rank leaves the test in step."""

import time

import numpy as np
import pytest

from hpcinfer.comm.group import MPIGroup
from hpcinfer.comm.watchdog import Arrivals, CommTimeout, Watchdog, _ranges

TIMEOUT_S = 0.5


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def test_rank_ranges_read_compactly():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and _ranges([3]) == "3"


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_sleeps_outside_mpi_is_named():
    comm = world()
    group = MPIGroup(comm.Dup(), "test", timeout=TIMEOUT_S, arrivals=Arrivals(threaded=False))
    late = comm.Get_size() - 1
    x = np.ones(3)
    if comm.Get_rank() == late:
        time.sleep(TIMEOUT_S + 3.0)                           # past the peers' deadline and their probe
        group.all_reduce(x)
    else:
        from mpi4py import MPI

        group.watch.enter("all_reduce")
        request = group.comm.Iallreduce(MPI.IN_PLACE, x)
        with pytest.raises(CommTimeout) as caught:
            group.watch.wait(request, "all_reduce")
        message = str(caught.value)
        assert f"all_reduce on group 'test' (world ranks 0-{late})" in message
        assert f"world rank(s) {late} did not arrive" in message and "did not answer" in message
        assert caught.value.exit_code == 3
        request.Wait()                                         # the late rank comes: the operation completes
    assert x.tolist() == [comm.Get_size()] * 3
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_rank_waiting_elsewhere_answers_with_its_count():
    """The late rank sits in a watched receive on another group; it answers the probe (count 0 on 'a'), so it
    is named as behind, not as silent. Then the sender wakes it and it joins the barrier."""
    comm = world()
    arrivals = Arrivals(threaded=False)
    a = Watchdog(comm.Dup(), "a", TIMEOUT_S, arrivals=arrivals)
    b = MPIGroup(comm.Dup(), "b", timeout=30.0, arrivals=arrivals)
    late = comm.Get_size() - 1
    others = comm.Split(0 if comm.Get_rank() != late else 1)
    if comm.Get_rank() == late:
        b.recv_object(0, tag=5)                                # answers a's probes while it waits here
        a.enter("barrier")
        a.wait(a.comm.Ibarrier(), "barrier")
    else:
        a.enter("barrier")
        request = a.comm.Ibarrier()
        with pytest.raises(CommTimeout) as caught:
            a.wait(request, "barrier")
        missing, silent = _named(str(caught.value))
        assert str(late) in missing and str(late) not in silent, str(caught.value)    # behind, but it answered
        others.Barrier()                                       # every peer is done with its diagnosis
        if comm.Get_rank() == 0:
            b.isend_object("wake up", late, tag=5).wait()
        request.Wait()
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_the_monitor_thread_reports_a_blocked_collective():
    comm = world()
    reports = []
    group = MPIGroup(comm.Dup(), "watched", timeout=TIMEOUT_S,
                     arrivals=Arrivals(on_timeout=lambda w, error: reports.append(str(error)), threaded=True))
    late = comm.Get_size() - 1
    x = np.ones(2)
    if comm.Get_rank() == late:
        time.sleep(TIMEOUT_S + 3.0)                           # its monitor thread answers the probes meanwhile
    group.all_reduce(x)                                        # the main thread blocks in Wait until it arrives
    assert x.tolist() == [comm.Get_size()] * 2
    if comm.Get_rank() != late:
        assert len(reports) == 1, reports
        assert "all_reduce on group 'watched'" in reports[0]
        assert f"world rank(s) {late} did not arrive" in reports[0] and "did not answer" not in reports[0]
    else:
        assert reports == []
    comm.Barrier()


def _named(message: str) -> tuple[list, list]:
    """The world ranks a diagnosis names as missing, and those of them that did not answer."""
    missing = message.split(" did not arrive")[0].split("world rank(s) ")[-1].split(", ")
    silent = message.split("(rank(s) ")[1].split(" did not answer")[0].split(", ") if "did not answer" in message \
        else []
    return missing, silent
