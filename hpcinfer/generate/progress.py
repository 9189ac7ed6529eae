"""Progress of a long job on rank 0: prompts done / total, tokens/s, time left.

mode "bar": one line redrawn with a carriage return (on a terminal); "log": a log line at most every
`interval_s` seconds (and at the end); "off": nothing; "auto": bar when the stream is a terminal, else log.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("hpcinfer")


def resolve_mode(mode: str, stream) -> str:
    if mode != "auto":
        return mode
    return "bar" if getattr(stream, "isatty", lambda: False)() else "log"


class Progress:
    def __init__(self, total: int, done: int, mode: str = "auto", stream=None, interval_s: float = 30.0,
                 clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stdout
        self.mode = resolve_mode(mode, self.stream)
        self.total, self.done, self.first = total, done, done   # prompts; `first` were done by an earlier run
        self.tokens, self.clock, self.interval_s = 0, clock, interval_s
        self.start = self.last = clock()

    def update(self, prompts: int, tokens: int) -> None:
        """A batch round committed `prompts` more prompts with `tokens` generated tokens."""
        self.done += prompts
        self.tokens += tokens
        now = self.clock()
        if self.mode == "bar":
            end = "\n" if self.done >= self.total else ""
            self.stream.write(f"\r{self.line(now)}\033[K{end}")
            self.stream.flush()
        elif self.mode == "log" and (now - self.last >= self.interval_s or self.done >= self.total):
            log.info("progress: %s", self.line(now))
            self.last = now

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.tokens / elapsed
        this_run = self.done - self.first
        left = (self.total - self.done) * elapsed / this_run if this_run else float("nan")
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled) if self.mode == "bar" else ""
        return (f"{bar}{' ' if bar else ''}{self.done}/{self.total} prompts, {rate:.1f} tokens/s, "
                f"{_duration(left)} left")


def _duration(seconds: float) -> str:
    if seconds != seconds:                                   # nan: nothing measured yet
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
