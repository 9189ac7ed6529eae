"""Point-to-point verbs between pipeline stages, named for what they do (over the pp group's CommGroup).

A message is a small header dict and an optional array, host or device: a device array goes to the group as it is
(NcclGroup sends it from device memory and receives into device memory; StagedMPIGroup stages it through the host).
Sends are non-blocking and complete in the background
(a stage never waits for its successor to post a receive, so the schedule cannot deadlock on message sizes);
`flush` waits for all of them before the buffers may go. Receives block: a stage waits only for its input.
Every wait runs under the group's watchdog (comm/watchdog.py) where it has one: a stage whose peer never sends or
receives ends the job after [runtime] comm_timeout, naming the peer.
"""

from __future__ import annotations

import numpy as np

FORWARD_TAG = 11                 # stage s -> s + 1: activations of a micro-batch
RETURN_TAG = 12                  # last stage -> first stage: sampled tokens


class StageLink:
    def __init__(self, pp):
        self.pp = pp
        self.pending: list = []      # (request, payload kept alive until the send completes, destination)
        self.watch = getattr(pp, "watch", None) or getattr(getattr(pp, "mpi", None), "watch", None)

    def send_to_next_stage(self, header: dict, x=None) -> None:
        self._send(header, x, self.pp.rank + 1, FORWARD_TAG)

    def recv_from_prev_stage(self):
        return self._recv(self.pp.rank - 1, FORWARD_TAG)

    def send_to_first_stage(self, header: dict, x=None) -> None:
        self._send(header, x, 0, RETURN_TAG)

    def recv_from_last_stage(self):
        return self._recv(self.pp.size - 1, RETURN_TAG)

    def flush(self) -> None:
        for request, _, dest in self.pending:
            if self.watch is not None:
                self.watch.wait(request, "pipeline send", peer=dest)
            else:
                request.wait()
        self.pending.clear()

    def _send(self, header: dict, x, dest: int, tag: int) -> None:
        header = dict(header, payload=None if x is None else (tuple(x.shape), np.dtype(x.dtype).str))
        self.pending.append((self.pp.isend_object(header, dest, tag), None, dest))
        if x is not None:
            if isinstance(x, np.ndarray):        # device arrays go as they are: the group moves them (NCCL, staged)
                x = np.ascontiguousarray(x)
            self.pending.append((self.pp.isend_array(x, dest, tag), x, dest))
        self.pending = [(r, buf, d) for r, buf, d in self.pending if not r.Test()]

    def _recv(self, source: int, tag: int):
        header = self.pp.recv_object(source, tag)
        payload = header.pop("payload")
        x = None if payload is None else self.pp.recv_array(payload[0], np.dtype(payload[1]), source, tag)
        return header, x
