"""CuPy attention over a paged KV cache (issue 21; the continuous schedule's StepLayout.paged): the body of
CupyOps.attention for a paged step, as a function of the ops. backend/paged_attention.py (NumpyOps) is the spec:
append the step's rows at their flat slots, then decode steps attend each sequence's first start + 1 positions
through its block table, prefill and mixed steps attend causally per sequence.

Decode: cuda_src/paged_attention.cu's paged_decode_attention appends each sequence's row and reads the pool through
the tables on the device, the dense decode kernel's attention (decode_attention_core.cuh) with a paged reader; a
small batch splits each context into chunks (flash-decoding) exactly as the dense path does, through
cupy_decode.launch_decode (the same chunk-count policy; the chunks combined in the same launch). Prefill and mixed steps, and decode
steps the kernel does not take (cupy_decode.decode_fits false, non-float32 rows, kernels off):
paged_kv_append (or CuPy's scatter), then each sequence's cached blocks gathered into a dense scratch cache
[S, Hkv, L, hd] and the dense cache's own path run on it (cupy_attention.attention: prefill_attention.cu, or its
plain-CuPy fallbacks, chosen as it chooses), so a paged step gives the dense step's numbers.

Under a CUDA graph (generate/graphs.PagedDecodeGraphs) a decode step is a PagedDeviceStep (cupy_graphs.py): the
kernel reads its tables, of a fixed width, and lengths from its device buffers, and the split count comes from its
KV bucket, not the longest length, so the captured grid holds at every replay. A PagedDeviceStep the decode kernel
does not take runs the fallback on its host values (uploaded: a capture of it fails, and the key runs eagerly).

Shape legend: T=tokens, S=sequences, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, bs=block size,
B=blocks in the widest table, L=positions of the longest sequence after the step.
"""

from __future__ import annotations

import numpy as np

from . import cupy_attention, cupy_kv
from .cupy_decode import decode_defines, decode_fits, launch_decode, rope_args, rotated
from .cupy_dtypes import c_type, stored
from .cupy_graphs import PagedDeviceStep, decode_lengths as lengths_of
from .interface import StepLayout
from .paged_attention import needs_dense_kv, step_memo, through_dense

F32 = np.float32
_i32, _i64, _f32c = np.int32, np.int64, np.float32       # kernel argument types
APPEND_BLOCK = 128


def attention(ops, q, k, v, pool_k, pool_v, step: StepLayout, scale: float, topk: float = 0.0, rope=None):
    """A paged step: q [T, H, hd]; k, v [T, Hkv, hd] appended at the step's flat slots; pools [blocks, Hkv, bs, hd]
    float32 -> [T, H*hd]; rope (cos, sin, rotary_dim) or None: q and k rotated first (fused into the decode kernel,
    else ops.rotary). A quantized pool (QuantizedKV) or top-k decode tokens (0 < topk < 1): gathered into the
    dense layout for cupy_kv.py (paged_attention.through_dense)."""
    cp = ops.xp
    if step.num_tokens == 0:
        return cp.zeros((0, q.shape[1] * q.shape[2]), dtype=F32)
    if needs_dense_kv(pool_k, step, topk):
        q, k = rotated(ops, q, k, rope)
        return through_dense(ops, q, k, v, pool_k, pool_v, step, scale, topk, cupy_kv.attention)
    ops._check_cache(pool_k, pool_v)
    if step.is_decode:
        kernel = _decode_kernel(ops, q, k, v, pool_k)
        if kernel is not None:
            return decode_attention(ops, kernel, q, k, v, pool_k, pool_v, step, scale, rope)
    q, k = rotated(ops, q, k, rope)
    step = on_host(step)
    append(ops, pool_k, pool_v, uploaded(ops, step, "slots", step.flat_slots), k, v)
    return _dense(ops, q, k, v, pool_k, pool_v, step, scale)


def append(ops, pool_k, pool_v, slots, k, v) -> None:
    """k, v [T, Hkv, hd] into the pools at flat slots [T] (block * bs + offset, int64 on the device):
    paged_kv_append, or CuPy's scatter where the kernel is off or the rows are not float32."""
    _, kv_heads, bs, hd = pool_k.shape
    fn = ops._kernel("paged_attention", "paged_kv_append", BLOCK=APPEND_BLOCK, T_STORAGE=c_type(pool_k.dtype))
    if fn is None or k.dtype != F32 or v.dtype != F32:
        blocks, offsets = slots // bs, slots % bs
        pool_k[blocks, :, offsets] = stored(ops, k, pool_k.dtype)
        pool_v[blocks, :, offsets] = stored(ops, v, pool_v.dtype)
        return
    (k, ldk), (v, ldv) = ops._rows(k), ops._rows(v)
    fn((int(slots.shape[0]),), (APPEND_BLOCK,),
       (k, v, pool_k, pool_v, slots, _i32(kv_heads), _i32(hd), _i32(bs), _i64(ldk), _i64(ldv)))


def _decode_kernel(ops, q, k, v, pool_k):
    """paged_decode_attention when it takes these shapes (float32 q, k, v; cupy_decode.decode_fits), else None."""
    heads, hd, kv_heads = q.shape[1], q.shape[2], pool_k.shape[1]
    if not (q.dtype == k.dtype == v.dtype == F32 and decode_fits(heads, kv_heads, hd)):
        return None
    return ops._kernel("paged_attention", "paged_decode_attention",
                       **decode_defines(heads, kv_heads, hd, T_STORAGE=c_type(pool_k.dtype)))


def decode_attention(ops, kernel, q, k, v, pool_k, pool_v, step: StepLayout, scale: float, rope=None):
    """One new token per sequence: q [S, H, hd], k, v [S, Hkv, hd] -> [S, H*hd], the rows appended by the kernel.
    The tables [S, B] and the lengths starts + 1 [S] as int32 on the device (decode_tables); the chunk count as
    launch_decode picks it for the positions read (the longest length, or a graph's KV bucket)."""
    S, heads, hd = q.shape
    kv_heads, bs = pool_k.shape[1], pool_k.shape[2]
    tables, lengths, positions = decode_tables(ops, step)
    (q, ldq), (k, ldk), (v, ldv) = ops._rows(q), ops._rows(k), ops._rows(v)
    return launch_decode(ops, kernel, (S, heads, kv_heads, hd), positions, lambda out, part, done, ldo: (
        q, k, v, pool_k, pool_v, tables, lengths, *rope_args(ops, rope), out, part, done, _i32(heads),
        _i32(kv_heads), _i32(hd), _i32(bs), _i32(tables.shape[1]), _i64(ldq), _i64(ldk), _i64(ldv), ldo,
        _f32c(scale)))


def decode_tables(ops, step: StepLayout):
    """(tables [S, B] int32, lengths [S] int32 on the device, positions read): a PagedDeviceStep's own buffers and
    KV bucket (reads no host value: graph-capturable), or the host layout's uploaded once per step with the
    longest length (BlockTables' padding -1 stays: the kernel reads no entry past a length)."""
    if isinstance(step, PagedDeviceStep):
        return step.tables_d, step.lengths_d, step.kv_len
    tables = uploaded(ops, step, "tables", lambda: np.ascontiguousarray(step.tables, dtype=np.int32))   # [S, B]
    lengths = uploaded(ops, step, "lengths", lambda: decode_lengths(step))                               # [S]
    return tables, lengths, int(step.starts.max()) + 1


def decode_lengths(step: StepLayout):
    """[S] int32: the positions each decode token attends, start + 1 (its own row the last); flat_slots first
    raises if a new row has no block in its table (the kernel would write through a -1)."""
    step.flat_slots()
    return lengths_of(step)


def on_host(step: StepLayout) -> StepLayout:
    """The host layout of a step for the paths that upload it: a PagedDeviceStep's host values as a new
    StepLayout (a fresh per-step memo, so its uploads are made, not taken from an earlier call: under a capture
    they fail, and the key runs eagerly, rather than baking one step's values into a graph); others as they are."""
    if isinstance(step, PagedDeviceStep):
        return StepLayout.paged(step.tables, step.block_size, step.starts, step.counts)
    return step


def _dense(ops, q, k, v, pool_k, pool_v, step: StepLayout, scale: float):
    """The dense cache's path on a scratch copy: each sequence's cached positions gathered into slot s of a cache
    [S, Hkv, L, hd], then cupy_attention.attention on the dense layout (it appends the step's rows there and
    attends, with kernels or plain CuPy as it chooses)."""
    index = uploaded(ops, step, "gather", lambda: gather_index(step))
    scratch_k, scratch_v = (gather(ops, pool, *index) for pool in (pool_k, pool_v))
    dense = StepLayout.build(np.arange(step.num_seqs), step.starts, step.counts)
    return cupy_attention.attention(ops, q, k, v, scratch_k, scratch_v, dense, scale)


def gather_index(step: StepLayout):
    """Where each sequence's cached positions (those before its start) lie: blocks [S, L] and offsets [L] of
    position p (block 0 where p is not cached: any real block), kept [S, L] (p < start); L = the longest
    sequence after the step (its table holds that many positions)."""
    positions = np.arange(int((step.starts + step.counts).max()))
    kept = positions[None, :] < step.starts[:, None]                                 # [S, L]
    blocks = np.where(kept, step.tables[:, positions // step.block_size], 0)          # [S, L]
    return blocks, positions % step.block_size, kept


def gather(ops, pool, blocks, offsets, kept):
    """pool [blocks, Hkv, bs, hd] and gather_index's arrays on the device -> [S, Hkv, L, hd] contiguous, the pool's
    dtype (zero bits are zero in float32, float16 and bfloat16 alike):
    the kept positions, zeros elsewhere. Zeros, not whatever the pool holds there (another sequence's stale rows,
    the blocks of no sequence): the CuPy decode fallback masks scores, and a masked NaN row would still poison
    its output (0 * NaN)."""
    cp = ops.xp
    rows = pool[blocks, :, offsets]                                                  # [S, L, Hkv, hd]
    rows = cp.where(kept[:, :, None, None], rows, rows.dtype.type(0))
    return cp.ascontiguousarray(rows.transpose(0, 2, 1, 3))                          # [S, Hkv, L, hd]


def uploaded(ops, step: StepLayout, name: str, make):
    """make() -> a host array (or a tuple of them), on the device once per step (paged_attention.step_memo)."""
    def upload():
        made = make()
        return tuple(map(ops.xp.asarray, made)) if isinstance(made, tuple) else ops.xp.asarray(made)
    return step_memo(ops, step, ("device", name), upload)
