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
    [blocks, Hkv, bs, hd] -> [T, H*hd]. Decode steps are batched; prefill and mixed steps go sequence by sequence."""
    paged_append(pool_k, pool_v, step.flat_slots(), k, v)
    if step.is_decode:
        lengths = step.starts + 1
        valid = np.arange(int(lengths.max()))[None, :] < lengths[:, None]             # [S, L]
        keys, values = (_gather(pool, step.tables, valid) for pool in (pool_k, pool_v))
        return ops._decode_over(q, keys, values, lengths, scale)
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    for s in range(step.num_seqs):
        a, b = step.token_range(s)
        length = int(step.starts[s]) + b - a
        valid = np.arange(length)[None, :] < length
        table = step.tables[s:s + 1]
        k_seq, v_seq = (_gather(pool, table, valid)[0] for pool in (pool_k, pool_v))   # [Hkv, length, hd]
        out[a:b] = ops._causal_attention(q[a:b], k_seq, v_seq, int(step.starts[s]), scale)
    return out


def paged_decode_attention(q, pool_k, pool_v, tables, lengths, scale: float):
    """One new token per sequence, its K and V already appended: q [S, H, hd], tables [S, B] int (-1 past a
    sequence's blocks), lengths [S] positions each attends over -> [S, H*hd] float32."""
    S, heads, hd = q.shape
    kv_heads, bs = pool_k.shape[1], pool_k.shape[2]
    tables = np.asarray(tables)
    lengths = np.asarray(lengths, dtype=np.int64)
    L = tables.shape[1] * bs
    valid = np.arange(L)[None, :] < lengths[:, None]                                  # [S, L]
    keys = _gather(pool_k, tables, valid)                                             # [S, Hkv, L, hd]
    qg = (q.astype(F32) * F32(scale)).reshape(S, kv_heads, heads // kv_heads, hd)     # [S, Hkv, g, hd]
    scores = qg @ keys.transpose(0, 1, 3, 2)                                          # [S, Hkv, g, L]
    scores += np.where(valid, F32(0), F32(-np.inf))[:, None, None, :]
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ _gather(pool_v, tables, valid)).reshape(S, heads * hd)            # [S, Hkv, g, hd] -> [S, H hd]


def _gather(pool, tables, valid):
    """[S, B] block tables -> [S, Hkv, B*bs, hd] float32: each sequence's blocks in order, the positions past its
    length (the rest of its last block, a table's -1 padding) zeroed: whatever a pool holds there (another
    sequence's stale rows, uninitialized memory) never reaches the output."""
    S, L = valid.shape
    _, kv_heads, bs, hd = pool.shape
    B = -(-L // bs)                                                                   # blocks that hold L positions
    rows = pool[np.maximum(tables[:, :B], 0)]                                         # [S, B, Hkv, bs, hd]
    rows = rows.transpose(0, 2, 1, 3, 4).reshape(S, kv_heads, B * bs, hd)[:, :, :L].astype(F32, copy=False)
    return np.where(valid[:, None, :, None], rows, F32(0))
