"""Collectives named for what they do to the tensor-parallel region; each is the identity on one rank
(Megatron's mappings), so the same model code runs on 1 rank and on 256."""

from __future__ import annotations


def reduce_from_tp(x, tp):
    """Sum the partial outputs of a row-parallel matmul (or a vocab-parallel embedding) over the tp group."""
    return x if tp.size == 1 else tp.all_reduce(x)


def gather_from_tp(x, tp, xp):
    """Concatenate the last-axis shards of x [..., n] from every tp rank, in rank order -> [..., tp * n]."""
    if tp.size == 1:
        return x
    parts = tp.all_gather(x)                                  # [tp, ..., n]
    return xp.concatenate(list(parts), axis=-1)


def broadcast_from_tp_root(x, tp):
    """Make every tp rank hold tp rank 0's value (e.g. the sampled tokens), so ranks never diverge."""
    return x if tp.size == 1 else tp.broadcast(x, root=0)
