"""Rank-prefixed logging: "[rank 3] message" on stderr. Rank 0 prints from `level` up; the other ranks print
warnings and errors only (and everything at level "debug"), so by default one rank speaks unless something is
wrong."""

from __future__ import annotations

import logging
import sys

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, level: int):
        super().__init__()
        self.rank, self.level = rank, level

    def filter(self, record) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING or self.level <= logging.DEBUG


def setup_logging(rank: int, level: str = "info", stream=None) -> logging.Logger:
    """Configure the "hpcinfer" logger for this rank (again, with the config's level, once it is known)."""
    logger = logging.getLogger("hpcinfer")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    handler.addFilter(_RankFilter(rank, LEVELS[level]))
    logger.addHandler(handler)
    logger.setLevel(LEVELS[level])
    logger.propagate = False
    return logger
