"""Compiled CPU attention over a KV pool read through block tables (Numba): the CPU twins of cuda_src/'s decode
and prefill attention, one pass with an online softmax (flash-attention's), the g query heads of a KV head
together so that each cached K/V row is read once per step.

The kernels are functions over plain arrays, whatever store holds them:
  q [T, H, hd]             the step's queries (T tokens of S sequences, packed)
  k, v [T, Hkv, hd]        the step's new rows, attended as they are (float32; a quantized store keeps them
                           quantized only after the step, as FlexGen and backend/kv_attention.py do)
  pool (values, scales, mins) of K and of V: the cached rows [NB, Hkv, bs, *] (cpu_kernels/kv_rows.py), float32
                           or int8 / int4 with float16 scale and min per group (`group` values)
  tables [S, B] int32      sequence s's position p is row p % bs of block tables[s, p // bs] (the dense cache:
                           its slot, one block of Lmax positions)
  starts, counts [S]       positions cached before the step, new tokens; offsets [S + 1] the tokens' packing
  items [W, 3]             the work: (sequence, KV head, first query position), taken by the threads in turn
                           (make_items orders them longest first), each computed whole by one thread, so the
                           result does not depend on the thread count
  out [T, H*hd]

A work item attends its queries (one position for decode, up to QUERY_BLOCK for prefill), as R = queries x g
rows, over the cached positions 0 .. start - 1 (through the table) and then the step's own rows up to its last
query, causally, in chunks of at most CHUNK positions within a block: scores [R, chunk] in L1, a running max and
sum per row, the chunk's V rows added to the accumulators [R, hd].

Shape legend: H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, R=query rows of a work item, C=chunk positions.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .kv_rows import FAST, block_rows, exp_in_place, read_row

F32 = np.float32
CHUNK = 64           # key positions per chunk: their scores [R, C] and a quantized chunk's float rows stay in L1
QUERY_BLOCK = 16     # query positions of a prefill work item (R = 16 g rows share every K/V row read)
_FLOOR = F32(-3.0e38)   # the running max before any score (finite: exp(_FLOOR - m) is exactly 0)


def make_items(starts, counts, kv_heads: int, query_block: int = QUERY_BLOCK) -> np.ndarray:
    """[W, 3] int64 work items (sequence, KV head, first query) of a step, the most key positions first, so that
    threads taking them in turn end together."""
    starts, counts = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    blocks = -(-counts // query_block)                                                  # [S] query blocks
    seq = np.repeat(np.arange(len(counts)), blocks)
    first = np.arange(int(blocks.sum())) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    first *= query_block                                                                # [S'] first query
    cost = starts[seq] + np.minimum(first + query_block, counts[seq])                  # keys the block reads
    order = np.argsort(-cost, kind="stable")
    seq, first = seq[order], first[order]
    items = np.empty((len(seq) * kv_heads, 3), dtype=np.int64)
    items[:, 0] = np.repeat(seq, kv_heads)
    items[:, 1] = np.tile(np.arange(kv_heads), len(seq))
    items[:, 2] = np.repeat(first, kv_heads)
    return items


@njit(parallel=True, fastmath=FAST, cache=True)
def causal_attention(q, k, v, k_pool, v_pool, group, tables, starts, counts, offsets, items, scale, out, parts):
    """Each item's queries over their sequence's cached positions and the step's rows up to them (module doc).
    k_pool, v_pool: (values, scales, mins) tuples; parts: the threads (numba.set_num_threads's count)."""
    for part in prange(parts):
        for i in range(part, items.shape[0], parts):
            _causal_item(q, k, v, k_pool, v_pool, group, tables, starts, counts, offsets, items[i, 0], items[i, 1],
                         items[i, 2], scale, out)


@njit(fastmath=FAST, cache=True)
def _causal_item(q, k, v, k_pool, v_pool, group, tables, starts, counts, offsets, s, h, first, scale, out):
    hd, kv_heads = q.shape[2], k.shape[1]
    g = q.shape[1] // kv_heads
    bs = k_pool[0].shape[2]
    start, token0 = starts[s], offsets[s]
    last = min(first + QUERY_BLOCK, counts[s])                       # queries first .. last - 1 of the sequence
    R = (last - first) * g
    qs = np.empty((R, hd), dtype=F32)                                # row r: query first + r // g, head r % g
    for r in range(R):
        for d in range(hd):
            qs[r, d] = q[token0 + first + r // g, h * g + r % g, d] * scale
    acc = np.zeros((R, hd), dtype=F32)
    run_max = np.full(R, _FLOOR, dtype=F32)
    run_sum = np.zeros(R, dtype=F32)
    scores = np.empty((R, CHUNK), dtype=F32)
    k_buf, v_buf = np.empty((CHUNK, hd), dtype=F32), np.empty((CHUNK, hd), dtype=F32)
    bits = np.empty(CHUNK, dtype=np.int32)
    p, end = 0, start + last
    while p < end:                              # the cached positions through the table, then the step's own rows
        if p < start:
            block, offset = tables[s, p // bs], p % bs
            n = min(CHUNK, bs - offset, start - p)
            keys, k0 = block_rows(*k_pool, group, block, h, offset, n, k_buf)
            values, v0 = block_rows(*v_pool, group, block, h, offset, n, v_buf)
        else:
            n = min(CHUNK, end - p)
            token = token0 + p - start
            k_buf[:n] = k[token:token + n, h]
            v_buf[:n] = v[token:token + n, h]
            keys, k0, values, v0 = k_buf, 0, v_buf, 0
        _attend_chunk(qs, keys, k0, values, v0, n, scores, acc, run_max, run_sum, bits, g, start + first, p)
        p += n
    for r in range(R):
        inv = F32(1) / run_sum[r]
        col = (h * g + r % g) * hd
        for d in range(hd):
            out[token0 + first + r // g, col + d] = acc[r, d] * inv


@njit(fastmath=FAST, cache=True, inline="always")
def _attend_chunk(qs, keys, k0, values, v0, n, scores, acc, run_max, run_sum, bits, g, query0, key0):
    """Rows qs [R, hd] (row r at position query0 + r // g) over the n keys at positions key0 .. key0 + n - 1
    (keys[k0:k0 + n], values[v0:v0 + n]): a row sees the keys at or before its own position."""
    R = qs.shape[0]
    _scores(qs, keys, k0, n, scores)
    for r in range(R):
        seen = min(n, query0 + r // g - key0 + 1)                    # causal: keys after the row's query weigh 0
        row = scores[r]
        if seen <= 0:
            row[:n] = 0
            continue
        top = run_max[r]
        for c in range(seen):
            top = max(top, row[c])
        for c in range(seen):
            row[c] -= top
        exp_in_place(row, seen, bits)
        total = F32(0)
        for c in range(seen):
            total += row[c]
        row[seen:n] = 0
        if top > run_max[r]:
            alpha = F32(math.exp(run_max[r] - top))
            run_sum[r] *= alpha
            acc[r] *= alpha
            run_max[r] = top
        run_sum[r] += total
    _add_values(scores, values, v0, n, acc)


@njit(fastmath=FAST, cache=True, inline="always")
def _scores(qs, keys, k0, n, scores):
    """scores[r, c] = qs[r] . keys[k0 + c], four keys at a time (one load of each query value for four)."""
    R, hd = qs.shape
    c = 0
    while c + 4 <= n:
        for r in range(R):
            a0 = a1 = a2 = a3 = F32(0)
            for d in range(hd):
                x = qs[r, d]
                a0 += x * keys[k0 + c, d]
                a1 += x * keys[k0 + c + 1, d]
                a2 += x * keys[k0 + c + 2, d]
                a3 += x * keys[k0 + c + 3, d]
            scores[r, c], scores[r, c + 1], scores[r, c + 2], scores[r, c + 3] = a0, a1, a2, a3
        c += 4
    for c in range(c, n):
        for r in range(R):
            a = F32(0)
            for d in range(hd):
                a += qs[r, d] * keys[k0 + c, d]
            scores[r, c] = a


@njit(fastmath=FAST, cache=True, inline="always")
def _add_values(weights, values, v0, n, acc):
    """acc[r] += sum_c weights[r, c] values[v0 + c], four rows of V at a time (one load and store of acc)."""
    R, hd = acc.shape
    c = 0
    while c + 4 <= n:
        for r in range(R):
            w0, w1, w2, w3 = weights[r, c], weights[r, c + 1], weights[r, c + 2], weights[r, c + 3]
            for d in range(hd):
                acc[r, d] += (w0 * values[v0 + c, d] + w1 * values[v0 + c + 1, d] + w2 * values[v0 + c + 2, d]
                              + w3 * values[v0 + c + 3, d])
        c += 4
    for c in range(c, n):
        for r in range(R):
            w = weights[r, c]
            for d in range(hd):
                acc[r, d] += w * values[v0 + c, d]


# ---- FlexGen's top-k sparse decode attention ---------------------------------------------------------------------

@njit(parallel=True, fastmath=FAST, cache=True)
def top_k_attention(q, k, v, k_pool, v_pool, group, tables, starts, offsets, items, keep, scale, out, parts):
    """Decode items (one new token each: sequence s attends positions 0 .. starts[s], the last its own k, v):
    per query head, softmax over the keep[s] best-scoring positions only, and only their V rows read
    (backend/kv_attention.py's top-k). Arguments as causal_attention's; keep [S]."""
    for part in prange(parts):
        for i in range(part, items.shape[0], parts):
            _top_k_item(q, k, v, k_pool, v_pool, group, tables, starts, offsets, items[i, 0], items[i, 1],
                        keep[items[i, 0]], scale, out)


@njit(fastmath=FAST, cache=True)
def _top_k_item(q, k, v, k_pool, v_pool, group, tables, starts, offsets, s, h, keep, scale, out):
    hd, kv_heads = q.shape[2], k.shape[1]
    g = q.shape[1] // kv_heads
    bs = k_pool[0].shape[2]
    start, token = starts[s], offsets[s]
    length = start + 1
    qs = np.empty((g, hd), dtype=F32)
    for j in range(g):
        for d in range(hd):
            qs[j, d] = q[token, h * g + j, d] * scale
    scores = np.empty((g, length), dtype=F32)                        # every position's score, then the kept
    chunk = np.empty((g, CHUNK), dtype=F32)
    buf = np.empty((CHUNK, hd), dtype=F32)
    p = 0
    while p < start:
        block, offset = tables[s, p // bs], p % bs
        n = min(CHUNK, bs - offset, start - p)
        keys, k0 = block_rows(*k_pool, group, block, h, offset, n, buf)
        _scores(qs, keys, k0, n, chunk)
        scores[:, p:p + n] = chunk[:, :n]
        p += n
    for d in range(hd):
        buf[0, d] = k[token, h, d]
    _scores(qs, buf, 0, 1, chunk)
    scores[:, start] = chunk[:, 0]
    picked = np.empty(keep, dtype=np.int64)
    weights = np.empty(keep, dtype=F32)
    for j in range(g):
        _pick_top(scores[j], keep, picked, weights)
        acc = np.zeros(hd, dtype=F32)
        for i in range(keep):
            position = picked[i]
            if position == start:
                row = v[token, h]
            else:
                row = read_row(*v_pool, group, tables[s, position // bs], h, position % bs, buf)
            for d in range(hd):
                acc[d] += weights[i] * row[d]
        col = (h * g + j) * hd
        for d in range(hd):
            out[token, col + d] = acc[d]


@njit(fastmath=FAST, cache=True)
def _pick_top(row, keep, picked, weights):
    """The keep best of row [L] -> picked [keep] positions (ties at the threshold: the earliest) and weights
    [keep], their softmax."""
    length = row.shape[0]
    threshold = np.partition(row, length - keep)[length - keep] if keep < length else np.min(row)
    above = 0
    for p in range(length):
        above += row[p] > threshold
    n, ties = 0, keep - above
    for p in range(length):
        if row[p] > threshold or (row[p] == threshold and ties > 0):
            if row[p] == threshold:
                ties -= 1
            picked[n] = p
            n += 1
    top = _FLOOR
    for i in range(keep):
        top = max(top, row[picked[i]])
    total = F32(0)
    for i in range(keep):
        weights[i] = math.exp(row[picked[i]] - top)
        total += weights[i]
    for i in range(keep):
        weights[i] /= total
