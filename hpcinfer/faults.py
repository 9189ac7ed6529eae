"""Test-only fault injection for the failure discipline's tests (docs/reliability.md), read by the runtime.

HPCINFER_FAIL_RANK=r  [HPCINFER_FAIL_AT=point]  rank r raises a RuntimeError at `point` (default after_load)
HPCINFER_HANG_RANK=r  [HPCINFER_HANG_AT=point]  rank r stops there for good (default collective): its peers'
                                                 watchdog must end the job
points: load (once the first block of weights is read), after_load, collective (on entering its first collective
after loading), sampling (the first logits the last pipeline stage samples from).
"""

from __future__ import annotations

import logging
import os
import time

POINTS = ("load", "after_load", "collective", "sampling")
log = logging.getLogger("hpcinfer")


class Faults:
    def __init__(self, rank: int, env=None):
        env = os.environ if env is None else env
        self.rank = rank
        self.fail = self._point(env, "FAIL", "after_load")
        self.hang = self._point(env, "HANG", "collective")

    def _point(self, env, kind: str, default: str) -> str | None:
        if env.get(f"HPCINFER_{kind}_RANK") != str(self.rank):
            return None
        point = env.get(f"HPCINFER_{kind}_AT", default)
        if point not in POINTS:
            raise RuntimeError(f"HPCINFER_{kind}_AT = {point!r} is not one of {', '.join(POINTS)}")
        return point

    @property
    def active(self) -> bool:
        return self.fail is not None or self.hang is not None

    def at(self, point: str, where: str = "") -> None:
        """Fail or hang here if asked to at `point`; each fires once."""
        if self.fail == point:
            self.fail = None
            raise RuntimeError(f"injected failure on rank {self.rank} at {point}{where} (HPCINFER_FAIL_RANK)")
        if self.hang == point:
            self.hang = None
            log.warning("injected hang at %s%s (HPCINFER_HANG_RANK): this rank stops here", point, where)
            while True:
                time.sleep(3600)

    def after_block(self, inner):
        """Model.load's after_block hook with the "load" point after `inner` (which may be None)."""
        if not self.active:
            return inner

        def hook(i):
            if inner is not None:
                inner(i)
            self.at("load", f" (after block {i})")
        return hook

    def arm(self, groups: list) -> None:
        """After loading: the collective point on every group's watchdog."""
        if not self.active:
            return
        for group in groups:
            if getattr(group, "size", 1) > 1 and hasattr(group, "watch"):
                group.watch.on_enter = lambda op: self.at("collective", f" ({op})")

    def sampling_hook(self, is_last_stage: bool):
        """The sampling point, for the step runner to call before it samples from logits (generate/runner.py):
        None where no fault is set or this stage does not sample."""
        if not self.active or not is_last_stage:
            return None
        return lambda: self.at("sampling")
