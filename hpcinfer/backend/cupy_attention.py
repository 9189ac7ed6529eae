"""CuPy attention without quantization: the bodies of CupyOps.attention (append to a float32 KV cache, then causal
attention over each sequence's cached positions) and CupyOps.bidirectional_attention (encoders, no cache), as
functions of the ops (their `xp`, `k` elementwise kernels, `_kernel` and `_rows`); CupyOps delegates here.
NumpyOps.attention / bidirectional_attention are the spec.

Decode (one new token per sequence): decode_attention.cu with the append fused, or kv_append + batched CuPy array
code; a DeviceStep (cupy_graphs.py) is read from its device buffers only, so the step can be captured in a CUDA
graph. One block per (KV head, sequence) leaves most SMs idle in a small batch (25 blocks on an H200's 132 for
gpt2-1.5b at batch 1: 27 us for 2 MB of K/V), so there `launch_decode` splits each context into C chunks
(flash-decoding, decode_attention_core.cuh): a block per chunk writes its partial softmax to a float32 workspace
and the last block of each (sequence, KV head) merges them in chunk order, in the same launch (deterministic: the
order of the sums never depends on which block finishes last). C (decode_splits) depends only on the batch
size, the KV heads, the positions read (a graph key's KV bucket) and the device, so a captured grid stays valid at
every replay; the kernels cut each sequence's own length, read on the device, into the C chunks.
Prefill: kv_append.cu + prefill_attention.cu over packed sequences, or CuPy array code per sequence.
Encoders: kv_append packs each sequence into a scratch cache, then prefill_attention.cu with CAUSAL=0.
A QuantizedKV cache, and top-k decode, go to cupy_kv.py.

Shape legend: T=tokens (all sequences of a step, packed), H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim,
S=sequences in the step, n=new tokens of one sequence, L=cached positions read, N=cache slots, Lmax=cache length,
C=chunks of each context (flash-decoding).
"""

from __future__ import annotations

import numpy as np

from ..quant.kv import kv_rows
from . import cupy_kv
from .cupy_decode import decode_defines, decode_fits, launch_decode, rope_args, rotated
from .cupy_dtypes import BF16_BITS, c_type, stored
from .cupy_graphs import DeviceStep
from .interface import StepLayout
from .kv_attention import SplitRows, split_attention

F32 = np.float32
_i32, _i64, _f32c = np.int32, np.int64, np.float32       # kernel argument types


def attention(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0, rope=None):
    """Append k, v to the cache, then causal attention of q over each sequence's cached positions.
    q [T, H, hd]; k, v [T, Hkv, hd]; cache_k, cache_v [N, Hkv, Lmax, hd] float32 -> out [T, H*hd]; rope (cos, sin,
    rotary_dim) or None: q and k rotated first (fused into decode_attention.cu, else ops.rotary).
    Kernels: decode_attention.cu (the append and rotary fused), kv_append.cu + prefill_attention.cu. A QuantizedKV
    cache and top-k (0 < topk < 1, decode) go to backend/cupy_kv.py."""
    cp = ops.xp
    if isinstance(cache_k, SplitRows) or _on_host(cache_k):
        q, k = rotated(ops, q, k, rope)
        if isinstance(cache_k, SplitRows):                   # CPU delegation over a split cache: by rows
            return split_attention(ops, q, k, v, cache_k, cache_v, step, scale, topk,
                                   lambda *args: host_attention(ops, *args))
        return host_attention(ops, q, k, v, cache_k, cache_v, step, scale, topk)   # the cache stays where it lies
    if topk or kv_rows(cache_k).quantized:                 # a quantized cache, or top-k: cupy_kv.py
        return cupy_kv.attention(ops, q, k, v, cache_k, cache_v, step, scale, topk, rope)
    if not step.is_decode:                                   # prefill: rotated here, the kernels take it as given
        q, k = rotated(ops, q, k, rope)
    if step.num_tokens == 0:
        return cp.zeros((0, q.shape[1] * q.shape[2]), dtype=F32)
    check_cache(cache_k, cache_v)
    if int((step.starts + step.counts).max()) > cache_k.shape[2]:
        raise ValueError(f"attention: positions up to {int((step.starts + step.counts).max())} do not fit a "
                         f"cache of {cache_k.shape[2]}")
    heads, kv_heads, hd = q.shape[1], cache_k.shape[1], q.shape[2]
    kernel_shapes = (q.dtype == k.dtype == v.dtype == F32 and heads % kv_heads == 0 and hd <= 128)
    storage = c_type(cache_k.dtype)                          # T_STORAGE: float, __half, __nv_bfloat16
    if step.is_decode:
        slots, starts, L = decode_indices(ops, step, cache_k.shape[2])
        fn = (ops._kernel("decode_attention", "decode_attention",
                          **decode_defines(heads, kv_heads, hd, T_STORAGE=storage))
              if q.dtype == k.dtype == v.dtype == F32 and decode_fits(heads, kv_heads, hd) else None)
        if fn is not None:
            (q, ldq), (k, ldk), (v, ldv) = ops._rows(q), ops._rows(k), ops._rows(v)
            return launch_decode(ops, fn, (q.shape[0], heads, kv_heads, hd), L, lambda out, part, done, ldo: (
                q, k, v, cache_k, cache_v, slots, starts, *rope_args(ops, rope), out, part, done, _i32(heads),
                _i32(kv_heads), _i32(hd), _i32(cache_k.shape[2]), _i64(ldq), _i64(ldk), _i64(ldv), ldo,
                _f32c(scale)))
        q, k = rotated(ops, q, k, rope)
        if cache_k.dtype == F32:
            ops.k.kv_append(cp.ascontiguousarray(k, dtype=F32), cp.ascontiguousarray(v, dtype=F32), slots, starts,
                            cache_k.shape[1], cache_k.shape[2], cache_k.shape[3], cache_k, cache_v, size=k.size)
        else:                                                # half storage: rounded as the kernels round
            cache_k[slots, :, starts] = stored(ops, k, cache_k.dtype)
            cache_v[slots, :, starts] = stored(ops, v, cache_v.dtype)
        return _decode_attention(ops, q, cache_k, cache_v, slots, starts, L, step, scale)
    append = ops._kernel("kv_append", "kv_append", BLOCK=128, T_STORAGE=storage)
    attend = ops._kernel("prefill_attention", "prefill_attention", NWARPS=4, ROWS_PER_WARP=4,
                         MAX_HEAD_DIM=128, KT=32, T_STORAGE=storage)
    if append is not None and attend is not None and kernel_shapes and heads // kv_heads <= 16:
        return _prefill_kernels(ops, append, attend, q, k, v, cache_k, cache_v, step, scale)
    out = cp.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    for s in range(step.num_seqs):
        a, b = step.token_range(s)
        slot, start = int(step.slots[s]), int(step.starts[s])
        cache_k[slot, :, start:start + b - a] = stored(ops, k[a:b].transpose(1, 0, 2), cache_k.dtype)
        cache_v[slot, :, start:start + b - a] = stored(ops, v[a:b].transpose(1, 0, 2), cache_v.dtype)
        out[a:b] = causal_attention(ops, q[a:b], cache_k[slot], cache_v[slot], start, scale)
    return out


# ---- prefill ---------------------------------------------------------------------------------------------------
def _prefill_kernels(ops, append, attend, q, k, v, cache_k, cache_v, step: StepLayout, scale: float):
    """kv_append then prefill_attention over packed sequences (offsets [S+1] on the device)."""
    cp = ops.xp
    heads, kv_heads, hd, lmax = q.shape[1], cache_k.shape[1], q.shape[2], cache_k.shape[2]
    S, most = step.num_seqs, int(step.counts.max())
    slots, starts = cp.asarray(step.slots, dtype=np.int64), cp.asarray(step.starts, dtype=np.int64)
    offsets = cp.asarray(step.offsets, dtype=np.int64)                              # [S + 1]
    (q, ldq), (k, ldk), (v, ldv) = ops._rows(q), ops._rows(k), ops._rows(v)
    append((most, S), (128,), (k, v, cache_k, cache_v, slots, starts, offsets, _i32(kv_heads), _i32(hd),
                               _i32(lmax), _i64(ldk), _i64(ldv)))
    out = cp.empty((q.shape[0], heads * hd), dtype=F32)
    per_block = 16 // (heads // kv_heads)                                           # (NWARPS * ROWS_PER_WARP) / g
    attend((kv_heads, -(-most // per_block), S), (32, 4),
           (q, cache_k, cache_v, slots, starts, offsets, out, _i32(heads), _i32(kv_heads), _i32(hd), _i32(lmax),
            _i64(ldq), _i64(heads * hd), _f32c(scale)))
    return out


def _on_host(cache) -> bool:
    """A host-resident cache: a NumPy array, or a QuantizedKV of NumPy arrays."""
    return isinstance(kv_rows(cache).parts()[0], np.ndarray)


def host_attention(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float):
    """FlexGen's CPU delegation (`[offload] cpu_attention`): attention over a KV cache in host memory runs on the
    host (NumpyOps, the cache appended and read in place); only the step's q, k, v [T, heads, hd] go down and the
    context [T, H*hd] comes back up, never the cache."""
    # Through pooled pinned buffers: no pageable copy on this path. The host waits for q, k, v, so every kernel
    # issued before (the last call's reads of its uploaded output included) has run when the next output's upload
    # may reuse that memory: the link's uploads need no reuse_after event of their own.
    copies = ops.link_copies()
    with copies.fetched([q, k, v]) as host:
        host_q, host_k, host_v = (_as_f32(a) for a in host)
        out = ops.host_ops.attention(host_q, host_k, host_v, cache_k, cache_v, step, scale, topk)
    return copies.upload([out], pinned=False).arrays()[0]


def _as_f32(host):
    """A downloaded activation as float32 (bfloat16 travels as its uint16 bits: the upper half of a float32)."""
    if host.dtype == BF16_BITS:
        return (host.astype(np.uint32) << 16).view(F32)
    return host.astype(F32, copy=False)


def check_cache(cache_k, cache_v):
    """A float KV cache is contiguous float32, float16 or bfloat16 (uint16 bits), K and V alike, as the kernels
    (T_STORAGE) and the fallback index it."""
    for array in (cache_k, cache_v):
        if c_type(array.dtype) is None or array.dtype != cache_k.dtype or not array.flags.c_contiguous:
            raise ValueError(f"attention: the KV cache must be contiguous float32, float16 or bfloat16 (K and V "
                             f"alike), got {array.dtype} (K {cache_k.dtype}, contiguous: {array.flags.c_contiguous})")


def decode_indices(ops, step: StepLayout, lmax: int):
    """(slots [S], starts [S] as device int64, positions read L): a DeviceStep's own buffers and bucket, or
    the host layout's uploaded with L = the longest sequence."""
    if isinstance(step, DeviceStep) and step.slots_d is not None:
        return step.slots_d, step.starts_d, min(int(step.kv_len), lmax)
    cp = ops.xp
    return (cp.asarray(step.slots, dtype=np.int64), cp.asarray(step.starts, dtype=np.int64),
            int(step.starts.max()) + 1)


def _decode_attention(ops, q, cache_k, cache_v, slots, starts, L: int, step: StepLayout, scale: float):
    """One new token per sequence, batched: q [S, H, hd] -> [S, H*hd]. Reads no host value when `step` is a
    DeviceStep (graph-capturable)."""
    cp = ops.xp
    S, heads, hd = q.shape
    kv_heads = cache_k.shape[1]
    first = int(step.slots[0]) if not isinstance(step, DeviceStep) else -1
    if first >= 0 and np.array_equal(step.slots, np.arange(first, first + S)):   # a view, no copy
        keys, values = cache_k[first:first + S, :, :L], cache_v[first:first + S, :, :L]
    else:
        keys, values = cache_k[slots, :, :L], cache_v[slots, :, :L]              # [S, Hkv, L, hd]
    keys, values = ops._f32(keys), ops._f32(values)                              # half storage widened
    qg = (q * F32(scale)).reshape(S, kv_heads, heads // kv_heads, hd)             # [S, Hkv, g, hd]
    scores = ops.matmul(qg, keys.transpose(0, 1, 3, 2))                            # [S, Hkv, g, L]
    visible = cp.arange(L)[None, :] < (starts + 1)[:, None]                      # [S, L]
    scores += cp.where(visible, F32(0), F32(-np.inf))[:, None, None, :]
    out = ops.matmul(softmax(cp, scores), values)                                 # [S, Hkv, g, hd]
    return out.reshape(S, heads * hd)


def causal_attention(ops, q, k_seq, v_seq, start: int, scale: float):
    """One sequence: q [n, H, hd] at positions start..start+n-1; k_seq, v_seq [Hkv, Lmax, hd] -> [n, H*hd]."""
    cp = ops.xp
    n, heads, hd = q.shape
    kv_heads = k_seq.shape[0]
    group, length = heads // kv_heads, start + n
    qg = (q * F32(scale)).transpose(1, 0, 2).reshape(kv_heads, group * n, hd)    # [Hkv, g*n, hd]
    k_seq, v_seq = ops._f32(k_seq[:, :length]), ops._f32(v_seq[:, :length])       # half storage widened
    scores = ops.matmul(qg, k_seq.transpose(0, 2, 1)).reshape(kv_heads, group, n, length)
    if n > 1:
        future = cp.arange(length)[None, :] > (start + cp.arange(n))[:, None]   # [n, L]
        scores += cp.where(future, F32(-np.inf), F32(0))
    probs = softmax(cp, scores).reshape(kv_heads, group * n, length)
    out = ops.matmul(probs, v_seq)                                                 # [Hkv, g*n, hd]
    return out.reshape(heads, n, hd).transpose(1, 0, 2).reshape(n, heads * hd)


def bidirectional_attention(ops, q, k, v, step: StepLayout, scale: float):
    """As NumpyOps.bidirectional_attention. q [T, H, hd], k, v [T, Hkv, hd] -> [T, H*hd]. Kernels: kv_append
    packs each sequence's K and V into a scratch cache [S, Hkv, L, hd], then prefill_attention.cu with
    CAUSAL=0 (tiled online softmax, no [S, H, L, L] scores); CuPy array code where the kernels do not fit."""
    cp = ops.xp
    T, heads, hd = q.shape
    append = ops._kernel("kv_append", "kv_append", BLOCK=128)
    attend = ops._kernel("prefill_attention", "prefill_attention", NWARPS=4, ROWS_PER_WARP=4,
                         MAX_HEAD_DIM=128, KT=32, CAUSAL=0)
    kv_heads = k.shape[1]
    if (T and append is not None and attend is not None and q.dtype == k.dtype == v.dtype == F32 and
            heads % kv_heads == 0 and heads // kv_heads <= 16 and hd <= 128):
        S, L = step.num_seqs, int(step.counts.max())
        packed = StepLayout.build(np.arange(S), np.zeros(S), step.counts)        # slot s, from position 0
        cache_k, cache_v = (cp.empty((S, kv_heads, L, hd), dtype=F32) for _ in range(2))
        return _prefill_kernels(ops, append, attend, q, k, v, cache_k, cache_v, packed, scale)
    lengths = step.counts
    S, L = len(lengths), int(lengths.max()) if len(lengths) else 0
    if T == 0:
        return cp.zeros((0, heads * hd), dtype=F32)
    ragged = bool(np.any(lengths != L))
    if ragged:
        index = cp.asarray(np.minimum(step.offsets[:-1, None] + np.arange(L)[None, :], T - 1))   # [S, L]
        valid = cp.asarray(np.arange(L)[None, :] < lengths[:, None])
        q, k, v = q[index], k[index], v[index]                                 # [S, L, H, hd]
    q, k, v = (a.reshape(S, L, heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))   # [S, H, L, hd]
    scores = ops.matmul(q * F32(scale), k.transpose(0, 1, 3, 2))                # [S, H, L, L]
    if ragged:
        scores += cp.where(valid, F32(0), F32(-np.inf))[:, None, None, :]
    out = ops.matmul(softmax(cp, scores), v).transpose(0, 2, 1, 3).reshape(S, L, heads * hd)
    return out[valid] if ragged else out.reshape(T, heads * hd)


def softmax(cp, scores):
    """Softmax over the last axis (into a new array; `scores` is left as it is)."""
    scores = scores - scores.max(axis=-1, keepdims=True)
    cp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores
