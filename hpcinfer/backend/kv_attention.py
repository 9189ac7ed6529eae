"""NumPy attention over a quantized KV cache (quant/kv.py) and FlexGen's top-k sparse decode attention.

`NumpyOps.attention` hands over here when the cache is quantized or when a decode step asks for top-k. Both kinds of
store are read through quant.kv.kv_rows (a float array as a FloatKV view, or the QuantizedKV).
A quantized cache is never expanded whole: each call dequantizes only the rows it reads (the step's sequences,
positions before the new tokens) into one float32 scratch buffer per rank that every layer and step reuses. As
in FlexGen, the new tokens' own K and V enter the attention unquantized and are stored quantized afterwards.

Top-k (decode only; prefill stays dense): per query head, scores against every cached key, then the
ceil(topk * length) best positions are kept, softmax over those only, and only those V rows are read (and, for
a quantized cache, dequantized). topk >= 1 is dense attention, computed by the dense code.

Shape legend: S=sequences of the step, T=tokens, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim,
L=positions read, K=positions kept by top-k (the most of any sequence of the step).
"""

from __future__ import annotations

import math

import numpy as np

from ..quant.kv import kv_rows
from .interface import StepLayout

F32 = np.float32


def scratch(ops, name: str, shape: tuple, dtype=F32, store: str = "_kv_scratch") -> np.ndarray:
    """A view of a per-ops buffer `name`, grown when too small and reused by every later call (never shrunk:
    its size is one layer's rows at the longest step seen). `store`: the ops attribute holding the buffers
    (`_kv_scratch`, the dequantized rows that metrics.dequant_scratch_bytes reports, unless said otherwise)."""
    store = ops.__dict__.setdefault(store, {})
    need = math.prod(shape)
    buf = store.get(name)
    if buf is None or buf.size < need or buf.dtype != np.dtype(dtype):
        buf = store[name] = np.empty(max(need, 1), dtype=dtype)
    return buf[:need].reshape(shape)


def attention(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0):
    """As NumpyOps.attention: q [T, H, hd]; k, v [T, Hkv, hd]; caches [N, Hkv, Lmax, hd] (float arrays or
    QuantizedKV, or SplitRows: CPU delegation over a split cache) -> [T, H*hd]. Appends k, v to the cache."""
    if isinstance(cache_k, SplitRows):                     # the host part attends with these NumpyOps too
        return split_attention(ops, q, k, v, cache_k, cache_v, step, scale, topk, ops.attention)
    if step.is_decode:
        return _decode(ops, q, k, v, cache_k, cache_v, step, scale, topk)
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    for s in range(step.num_seqs):
        a, b = step.token_range(s)
        slot, start = int(step.slots[s]), int(step.starts[s])
        keys = _rows_with_new(ops, "k", cache_k, slot, start, k[a:b])             # [Hkv, start + n, hd]
        values = _rows_with_new(ops, "v", cache_v, slot, start, v[a:b])
        out[a:b] = ops._causal_attention(q[a:b], keys, values, start, scale)
        cache_k[slot, :, start:start + b - a] = k[a:b].transpose(1, 0, 2)
        cache_v[slot, :, start:start + b - a] = v[a:b].transpose(1, 0, 2)
    return out


def _buffer(ops, rows, name: str, shape: tuple) -> np.ndarray:
    """A reused float32 buffer for rows read from a store: dequantized ones (`_kv_scratch`, reported as
    metrics.dequant_scratch_bytes) or float ones."""
    return scratch(ops, name, shape, store="_kv_scratch" if rows.quantized else "_float_rows")


def _nibbles(ops, rows, shape):
    return scratch(ops, "nibbles", shape, np.uint8) if rows.bits == 4 else None


def _rows_with_new(ops, name, cache, slot: int, start: int, new):
    """One sequence's cached rows 0..start-1 (dequantized) followed by its new rows: [Hkv, start + n, hd]."""
    n, kv_heads, hd = new.shape
    rows = kv_rows(cache)
    out = _buffer(ops, rows, name, (kv_heads, start + n, hd))
    if start:
        rows.read((slot, slice(None), slice(0, start)), out=out[:, :start],
                  scratch=_nibbles(ops, rows, (kv_heads, start, hd)))
    out[:, start:] = new.transpose(1, 0, 2)
    return out


def _gather(ops, name, cache, step: StepLayout, L: int, new):
    """Rows 0..L-1 of the step's slots [S, Hkv, L, hd], with `new` [S, Hkv, hd] at each sequence's own position:
    an exact (float) store holds them already and is read as it is (a view where the slots are consecutive); a
    quantized one is dequantized into the scratch buffer `name` and given them unquantized, as FlexGen."""
    slots, S = step.slots, step.num_seqs
    first = int(slots[0])
    consecutive = np.array_equal(slots, np.arange(first, first + S))
    index = (slice(first, first + S) if consecutive else slots, slice(None), slice(0, L))
    rows = kv_rows(cache)
    if rows.exact:
        return rows.read(index)
    out = _buffer(ops, rows, name, (S, rows.shape[1], L, rows.shape[3]))
    rows.read(index, out=out, scratch=_nibbles(ops, rows, out.shape))
    out[np.arange(S), :, step.starts] = new
    return out


def _decode(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float):
    """One new token per sequence: q [S, H, hd] -> [S, H*hd]."""
    S, heads, hd = q.shape
    exact = kv_rows(cache_k).exact
    if exact:                                          # a float cache takes the new rows first (read back as is)
        cache_k[step.slots, :, step.starts] = k
        cache_v[step.slots, :, step.starts] = v
    lengths = step.starts + 1                                                       # [S]
    L = int(lengths.max())
    keys = _gather(ops, "k", cache_k, step, L, k)                                   # [S, Hkv, L, hd]
    kv_heads = keys.shape[1]
    qg = (q * F32(scale)).reshape(S, kv_heads, heads // kv_heads, hd)               # [S, Hkv, g, hd]
    scores = qg @ keys.transpose(0, 1, 3, 2)                                        # [S, Hkv, g, L]
    if np.any(lengths < L):
        scores += np.where(np.arange(L)[None, :] < lengths[:, None], F32(0), F32(-np.inf))[:, None, None, :]
    if 0 < topk < 1:
        out = _top_k_values(ops, scores, cache_v, v, step, lengths, topk)           # [S, Hkv, g, hd]
    else:
        out = _softmax(scores) @ _gather(ops, "v", cache_v, step, L, v)             # [S, Hkv, g, hd]
    if not exact:                                      # a quantized one after, its rows attended as given
        cache_k[step.slots, :, step.starts] = k
        cache_v[step.slots, :, step.starts] = v
    return out.reshape(S, heads * hd)


def keep_counts(lengths, topk: float) -> np.ndarray:
    """[S] positions kept per sequence: ceil(topk * length), at least 1."""
    return np.maximum(1, np.ceil(np.asarray(lengths) * topk - 1e-9).astype(np.int64))


def _top_k_values(ops, scores, cache_v, v, step: StepLayout, lengths, topk: float):
    """scores [S, Hkv, g, L] (-inf past each length) -> softmax over each head's kept positions @ their V rows."""
    S, kv_heads, group, L = scores.shape
    keep = keep_counts(lengths, topk)                                               # [S]
    K = int(keep.max())
    idx = np.argpartition(-scores, K - 1, axis=-1)[..., :K]                          # [S, Hkv, g, K] top K, unordered
    top = np.take_along_axis(scores, idx, axis=-1)
    order = np.argsort(-top, axis=-1, kind="stable")                                # best first
    idx, top = np.take_along_axis(idx, order, axis=-1), np.take_along_axis(top, order, axis=-1)
    top = np.where((np.arange(K)[None, :] < keep[:, None])[:, None, None, :], top, F32(-np.inf))
    probs = _softmax(top)                                                           # [S, Hkv, g, K]
    rows = _value_rows(ops, cache_v, v, step, idx)                                  # [S, Hkv, g, K, hd]
    return np.einsum("shgk,shgkd->shgd", probs, rows, optimize=True)


def _value_rows(ops, cache_v, v, step: StepLayout, idx):
    """The V rows at positions idx [S, Hkv, g, K] of each sequence and KV head -> [S, Hkv, g, K, hd]; for a
    quantized cache only these rows are dequantized, and a sequence's own new position reads the new v."""
    S, kv_heads = idx.shape[:2]
    index = (step.slots[np.arange(S)[:, None, None, None]], np.arange(kv_heads)[None, :, None, None], idx)
    rows = kv_rows(cache_v)
    if rows.exact:
        return rows.read(index)
    out = _buffer(ops, rows, "v", (*idx.shape, rows.shape[3]))
    rows.read(index, out=out, scratch=_nibbles(ops, rows, out.shape))
    is_new = idx == step.starts[:, None, None, None]                                # [S, Hkv, g, K]
    if np.any(is_new):
        out[is_new] = np.broadcast_to(v[:, :, None, None, :], out.shape)[is_new]
    return out


def _softmax(scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


# ---- CPU delegation over a split cache -------------------------------------------------------------------------

class SplitRows:
    """One layer's K (or V) of a GPU batch [N, Hkv, Lmax, X] placed by rows (generate/schedules/zigzag.py): row r = sequence
    slot * Hkv + KV head; rows [0, R) are `device` [R, 1, Lmax, X] (None when R = 0), the rest `host`
    [N Hkv - R, 1, Lmax, X] (pinned host memory). Each part is a float array or a QuantizedKV. `link` counts the
    bytes split_attention sends over the link: [to the host, to the device]."""

    def __init__(self, device, host, kv_heads: int, link: list):
        self.device, self.host, self.kv_heads, self.link = device, host, kv_heads, link
        self.device_rows = 0 if device is None else int(device.shape[0])


def split_attention(ops, q, k, v, cache_k: SplitRows, cache_v: SplitRows, step: StepLayout, scale: float,
                    topk: float, host_attend):
    """FlexGen's CPU delegation over a split cache. Every (sequence, KV head) row attends on its own (its group of
    g query heads over its own keys: no softmax merge), so the device rows attend where they lie, with `ops`, and
    the host rows on the host with `host_attend` (same signature as ops.attention): only their q, k, v go down
    and their outputs come up, never their cache. Each part is a step of its own whose "sequences" are rows
    (one KV head each, slot = the row in that part). q [T, H, hd], k, v [T, Hkv, hd] -> [T, H*hd]."""
    xp = getattr(ops, "xp", np)
    T, heads, hd = q.shape
    kv_heads = cache_k.kv_heads
    group = heads // kv_heads
    out = xp.empty((T, kv_heads, group * hd), dtype=F32)                            # [T, Hkv, g hd]
    qg = q.reshape(T, kv_heads, group, hd)                                          # [T, Hkv, g, hd]
    rows = step.slots[:, None] * kv_heads + np.arange(kv_heads)[None, :]          # [S, Hkv] row of each
    R = cache_k.device_rows
    for on_host, mask in ((False, rows < R), (True, rows >= R)):
        seq, head = np.nonzero(mask)                                                # the part's rows, (s, h) order
        if not len(seq):
            continue
        counts = step.counts[seq]
        first = np.repeat(step.offsets[seq] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        tok = first + np.arange(int(counts.sum()))                                  # [M] token of each row-token
        hix = np.repeat(head, counts)
        part = StepLayout.build(rows[seq, head] - (R if on_host else 0), step.starts[seq], counts)
        tok_d, hix_d = (xp.asarray(a) for a in (tok, hix))
        q_rows = qg[tok_d, hix_d]                                                   # [M, g, hd]
        k_rows, v_rows = k[tok_d, hix_d][:, None], v[tok_d, hix_d][:, None]         # [M, 1, hd]
        if on_host:
            got = host_attend(q_rows, k_rows, v_rows, cache_k.host, cache_v.host, part, scale, topk)
            cache_k.link[0] += int(q_rows.nbytes + k_rows.nbytes + v_rows.nbytes)  # down: q, k, v of the rows
            cache_k.link[1] += int(got.nbytes)                                      # up: their outputs
        else:
            got = ops.attention(q_rows, k_rows, v_rows, cache_k.device, cache_v.device, part, scale, topk)
        out[tok_d, hix_d] = got                                                     # [M, g hd]
    return out.reshape(T, heads * hd)
