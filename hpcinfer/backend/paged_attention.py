"""Attention through block tables on the NumPy backend (issue 21's paged KV cache; tests/helpers/paged_reference.py is
the plain oracle it, the compiled CPU kernels and the paged CUDA kernel are held to). The KV pool of one layer is
[num_blocks, Hkv, block_size, hd] (a block is the dense cache's [Hkv, L, hd] cut into block_size positions); a
sequence's positions live in the blocks of its table, in order (generate/block_manager.BlockTables).
NumpyOps.attention comes here for a paged StepLayout (the continuous schedule's): `attention` appends the step's
rows, then gathers each sequence's blocks and runs the dense cache's own arithmetic on them (NumpyOps._decode_over,
_causal_attention), so a paged step gives the dense step's numbers.

A quantized pool (quant.kv.QuantizedKV [num_blocks, Hkv, bs, hd]: the int8/int4 rows in blocks) and top-k decode
attention go through `through_dense`, on both backends: the sequences' blocks gathered, still quantized, into a
dense scratch cache, the dense path run on it (kv_attention.py on NumPy, cupy_kv.py on CuPy), and the new rows, as
that path stored them, copied into their blocks.

Shape legend: S=sequences, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, B=blocks in the widest table,
bs=block size, L=B*bs positions read.
"""

from __future__ import annotations

import numpy as np

from ..quant.kv import kv_rows
from . import kv_attention
from .interface import StepLayout

F32 = np.float32


def paged_append(pool_k, pool_v, slots, k, v) -> None:
    """Write the new K and V rows of a step into the pool: k, v [T, Hkv, hd] at flat slots [T] (block * bs +
    offset, BlockTables.slots)."""
    bs = pool_k.shape[2]
    blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), bs)
    pool_k[blocks, :, offsets] = k
    pool_v[blocks, :, offsets] = v


def attention(ops, q, k, v, pool_k, pool_v, step, scale: float, topk: float = 0.0):
    """A paged step (StepLayout.paged): q [T, H, hd]; k, v [T, Hkv, hd] appended at the step's flat slots; pools
    [blocks, Hkv, bs, hd] float32 or QuantizedKV -> [T, H*hd]. A quantized pool or top-k (0 < topk < 1):
    through_dense with kv_attention.attention. Decode steps are batched; prefill and mixed steps go sequence by
    sequence.
    Each sequence's positions are gathered in one pass (np.take of the pool's rows by an index made once per step:
    every layer gets the same StepLayout). The rows gathered past a sequence's length are not zeroed: the pools
    start as zeros and only ever hold K/V rows the model wrote, and the scores mask those positions to -inf, so they
    weigh exactly 0 (a masked copy of every gathered row cost a third of a decode step here)."""
    if needs_dense_kv(pool_k, step, topk):
        return through_dense(ops, q, k, v, pool_k, pool_v, step, scale, topk, kv_attention.attention)
    paged_append(pool_k, pool_v, step_memo(ops, step, "slots", step.flat_slots), k, v)
    kv_heads, bs, hd = pool_k.shape[1], pool_k.shape[2], pool_k.shape[3]
    if step.is_decode:
        lengths = step.starts + 1
        L = int(lengths.max())
        index = step_memo(ops, step, ("decode", kv_heads, bs), lambda: _row_index(step.tables, L, kv_heads, bs))
        keys, values = (_gathered(ops, name, pool, index) for name, pool in (("k", pool_k), ("v", pool_v)))
        return ops._decode_over(q, keys, values, lengths, scale)                       # keys, values [S,Hkv,L,hd]
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    for s in range(step.num_seqs):
        a, b = step.token_range(s)
        start = int(step.starts[s])
        if start == 0:                                   # a whole prompt: its rows are the step's own
            k_seq, v_seq = k[a:b].transpose(1, 0, 2), v[a:b].transpose(1, 0, 2)       # [Hkv, n, hd] views
        else:
            index = step_memo(ops, step, ("prefill", s, kv_heads, bs),
                              lambda: _row_index(step.tables[s:s + 1], start + b - a, kv_heads, bs)[0])
            k_seq, v_seq = (_gathered(ops, name, pool, index) for name, pool in (("k", pool_k), ("v", pool_v)))
        out[a:b] = ops._causal_attention(q[a:b], k_seq, v_seq, start, scale)
    return out


def _gathered(ops, name: str, pool, index):
    """pool's rows at `index` (pool.reshape(-1, hd) rows, any shape) -> [*index.shape, hd], into a buffer the ops
    keep and reuse (kv_attention.scratch): a fresh array a step would cost page faults on every layer (a decode
    step's gather of 8 x 400 positions took twice as long)."""
    hd = pool.shape[-1]
    out = kv_attention.scratch(ops, name, (*index.shape, hd), store="_paged_gather")
    return np.take(pool.reshape(-1, hd), index, axis=0, out=out)


# ---- quantized pools and top-k: the dense path over a gathered scratch -------------------------------------------

def needs_dense_kv(pool_k, step, topk: float) -> bool:
    """A quantized pool, or top-k with decode tokens in the step: `through_dense` (the paged float paths read float
    rows and attend densely)."""
    return kv_rows(pool_k).quantized or (0 < topk < 1 and bool(np.any(step.counts == 1)))


def through_dense(ops, q, k, v, pool_k, pool_v, step, scale: float, topk: float, dense_attention):
    """A paged step run by the dense cache's own path, `dense_attention` (kv_attention.attention; on CuPy
    cupy_kv.attention): for each part of the step (dense_parts), each sequence's cached blocks gathered as they
    are stored (quantized rows stay quantized: only their bytes move) into slot s of a scratch cache
    [S, Hkv, L, *], the dense path run on it (it dequantizes only the rows it reads, lets the new rows in
    unquantized and stores them quantized, applies top-k to decode steps), then the new rows, as it stored them,
    copied from the scratch into their blocks. So a paged step gives the dense step's numbers and bytes.
    q [T, H, hd]; k, v [T, Hkv, hd]; pools [blocks, Hkv, bs, hd] (float32 or QuantizedKV) -> [T, H*hd]."""
    xp = getattr(ops, "xp", np)
    kv_heads, bs = pool_k.shape[1], pool_k.shape[2]
    parts = step_memo(ops, step, ("dense", kv_heads, bs, 0 < topk < 1),
                      lambda: [DensePart(xp, step, rows, kv_heads) for rows in dense_parts(step, topk)])
    if len(parts) == 1:
        return parts[0].attend(ops, q, k, v, pool_k, pool_v, scale, topk, dense_attention)
    out = xp.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    for part in parts:
        tok = part.tokens
        out[tok] = part.attend(ops, q[tok], k[tok], v[tok], pool_k, pool_v, scale, topk, dense_attention)
    return out


def dense_parts(step, topk: float) -> list:
    """The step's sequences as the dense path must see them, [S'] each: with top-k, its decode tokens (one new
    token: the static schedule's decode steps, where top-k applies) apart from its prompt chunks (attended
    densely, as the static schedule's prefill); else all of them in one part."""
    every = np.arange(step.num_seqs)
    if not 0 < topk < 1:
        return [every]
    one = step.counts == 1
    return [rows for rows in (every[one], every[~one]) if len(rows)]


class DensePart:
    """Sequences `rows` of a paged step as a dense step of their own over a scratch cache (slot s = sequence s):
    where their positions lie in the pool and in the scratch. Made once per step (step_memo); the indices live on
    the device of `xp`. Shapes: S' sequences, T' tokens, L = their longest length after the step."""

    def __init__(self, xp, step, rows, kv_heads: int):
        starts, counts = step.starts[rows], step.counts[rows]
        self.dense = StepLayout.build(np.arange(len(rows)), starts, counts)
        L = int((starts + counts).max())
        tok = np.concatenate([np.arange(*step.token_range(s)) for s in rows])          # [T'] of the step's T
        seq = np.repeat(np.arange(len(rows)), counts)                                   # [T'] scratch slot
        blocks, offsets = np.divmod(step.flat_slots()[tok], step.block_size)            # [T'] each
        heads = np.arange(kv_heads)[None, :]
        src = (seq[:, None] * kv_heads + heads) * L + self.dense.positions[:, None]     # [T', Hkv] scratch row
        dst = (blocks[:, None] * kv_heads + heads) * step.block_size + offsets[:, None]  # [T', Hkv] pool row
        gather = _row_index(step.tables[rows], L, kv_heads, step.block_size)           # [S', Hkv, L] pool row
        self.tokens, self.gather = xp.asarray(tok), xp.asarray(gather)
        self.src, self.dst = xp.asarray(src.reshape(-1)), xp.asarray(dst.reshape(-1))

    def attend(self, ops, q, k, v, pool_k, pool_v, scale: float, topk: float, dense_attention):
        """q [T', H, hd]; k, v [T', Hkv, hd] -> [T', H*hd]; the new rows end up in the pools."""
        xp = getattr(ops, "xp", np)
        take = lambda a: xp.take(a.reshape(-1, a.shape[-1]), self.gather, axis=0)     # [S', Hkv, L, X]
        scratch_k, scratch_v = (kv_rows(pool).map(take) for pool in (pool_k, pool_v))
        out = dense_attention(ops, q, k, v, scratch_k, scratch_v, self.dense, scale, topk)
        for pool, scratch in ((pool_k, scratch_k), (pool_v, scratch_v)):
            for dst, src in zip(kv_rows(pool).parts(), kv_rows(scratch).parts()):
                dst.reshape(-1, dst.shape[-1])[self.dst] = src.reshape(-1, src.shape[-1])[self.src]
        return out


def _row_index(tables, L: int, kv_heads: int, bs: int) -> np.ndarray:
    """[S, Hkv, L] int64: the row of pool.reshape(-1, hd) holding (sequence, head, position) for the first L
    positions of each table (a -1 entry, past a sequence's blocks, reads block 0: masked by the caller)."""
    positions = np.arange(L)
    blocks = np.maximum(tables[:, positions // bs], 0).astype(np.int64)                # [S, L]
    return (blocks[:, None, :] * kv_heads + np.arange(kv_heads)[None, :, None]) * bs + (positions % bs)[None, None, :]


def step_memo(ops, step, name, make):
    """make() once per step: every layer gets the same StepLayout (PagedKVCache.layer_step), so what a step's
    attention derives from it (indices; on CuPy their device copies, backend/cupy_paged.py) is made once a step,
    not once a layer. The ops keep the last step's values, keyed by the step itself (identity, held: never a stale
    match)."""
    memo = getattr(ops, "_paged_step", None)
    if memo is None or memo[0] is not step:
        memo = ops._paged_step = (step, {})
    if name not in memo[1]:
        memo[1][name] = make()
    return memo[1][name]
