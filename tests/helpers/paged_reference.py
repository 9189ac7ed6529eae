"""The paged decode attention written the plainest way, as the oracle the paged paths are checked against: the
NumPy backend's (backend/paged_attention.py, which reads only the positions it needs, through one index), the
compiled CPU kernels' and cuda_src/paged_attention.cu's on the emulator. Test-only: every block of every table is
gathered whole, then masked.

Shape legend: S=sequences, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, B=blocks in the widest table,
bs=block size, L=B*bs positions read.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


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
