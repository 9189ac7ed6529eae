"""CuPy attention over a quantized KV cache (quant/kv.py) and top-k sparse decode attention: the device twin of
kv_attention.py, which is the spec (same semantics: the new tokens' own K and V enter the attention unquantized and
are stored quantized; top-k keeps ceil(topk * length) positions per query head, softmax over those only).

`CupyOps.attention` hands over here when the cache is a QuantizedKV (its q, scale and min arrays on the device) or
when a decode step asks for top-k. Kernels (cuda_src/, KV_BITS = 4 | 8):
- decode: decode_attention_quant.cu reads the quantized cache and dequantizes in registers, the new rows fused in
  (quantized into the cache by the same launch); no float copy of the cache. Small batches split each context
  across blocks and combine them in the same launch, as the float cache does: launch_decode chooses and launches.
- prefill: kv_quant.cu's kv_dequantize_rows writes only the rows the step reads (each sequence's positions before its
  new tokens) into a float scratch cache [S, Hkv, Lp, hd]; the float path (kv_append + prefill_attention) attends
  over it; kv_quantize_append then stores the new rows quantized.
- top-k (decode): plain CuPy array code over kernel-dequantized keys (scores, argsort, softmax over the kept
  positions), and kv_dequantize_rows for the kept V rows only.
With `kernels=False` (or shapes beyond the kernels' bounds) every step runs as plain CuPy array code (quantize and
dequantize included) with the same results. A scale or minimum beyond float16's range sets a device flag in the
kernels; it is checked (QuantError, as quantize_rows raises) after each prefill and top-k step, which read host
values anyway; a decode step does not sync for it (a flag set there is reported by the next prefill).

Shape legend: S=sequences of the step, T=tokens, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, N=slots,
Lmax=cache length, L=positions read, Lp=longest sequence after the step, K=positions kept by top-k, R=rows,
B=bytes of values per row, G=groups per row.
"""

from __future__ import annotations

import numpy as np

from ..quant.formats import QuantError
from ..quant.kv import KVFormat, QuantizedKV, kv_rows
from .cupy_dtypes import stored
from .cupy_decode import decode_defines, decode_fits, launch_decode, rope_args, rotated
from .interface import StepLayout
from .kv_attention import keep_counts

F32, F16 = np.float32, np.float16
_i32, _i64, _f32c = np.int32, np.int64, np.float32
BLOCK = 128


def attention(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0, rope=None):
    """As NumpyOps.attention (kv_attention.attention) on the device. q [T, H, hd]; k, v [T, Hkv, hd]; caches
    [N, Hkv, Lmax, hd] float32 device arrays or QuantizedKV of device arrays -> [T, H*hd]; rope (cos, sin,
    rotary_dim) or None: q and k rotated first (fused into decode_attention_quant.cu, else ops.rotary)."""
    cp = ops.xp
    quantized = kv_rows(cache_k).quantized
    sparse = step.is_decode and 0 < topk < 1
    if not quantized and not sparse:
        return ops.attention(q, k, v, cache_k, cache_v, step, scale, rope=rope)      # dense over a float cache
    if not (quantized and step.is_decode and not sparse):   # only the quantized decode kernel fuses it
        q, k = rotated(ops, q, k, rope)
        rope = None
    if step.num_tokens == 0:
        return cp.zeros((0, q.shape[1] * q.shape[2]), dtype=F32)
    if quantized:
        _check_quantized(cp, cache_k, cache_v)
    else:
        ops._check_cache(cache_k, cache_v)
    lmax = cache_k.shape[2]
    if int((step.starts + step.counts).max()) > lmax:
        raise ValueError(f"attention: positions up to {int((step.starts + step.counts).max())} do not fit a "
                         f"cache of {lmax}")
    if q.shape[1] % cache_k.shape[1] or q.shape[2] != cache_k.shape[3]:
        raise ValueError(f"attention: q {q.shape} does not fit a cache of {cache_k.shape}")
    q, k, v = (cp.asarray(a, dtype=F32) for a in (q, k, v))
    if sparse:
        out = _top_k_decode(ops, q, k, v, cache_k, cache_v, step, scale, topk)
    elif step.is_decode:
        return _decode(ops, q, k, v, cache_k, cache_v, step, scale, rope)
    else:
        out = _prefill(ops, q, k, v, cache_k, cache_v, step, scale)
    check_overflow(ops)
    return out


def _check_quantized(cp, cache_k, cache_v) -> None:
    if not kv_rows(cache_v).quantized or cache_v.fmt != cache_k.fmt or cache_v.shape != cache_k.shape:
        raise ValueError("attention: cache_k and cache_v must be QuantizedKV of one format and shape")
    for cache in (cache_k, cache_v):
        n, heads, lmax, hd = cache.shape
        G = hd // cache.fmt.group
        for array, dtype, width in ((cache.q, np.uint8, hd * cache.fmt.bits // 8), (cache.scale, F16, G),
                                    (cache.min, F16, G)):
            if (not isinstance(array, cp.ndarray) or array.dtype != dtype or not array.flags.c_contiguous
                    or array.shape != (n, heads, lmax, width)):
                raise ValueError(f"attention: a quantized KV cache must hold contiguous device arrays q uint8 "
                                 f"[N, Hkv, Lmax, B], scale and min float16 [N, Hkv, Lmax, G]; got "
                                 f"{type(array).__name__} {getattr(array, 'dtype', '?')} "
                                 f"{getattr(array, 'shape', '?')}")


# ---- the three steps ---------------------------------------------------------------------------------------------
def _decode(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, rope=None):
    """One new token per sequence over a quantized cache: q [S, H, hd] -> [S, H*hd]; reads no host value with a
    DeviceStep on the kernel path (graph-capturable)."""
    cp = ops.xp
    S, heads, hd = q.shape
    kv_heads, lmax = cache_k.shape[1], cache_k.shape[2]
    slots, starts, L = ops._decode_indices(step, lmax)
    fmt = cache_k.fmt
    fits = decode_fits(heads, kv_heads, hd)
    fn = _kernel(ops, "decode_attention_quant", "decode_attention_quant", fmt,
                 **decode_defines(heads, kv_heads, hd)) if fits else None
    if fn is not None:
        (q, ldq), (k, ldk), (v, ldv) = ops._rows(q), ops._rows(k), ops._rows(v)
        return launch_decode(ops, fn, (S, heads, kv_heads, hd), L, lambda out, part, done, ldo: (
            q, k, v, *cache_k.parts(), *cache_v.parts(), slots, starts, *rope_args(ops, rope), out, part, done,
            _i32(heads), _i32(kv_heads), _i32(hd), _i32(fmt.group), _i32(lmax), _i64(ldq), _i64(ldk), _i64(ldv),
            ldo, _f32c(scale), _status(ops)))
    q, k = rotated(ops, q, k, rope)
    keys = _read_prefix(ops, cache_k, slots, L)                                       # [S, Hkv, L, hd]
    values = _read_prefix(ops, cache_v, slots, L)
    at = cp.arange(S)
    keys[at, :, starts] = k                                                           # unquantized, as FlexGen
    values[at, :, starts] = v
    qg = (q * F32(scale)).reshape(S, kv_heads, heads // kv_heads, hd)                 # [S, Hkv, g, hd]
    scores = ops.matmul(qg, keys.transpose(0, 1, 3, 2))                                # [S, Hkv, g, L]
    scores += cp.where(cp.arange(L)[None, :] <= starts[:, None], F32(0), F32(-np.inf))[:, None, None, :]
    out = ops.matmul(_softmax(cp, scores), values)                                     # [S, Hkv, g, hd]
    append(ops, k, v, cache_k, cache_v, slots, starts, cp.arange(S + 1, dtype=np.int64), 1)
    return out.reshape(S, heads * hd)


def _prefill(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float):
    """Each sequence's cached rows 0..start-1 dequantized into a float scratch cache (slot s = sequence s), the
    float attention over it (it appends the new rows there, unquantized), then the new rows stored quantized."""
    cp = ops.xp
    S, (_, kv_heads, lmax, hd) = step.num_seqs, cache_k.shape
    starts = np.asarray(step.starts, np.int64)
    Lp = int((starts + step.counts).max())
    scratch_k, scratch_v = (cp.empty((S, kv_heads, Lp, hd), dtype=F32) for _ in range(2))
    if starts.any():
        seq, head, pos = _prefix_rows(starts, kv_heads)                              # host, [R] each
        src = cp.asarray((np.asarray(step.slots, np.int64)[seq] * kv_heads + head) * lmax + pos)
        dst = cp.asarray((seq * kv_heads + head) * Lp + pos)
        dequantize(ops, cache_k, src, scratch_k, dst)
        dequantize(ops, cache_v, src, scratch_v, dst)
    local = StepLayout.build(np.arange(S), starts, step.counts)
    out = ops.attention(q, k, v, scratch_k, scratch_v, local, scale)
    slots_d, starts_d = cp.asarray(step.slots, dtype=np.int64), cp.asarray(starts)
    append(ops, k, v, cache_k, cache_v, slots_d, starts_d, cp.asarray(step.offsets, dtype=np.int64),
           int(step.counts.max()))
    return out


def _top_k_decode(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float):
    """kv_attention._decode with 0 < topk < 1: scores against every cached key, softmax over the
    ceil(topk * length) best positions, only their V rows read (dequantized). q [S, H, hd] -> [S, H*hd]."""
    cp = ops.xp
    S, heads, hd = q.shape
    kv_heads, lmax = cache_k.shape[1], cache_k.shape[2]
    group = heads // kv_heads
    quantized = kv_rows(cache_k).quantized
    lengths = np.asarray(step.starts, np.int64) + 1                                   # [S] host
    L = int(lengths.max())
    slots, starts = cp.asarray(step.slots, dtype=np.int64), cp.asarray(step.starts, dtype=np.int64)
    at = cp.arange(S)
    if quantized:
        keys = _read_prefix(ops, cache_k, slots, L)                                   # [S, Hkv, L, hd]
        keys[at, :, starts] = k                                                       # unquantized, as FlexGen
    else:
        cache_k[slots, :, starts] = stored(ops, k, cache_k.dtype)                     # a float cache takes them first
        cache_v[slots, :, starts] = stored(ops, v, cache_v.dtype)
        keys = ops._f32(cache_k[slots, :, :L])                                        # half storage widened
    qg = (q * F32(scale)).reshape(S, kv_heads, group, hd)                             # [S, Hkv, g, hd]
    scores = ops.matmul(qg, keys.transpose(0, 1, 3, 2))                                # [S, Hkv, g, L]
    scores += cp.where(cp.arange(L)[None, :] < cp.asarray(lengths)[:, None], F32(0), F32(-np.inf))[:, None, None, :]
    keep = keep_counts(lengths, topk)                                                 # [S] host
    K = int(keep.max())
    order = cp.argsort(-scores, axis=-1)[..., :K]                                     # [S, Hkv, g, K] best first
    top = cp.take_along_axis(scores, order, axis=-1)
    kept = (cp.arange(K)[None, :] < cp.asarray(keep)[:, None])[:, None, None, :]      # [S, 1, 1, K]
    probs = _softmax(cp, cp.where(kept, top, F32(-np.inf)))                           # [S, Hkv, g, K]
    idx = cp.where(kept, order, starts[:, None, None, None])    # a dropped slot reads the own row (weight 0)
    s_ix, h_ix = at[:, None, None, None], cp.arange(kv_heads)[None, :, None, None]
    if quantized:
        rows_at = ((slots[s_ix] * kv_heads + h_ix) * lmax + idx).reshape(-1)          # [S Hkv g K]
        rows = cp.empty((rows_at.size, hd), dtype=F32)
        dequantize(ops, cache_v, rows_at, rows)
        rows = rows.reshape(S, kv_heads, group, K, hd)
        rows = cp.where((idx == starts[:, None, None, None])[..., None], v[:, :, None, None, :], rows)
    else:
        rows = ops._f32(cache_v[slots[s_ix], h_ix, idx])                              # [S, Hkv, g, K, hd]
    out = ops.matmul(probs[..., None, :], rows)[..., 0, :]                             # [S, Hkv, g, hd]
    if quantized:
        append(ops, k, v, cache_k, cache_v, slots, starts, cp.arange(S + 1, dtype=np.int64), 1)
    return out.reshape(S, heads * hd)


# ---- the format's two directions: kernels, or plain CuPy ---------------------------------------------------------
def append(ops, k, v, cache_k: QuantizedKV, cache_v: QuantizedKV, slots, starts, offsets, most: int) -> None:
    """Quantize the new rows k, v [T, Hkv, hd] into the caches: sequence s's tokens offsets[s] .. offsets[s+1]-1
    (device int64) go to positions starts[s] .. of slot slots[s]; `most`: the largest count."""
    cp = ops.xp
    _, kv_heads, lmax, hd = cache_k.shape
    fmt = cache_k.fmt
    fn = _kernel(ops, "kv_quant", "kv_quantize_append", fmt, BLOCK=BLOCK)
    if fn is not None:
        (k, ldk), (v, ldv) = ops._rows(k), ops._rows(v)
        S = int(offsets.shape[0]) - 1
        fn((most, S), (BLOCK,), (k, v, *cache_k.parts(), *cache_v.parts(), slots, starts, offsets, _i32(kv_heads),
                                 _i32(hd), _i32(fmt.group), _i32(lmax), _i64(ldk), _i64(ldv), _status(ops)))
        return
    token = cp.arange(k.shape[0])
    seq = cp.searchsorted(offsets, token, side="right") - 1                         # [T] sequence of each token
    pos = starts[seq] + token - offsets[seq]                                         # [T]
    for cache, new in ((cache_k, k), (cache_v, v)):
        parts = quantize_rows(cp, new, fmt)                                          # [T, Hkv, *]
        for array, part in zip(cache.parts(), parts):
            array[slots[seq], :, pos] = part


def dequantize(ops, cache: QuantizedKV, src_rows, out, dst_rows=None) -> None:
    """out.reshape(-1, hd)[dst_rows[i]] = cached row src_rows[i] dequantized (dst_rows None: row i); rows are
    flat indices (slot * Hkv + kvh) * Lmax + pos, device int64 [R]."""
    cp = ops.xp
    hd = cache.shape[3]
    R = int(src_rows.shape[0])
    if R == 0:
        return
    fn = _kernel(ops, "kv_quant", "kv_dequantize_rows", cache.fmt, BLOCK=BLOCK)
    if fn is not None and out.dtype == F32 and out.flags.c_contiguous:
        fn((ops._grid(R * hd, BLOCK),), (BLOCK,), (*cache.parts(), src_rows, dst_rows, out, _i64(R), _i32(hd),
                                                    _i32(cache.fmt.group)))
        return
    q, s, m = (a.reshape(-1, a.shape[-1])[src_rows] for a in cache.parts())
    rows = dequantize_rows(cp, q, s, m, cache.fmt)                                   # [R, hd]
    flat = out.reshape(-1, hd)
    if dst_rows is None:
        flat[:R] = rows
    else:
        flat[dst_rows] = rows


def _read_prefix(ops, cache: QuantizedKV, slots, L: int):
    """Rows 0..L-1 of each slot in `slots` (device [S]) dequantized -> [S, Hkv, L, hd] float32."""
    cp = ops.xp
    _, kv_heads, lmax, hd = cache.shape
    S = int(slots.shape[0])
    rows = ((slots[:, None, None] * kv_heads + cp.arange(kv_heads)[None, :, None]) * lmax
            + cp.arange(L)[None, None, :]).reshape(-1)                               # [S Hkv L]
    out = cp.empty((S, kv_heads, L, hd), dtype=F32)
    dequantize(ops, cache, rows, out)
    return out


def _prefix_rows(starts, kv_heads: int):
    """(sequence, KV head, position) of every cached row a prefill reads (positions < starts[s]), host [R] each."""
    seq = np.repeat(np.arange(len(starts)), starts * kv_heads)
    within = np.arange(seq.size) - np.repeat(np.cumsum(starts * kv_heads) - starts * kv_heads, starts * kv_heads)
    return seq, within // starts[seq], within % starts[seq]


# ---- plain array code (any xp: cupy here, numpy in the tests); bit-exact with quant/kv.py ---------------------
def _f16_toward(xp, x, down: bool):
    """The float16 next to float32 x rounding down (largest <= x) or up (smallest >= x), as kv._f16_down/_up."""
    h = x.astype(F16)
    wrong = h.astype(F32) > x if down else h.astype(F32) < x
    bits = h.view(np.uint16).astype(np.int32)
    negative, zero = bits >= 0x8000, (bits & 0x7FFF) == 0
    if down:
        stepped = xp.where(zero, 0x8001, xp.where(negative, bits + 1, bits - 1))
    else:
        stepped = xp.where(zero, 0x0001, xp.where(negative, bits - 1, bits + 1))
    return xp.where(wrong, stepped.astype(np.uint16).view(F16), h)


def quantize_rows(xp, x, fmt: KVFormat):
    """quant.kv.quantize_rows in array code of `xp`: x [..., hd] -> (q uint8 [..., B], scale, min fp16 [..., G])."""
    x = xp.asarray(x, dtype=F32)
    *lead, hd = x.shape
    groups = x.reshape(*lead, hd // fmt.group, fmt.group)                          # [..., G, g]
    top = (1 << fmt.bits) - 1
    with np.errstate(over="ignore", invalid="ignore"):                # numpy as xp (tests): checked just below
        low = _f16_toward(xp, groups.min(axis=-1), down=True)                        # [..., G]
        scale = _f16_toward(xp, (groups.max(axis=-1) - low.astype(F32)) / F32(top), down=False)
    if not (bool(xp.isfinite(scale).all()) and bool(xp.isfinite(low).all())):
        raise QuantError("KV cache values exceed the float16 range of the quantized cache's scale and minimum")
    s32 = scale.astype(F32)[..., None]
    safe = xp.where(s32 > 0, s32, F32(1))
    q = xp.clip(xp.rint((groups - low.astype(F32)[..., None]) / safe), 0, top).astype(np.uint8).reshape(*lead, hd)
    if fmt.bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)                                      # low nibble first
    return q, scale, low


def dequantize_rows(xp, q, scale, low, fmt: KVFormat):
    """quant.kv.dequantize_rows in array code of `xp`: (q [..., B], scale, min [..., G]) -> float32 [..., hd]."""
    *lead, nbytes = q.shape
    hd = nbytes * 8 // fmt.bits
    if fmt.bits == 4:
        values = xp.stack([q & 0x0F, q >> 4], axis=-1).reshape(*lead, hd)
    else:
        values = q
    G = hd // fmt.group
    out = values.reshape(*lead, G, fmt.group).astype(F32) * scale.astype(F32)[..., None]
    out += low.astype(F32)[..., None]
    return out.reshape(*lead, hd)


# ---- launch helpers ----------------------------------------------------------------------------------------------
def _kernel(ops, name: str, function: str, fmt: KVFormat, **defines):
    """ops._kernel with the cache's KV_BITS (None when kernels are off)."""
    return ops._kernel(name, function, KV_BITS=fmt.bits, **defines)


def _status(ops):
    """The device flag [1] int32 the kernels set when a scale or minimum overflows float16 (one per ops)."""
    status = ops.__dict__.get("_kv_status")
    if status is None:
        status = ops._kv_status = ops.xp.zeros(1, dtype=np.int32)
    return status


def check_overflow(ops) -> None:
    """Raise QuantError (and clear the flag) when a kernel found values beyond the quantized cache's range."""
    status = ops.__dict__.get("_kv_status")
    if status is not None and int(status[0]):
        status[0] = 0
        raise QuantError("KV cache values exceed the float16 range of the quantized cache's scale and minimum "
                         "(at this step or an earlier decode step)")


def _softmax(cp, scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    cp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores
