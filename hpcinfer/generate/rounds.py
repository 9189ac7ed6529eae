"""The end of a batch round, on every rank: finished results go to rank 0, which commits them, and the ranks agree
whether to stop (a preemption signal may have reached only some of them).

Two small watched collectives over the world per round (comm/group.py): a gather of (results, stop reason) to
rank 0, and a broadcast of rank 0's decision, so every rank leaves the schedule after the same round.
"""

from __future__ import annotations

import signal


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (Slurm's preemption and time-limit warnings); read at batch-round boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.reason: str | None = None

    def install(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name


class BatchRounds:
    """`end(results) -> bool` (generate_share's end_round): True when the job must stop after this round.

    world: the world MPIGroup; writer: rank 0's ResultWriter (None elsewhere); progress: rank 0's Progress (or
    None); is_writer: this rank holds one copy of its replica's results (last stage, tp rank 0)."""

    def __init__(self, world, writer, progress, stop: StopFlag, is_writer: bool):
        self.world, self.writer, self.progress, self.stop, self.is_writer = world, writer, progress, stop, is_writer
        self.stopped: str | None = None          # the agreed reason, once the job stops early
        self.rounds = 0

    def end(self, results: list) -> bool:
        """results: [(prompt index, generated ids, finish_reason)] this rank finished in the round."""
        gathered = self.world.gather_object((results if self.is_writer else [], self.stop.reason))
        decision = None
        if self.world.rank == 0:
            done = [r for part, _ in gathered for r in part]
            self.writer.commit(done)
            if self.progress is not None:
                self.progress.update(len(done), sum(len(tokens) for _, tokens, _ in done))
            if len(self.writer.done) < len(self.writer.prompts):          # (nothing to stop after the last round)
                decision = next((f"{why} on rank {r}" for r, (_, why) in enumerate(gathered) if why), None)
        self.stopped = self.world.bcast_object(decision)
        self.rounds += 1
        return self.stopped is not None
