"""The decode attention kernels' launch, shared by the float cache (cupy_attention.py), the paged pool
(cupy_paged.py) and the quantized cache (cupy_kv.py): one kernel, grid (Hkv, S, C), that splits each context into C
chunks and combines them in the same launch (the last block of a (sequence, KV head) merges its chunks in order:
decode_attention_core.cuh). C is 1 (no workspace) when the S Hkv blocks already fill the device.

Each module is compiled for the exact head dim and GQA group (HEAD_DIM, GROUP: registers and loops sized to them),
a model has one of each. The counters of the single-launch combine ([S Hkv] int32, zero at launch, left zero by the
kernel) are kept by the ops per size and never freed, so a CUDA graph that captured their address stays valid.

Shape legend: S=sequences, H=query heads, Hkv=KV heads, g=H/Hkv, hd=head dim, C=chunks of each context.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
_i32, _i64, _f32c = np.int32, np.int64, np.float32      # kernel argument types
NULL = np.uint64(0)                                      # a pointer argument the kernel does not read

NWARPS = 4                    # warps per block of every decode kernel
MAX_GROUP = 8                 # GQA groups the kernels take (query heads per KV head): registers beyond this
MAX_HEAD_DIM = 256
SHARED_BYTES = 48 * 1024      # static shared memory: decode_attention_core.cuh's assert
SPLIT_BLOCKS_PER_SM = 2       # flash-decoding aims at this many blocks per SM
SPLIT_MIN_POSITIONS = 16      # positions per chunk at least, on average: the combine must pay off
SPLIT_MAX = 64                # chunks per (sequence, KV head) at most (workspace S H C (2 + hd) float32)


def decode_fits(heads: int, kv_heads: int, hd: int) -> bool:
    """The decode kernels take this shape: whole GQA groups of at most MAX_GROUP, hd <= MAX_HEAD_DIM, and the
    block's shared memory (the group's queries and the warps' partials) within SHARED_BYTES."""
    if kv_heads <= 0 or heads % kv_heads or hd > MAX_HEAD_DIM:
        return False
    g = heads // kv_heads
    return g <= MAX_GROUP and 4 * (g * hd * (NWARPS + 1) + 2 * NWARPS * g + 2 * hd) <= SHARED_BYTES


def decode_defines(heads: int, kv_heads: int, hd: int, **extra) -> dict:
    """The #defines of a decode kernel module for this shape (plus T_STORAGE, KV_BITS ... in `extra`)."""
    return {"NWARPS": NWARPS, "HEAD_DIM": hd, "GROUP": heads // kv_heads, **extra}


def decode_splits(blocks: int, positions: int, sm_count: int) -> int:
    """Chunks C of each (sequence, KV head)'s context: 1 (one pass) when the `blocks` = S Hkv blocks already give
    SPLIT_BLOCKS_PER_SM per SM or the context is short, else enough for that grid, each chunk keeping about
    SPLIT_MIN_POSITIONS of the `positions` read. Only values fixed for a CUDA graph's key go in (S, Hkv, the key's
    KV bucket, the device): the captured grid then stays valid at every replay, the kernels cutting each
    sequence's own length into the C chunks on the device. sm_count 0 (unknown): one pass."""
    if sm_count <= 0:
        return 1
    wanted = -(-SPLIT_BLOCKS_PER_SM * sm_count // blocks)
    return max(1, min(wanted, positions // SPLIT_MIN_POSITIONS, SPLIT_MAX))


def sm_count(ops) -> int:
    """The device's SM count (cached on the ops as CupyOps._grid does); 0 when the ops' xp has no device (the
    tests' NumPy stand-ins, which set `_sm_count` to choose)."""
    if getattr(ops, "_sm_count", None) is None:
        try:
            ops._sm_count = ops.xp.cuda.Device().attributes["MultiProcessorCount"]
        except AttributeError:                                  # numpy as xp: no device
            return 0
    return ops._sm_count


def counters(ops, n: int):
    """[>= n] int32 zeros on the device for the single-launch combine: one array per power-of-two size, kept by
    the ops for their lifetime (a captured graph holds its address; every launch leaves it zero)."""
    size = 1 << max(0, (n - 1).bit_length())
    store = ops.__dict__.setdefault("_decode_counters", {})
    if size not in store:
        store[size] = ops.xp.zeros(size, dtype=np.int32)
    return store[size]


def rope_args(ops, rope) -> tuple:
    """(cos, sin, rotary_dim) kernel arguments: rope = (cos [S, rd/2], sin [S, rd/2], rotary_dim) float32 rows of
    each decode token's position, or None (no rotation: null pointers, 0)."""
    if rope is None:
        return NULL, NULL, _i32(0)
    cos, sin, rotary_dim = rope
    cp = ops.xp
    return (cp.ascontiguousarray(cos, dtype=F32), cp.ascontiguousarray(sin, dtype=F32), _i32(rotary_dim))


def rotated(ops, q, k, rope):
    """(q, k) rotated by ops.rotary when rope = (cos, sin, rotary_dim) is given (the paths that do not fuse it)."""
    if rope is None:
        return q, k
    return ops.rotary(q, *rope), ops.rotary(k, *rope)


def launch_decode(ops, kernel, shape: tuple, positions: int, args):
    """Run a decode attention kernel (decode_attention, paged_decode_attention, decode_attention_quant) -> out
    [S, H*hd] float32. shape = (S, H, Hkv, hd); `positions`: the positions read (the longest sequence, or a graph's
    KV bucket) for the chunk count; args(out, part, counters, ldo) -> the launch arguments. C = decode_splits > 1:
    a workspace part [S, H, C, 2 + hd] and the counters; else both null. Reads no host value (graph-capturable)."""
    cp = ops.xp
    S, heads, kv_heads, hd = shape
    out = cp.empty((S, heads * hd), dtype=F32)
    chunks = decode_splits(kv_heads * S, positions, sm_count(ops))
    if chunks == 1:
        part, done = NULL, NULL
    else:
        part = cp.empty((S, heads, chunks, 2 + hd), dtype=F32)                    # m, l, acc[hd] per chunk
        done = counters(ops, S * kv_heads)
    kernel((kv_heads, S, chunks), (32, NWARPS), args(out, part, done, _i64(heads * hd)))
    return out
