"""Attention through block tables on the NumPy backend (issue 21's paged KV cache; the spec a paged CUDA kernel
will be held to). The KV pool of one layer is [num_blocks, Hkv, block_size, hd] (a block is the dense cache's
[Hkv, L, hd] cut into block_size positions); a sequence's positions live in the blocks of its table, in order
(generate/block_manager.BlockTables). NumpyOps.attention comes here for a paged StepLayout (the continuous
schedule's): `attention` appends the step's rows, then gathers each sequence's blocks and runs the dense cache's
own arithmetic on them (NumpyOps._decode_over, _causal_attention), so a paged step gives the dense step's numbers.

Shape legend: S=sequences, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, B=blocks in the widest table,
bs=block size, L=B*bs positions read.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def paged_append(pool_k, pool_v, slots, k, v) -> None:
    """Write the new K and V rows of a step into the pool: k, v [T, Hkv, hd] at flat slots [T] (block * bs +
    offset, BlockTables.slots)."""
    bs = pool_k.shape[2]
    blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), bs)
    pool_k[blocks, :, offsets] = k
    pool_v[blocks, :, offsets] = v


def attention(ops, q, k, v, pool_k, pool_v, step, scale: float):
    """A paged step (StepLayout.paged): q [T, H, hd]; k, v [T, Hkv, hd] appended at the step's flat slots; pools
    [blocks, Hkv, bs, hd] -> [T, H*hd]. Decode steps are batched; prefill and mixed steps go sequence by sequence.
    Each sequence's positions are gathered in one pass (np.take of the pool's rows by an index made once per step:
    every layer gets the same StepLayout). The rows gathered past a sequence's length are not zeroed: the pools
    start as zeros and only ever hold K/V rows the model wrote, and the scores mask those positions to -inf, so they
    weigh exactly 0 (a masked copy of every gathered row cost a third of a decode step here)."""
    paged_append(pool_k, pool_v, step_memo(ops, step, "slots", step.flat_slots), k, v)
    kv_heads, bs, hd = pool_k.shape[1], pool_k.shape[2], pool_k.shape[3]
    if step.is_decode:
        lengths = step.starts + 1
        L = int(lengths.max())
        index = step_memo(ops, step, ("decode", kv_heads, bs), lambda: _row_index(step.tables, L, kv_heads, bs))
        keys, values = (np.take(pool.reshape(-1, hd), index, axis=0) for pool in (pool_k, pool_v))  # [S,Hkv,L,hd]
        return ops._decode_over(q, keys, values, lengths, scale)
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    for s in range(step.num_seqs):
        a, b = step.token_range(s)
        length = int(step.starts[s]) + b - a
        index = step_memo(ops, step, ("prefill", s, kv_heads, bs),
                      lambda: _row_index(step.tables[s:s + 1], length, kv_heads, bs)[0])
        k_seq, v_seq = (np.take(pool.reshape(-1, hd), index, axis=0) for pool in (pool_k, pool_v))  # [Hkv, n, hd]
        out[a:b] = ops._causal_attention(q[a:b], k_seq, v_seq, int(step.starts[s]), scale)
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


def paged_decode_attention(q, pool_k, pool_v, tables, lengths, scale: float):
    """One new token per sequence, its K and V already appended: q [S, H, hd], tables [S, B] int (-1 past a
    sequence's blocks), lengths [S] positions each attends over -> [S, H*hd] float32."""
    S, heads, hd = q.shape
    kv_heads, bs = pool_k.shape[1], pool_k.shape[2]
    tables = np.asarray(tables)
    lengths = np.asarray(lengths, dtype=np.int64)
    L = tables.shape[1] * bs
    valid = np.arange(L)[None, :] < lengths[:, None]                                  # [S, L]
    keys = _masked(_gather(pool_k, tables, L), valid)                                 # [S, Hkv, L, hd]
    qg = (q.astype(F32) * F32(scale)).reshape(S, kv_heads, heads // kv_heads, hd)     # [S, Hkv, g, hd]
    scores = qg @ keys.transpose(0, 1, 3, 2)                                          # [S, Hkv, g, L]
    scores += np.where(valid, F32(0), F32(-np.inf))[:, None, None, :]
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    values = _masked(_gather(pool_v, tables, L), valid)
    return (probs @ values).reshape(S, heads * hd)                                    # [S, Hkv, g, hd] -> [S, H hd]


def _gather(pool, tables, L: int):
    """[S, B] block tables -> [S, Hkv, L, hd] float32: the first L positions of each sequence's blocks, in order
    (a table's -1 padding reads block 0: positions past a sequence's length are the caller's to mask)."""
    S = tables.shape[0]
    _, kv_heads, bs, hd = pool.shape
    B = -(-L // bs)                                                                   # blocks that hold L positions
    rows = pool[np.maximum(tables[:, :B], 0)]                                         # [S, B, Hkv, bs, hd]
    return rows.transpose(0, 2, 1, 3, 4).reshape(S, kv_heads, B * bs, hd)[:, :, :L].astype(F32, copy=False)


def _masked(rows, valid):
    """rows [S, Hkv, L, hd] with the positions where valid [S, L] is False zeroed."""
    return np.where(valid[:, None, :, None], rows, F32(0))
