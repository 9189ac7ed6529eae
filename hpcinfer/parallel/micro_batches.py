"""Micro-batches: sequences 0..n-1 split into contiguous groups of near-equal size (the pipeline's micro-batches,
the offload schedules' GPU batches, the budget's per-batch sizes). Below generate/ and offload/, which both use it."""

from __future__ import annotations


def micro_batches(n_seqs: int, count: int, exact: bool = False) -> list[range]:
    """Split sequences 0..n-1 into min(count, n) contiguous groups whose sizes differ by at most one (exactly
    `count` groups, some possibly empty, when `exact`: replicas stepping together need the same groups)."""
    count = max(1, count if exact else min(count, n_seqs))
    base, extra = divmod(n_seqs, count)
    groups, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups
