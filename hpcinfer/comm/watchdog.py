"""The watchdog: a collective or point-to-point transfer that does not complete within `timeout` seconds ends the
job, with a diagnostic naming the operation, the group and the world ranks that did not arrive.

Every MPIGroup owns one `Watchdog`; the groups of a process share one `Arrivals`. An operation is entered with
`enter(op)` (which counts the collectives this rank entered on the group) and completed with `wait(request, op)`:
- with MPI_THREAD_MULTIPLE (mpi4py's default), the main thread blocks in `Wait` as before (no polling, so the
  fast path costs two attribute writes), and a monitor thread of `Arrivals` wakes every TICK_S: it answers its
  peers' count probes and, when an operation has been open longer than the timeout, diagnoses it and calls
  `on_timeout` (by default: print and MPI Abort with exit code 3, like the runtime's errors);
- without it, `wait` polls `Test` (busy for SPIN_S, then sleeping, answering probes while it sleeps) and raises
  CommTimeout past the deadline; the runtime turns it into an Abort with exit code 3.
Diagnosis: the timed-out rank asks every member for its count over a duplicate of the group's communicator; the
ranks whose count is behind its own did not arrive, and so did those that did not answer within PROBE_S (with the
monitor thread only a process that holds the GIL for good, or is gone, cannot answer). A point-to-point wait
names its peer. (Passive-target RMA would need no answer, but MPICH over UCX grants a lock only while the target
makes MPI progress, so it cannot see into a stuck rank either.)
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

from ..errors import HpcinferError

SPIN_S = 0.02                   # polling mode: busy-poll this long before sleeping (blocking MPI calls spin too)
MAX_SLEEP_S = 5e-3
TICK_S = 0.1                    # the monitor thread's period
PROBE_S = 2.0                   # how long a timed-out rank waits for its peers' counts
ABORT_GRACE_S = 0.5             # lets the launcher forward the message before the job is killed
ASK_TAG, REPLY_TAG = 1, 2


class CommTimeout(HpcinferError):
    """A collective or transfer did not complete within [runtime] comm_timeout."""

    exit_code = 3


class Arrivals:
    """The watchdogs of one process. It answers the count probes of all of them, and watches their open operations
    from a monitor thread when MPI allows calls from several threads (`threaded`, default: ask MPI).
    on_timeout(watchdog, CommTimeout): what the monitor does with a timeout (default: print, then Abort `world`,
    the communicator of the whole job, with exit code 3)."""

    def __init__(self, on_timeout=None, threaded: bool | None = None, world=None):
        from mpi4py import MPI

        self.watchdogs: list = []
        self.replies: list = []              # isend requests of answers, kept until complete
        self.on_timeout = on_timeout if on_timeout is not None else self._abort
        self.world = world
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE if threaded is None else threaded
        self.lock = threading.RLock()        # serve() runs on the monitor thread and in diagnoses
        self.thread = None
        self.stopping = threading.Event()

    def add(self, watchdog) -> None:
        self.watchdogs.append(watchdog)
        if self.threaded and self.thread is None:
            self.thread = threading.Thread(target=self._monitor, name="hpcinfer-watchdog", daemon=True)
            self.thread.start()
            atexit.register(self.stop)       # runs before mpi4py's MPI_Finalize (registered earlier)

    def stop(self) -> None:
        """End the monitor thread (it must not call MPI once MPI is finalized)."""
        self.stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * TICK_S + PROBE_S)

    def serve(self) -> None:
        from mpi4py import MPI

        with self.lock:
            status = MPI.Status()
            for w in self.watchdogs:
                while w.probe is not None and w.probe.Iprobe(MPI.ANY_SOURCE, ASK_TAG, status):
                    source = status.Get_source()
                    w.probe.recv(source=source, tag=ASK_TAG)
                    self.replies.append(w.probe.isend(w.entered, dest=source, tag=REPLY_TAG))
            self.replies = [r for r in self.replies if not r.Test()]

    def _monitor(self) -> None:
        while not self.stopping.wait(TICK_S):
            self.serve()
            now = time.monotonic()
            for w in list(self.watchdogs):
                open_op = w.current
                if open_op is not None and now - open_op[1] > w.timeout and w.reported is not open_op:
                    w.reported = open_op
                    self.on_timeout(w, CommTimeout(w.diagnose(open_op[0], open_op[2])))

    def _abort(self, watchdog, error: "CommTimeout") -> None:
        """The default on_timeout: say it, then end every rank with exit code 3."""
        print(f"hpcinfer: error on rank {watchdog.world_ranks[watchdog.rank]}: {error}", file=sys.stderr,
              flush=True)
        time.sleep(ABORT_GRACE_S)
        (self.world if self.world is not None else watchdog.comm).Abort(error.exit_code)


class Watchdog:
    def __init__(self, comm, name: str, timeout: float = 600.0, world_ranks=None, arrivals: Arrivals = None):
        self.comm, self.name, self.timeout = comm, name, float(timeout)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.world_ranks = list(world_ranks) if world_ranks is not None else list(range(self.size))
        self.entered = 0                                   # collectives this rank has entered on the group
        self.current = None                                # (op, start time, peer) of the open operation
        self.reported = None                               # the open operation the monitor reported
        self.on_enter = None                               # test hook (runtime fault injection): f(op)
        self.probe = comm.Dup() if self.size > 1 else None  # collective: every member, in the same order
        self.arrivals = arrivals if arrivals is not None else Arrivals()
        self.arrivals.add(self)

    # ---------------------------------------------------------------------------------------------- waiting
    def enter(self, op: str) -> None:
        if self.on_enter is not None:                      # (a rank stopped here has not arrived)
            self.on_enter(f"{op} on group '{self.name}'")
        self.entered += 1

    def run(self, op: str, start, call) -> None:
        """One collective: enter it, then either the blocking call() watched by the monitor thread (threaded
        mode: exactly the MPI call an unwatched group makes) or start() -> Request, polled (polling mode)."""
        self.enter(op)
        if self.arrivals.threaded:
            self.blocking(call, op)
        else:
            self.until(start().Test, op)

    def wait(self, request, op: str, peer: int | None = None) -> None:
        """Complete `request` (an MPI Request, or anything with Test() and Wait()) under the watchdog. peer: the
        group rank of a point-to-point partner (None: a collective of the group)."""
        if self.arrivals.threaded:
            self.blocking(request.Wait, op, peer)
        else:
            self.until(request.Test, op, peer)

    def blocking(self, call, op: str, peer: int | None = None):
        """call() -> its value, a blocking MPI call, watched by the monitor thread (threaded mode only)."""
        self.current = (op, time.monotonic(), peer)
        try:
            return call()
        finally:
            self.current = None

    def until(self, done, op: str, peer: int | None = None) -> None:
        """Poll `done()` until it is true, within the deadline."""
        if done():
            return
        start = time.monotonic()
        spin_end, deadline, sleep = start + SPIN_S, start + self.timeout, 5e-5
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise CommTimeout(self.diagnose(op, peer))
            if now > spin_end:
                self.arrivals.serve()
                time.sleep(sleep)
                sleep = min(2 * sleep, MAX_SLEEP_S)

    # -------------------------------------------------------------------------------------------- diagnosis
    def diagnose(self, op: str, peer: int | None) -> str:
        head = (f"watchdog: {op} on group '{self.name}' (world ranks {_ranges(self.world_ranks)}) did not "
                f"complete within [runtime] comm_timeout = {self.timeout:g} s")
        if peer is not None:
            return f"{head}: waiting on world rank {self.world_ranks[peer]}, which did not take part"
        counts = self.peer_counts()
        behind = [self.world_ranks[r] for r, c in counts.items() if c < self.entered]
        silent = [self.world_ranks[r] for r in range(self.size) if r not in counts]
        missing = sorted(behind + silent)
        if not missing:
            return f"{head}: every rank arrived, but the transfer did not complete"
        detail = f"world rank(s) {', '.join(map(str, missing))} did not arrive"
        if silent:
            detail += f" (rank(s) {', '.join(map(str, silent))} did not answer: busy outside communication or hung)"
        return f"{head}: {detail}; this rank was in the group's collective #{self.entered}"

    def peer_counts(self) -> dict:
        """{group rank: collectives entered} of the members that answered within PROBE_S (this rank included)."""
        from mpi4py import MPI

        counts = {self.rank: self.entered}
        if self.probe is None:
            return counts
        with self.arrivals.lock:
            asks = [self.probe.isend(None, dest=r, tag=ASK_TAG) for r in range(self.size) if r != self.rank]
        status, deadline = MPI.Status(), time.monotonic() + PROBE_S
        while len(counts) < self.size and time.monotonic() < deadline:
            self.arrivals.serve()
            with self.arrivals.lock:
                source = status.Get_source() if self.probe.Iprobe(MPI.ANY_SOURCE, REPLY_TAG, status) else None
                if source is not None:
                    counts[source] = self.probe.recv(source=source, tag=REPLY_TAG)
            if source is None:
                time.sleep(1e-3)
        del asks                                           # unanswered asks die with the job
        return counts

    def free(self) -> None:
        with self.arrivals.lock:
            if self in self.arrivals.watchdogs:
                self.arrivals.watchdogs.remove(self)
            if self.probe is not None:
                self.probe.Free()
                self.probe = None


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
