"""The decode attention kernels' launch, shared by the float32 cache (cupy_attention.py) and the quantized one
(cupy_kv.py): one pass, or flash-decoding (see cupy_attention.py's docstring and decode_attention_core.cuh).

Shape legend: S=sequences, H=query heads, Hkv=KV heads, hd=head dim, C=chunks of each context.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
_i32, _i64 = np.int32, np.int64                          # kernel argument types

DECODE = {"NWARPS": 4, "MAX_HEAD_DIM": 128, "MAX_GROUP": 8}     # the decode kernels' bounds (and cupy_kv's)
SPLIT_BLOCKS_PER_SM = 2       # flash-decoding aims at this many blocks per SM
SPLIT_MIN_POSITIONS = 16      # positions per chunk at least, on average (4 per warp): the combine must pay off
SPLIT_MAX = 64                # chunks per (sequence, KV head) at most (workspace S H C (2 + hd) float32)


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


def launch_decode(ops, single, split, shape: tuple, positions: int, args):
    """Run one of the decode attention kernel pairs (decode_attention.cu, decode_attention_quant.cu) -> out
    [S, H*hd] float32. shape = (S, H, Hkv, hd); `positions`: the positions read (the longest sequence, or a
    graph's KV bucket); args(target, ldo) -> the launch arguments with `target` the output (ldo its row stride,
    a 1-tuple) or the flash-decoding workspace (ldo ()). One pass: `single` on grid (Hkv, S). Flash-decoding
    (decode_splits > 1): `split` on grid (Hkv, S, C) writes each chunk's partial into part [S, H, C, 2 + hd],
    then decode_attention_combine merges them in order. Reads no host value (graph-capturable)."""
    cp = ops.xp
    S, heads, kv_heads, hd = shape
    out = cp.empty((S, heads * hd), dtype=F32)
    block = (32, DECODE["NWARPS"])
    chunks = decode_splits(kv_heads * S, positions, sm_count(ops))
    if chunks == 1:
        single((kv_heads, S), block, args(out, (_i64(heads * hd),)))
        return out
    part = cp.empty((S, heads, chunks, 2 + hd), dtype=F32)                        # m, l, acc[hd] per chunk
    split((kv_heads, S, chunks), block, args(part, ()))
    combine = ops._kernel("decode_attention", "decode_attention_combine", **DECODE)
    combine((-(-heads * hd // (32 * DECODE["NWARPS"])), S), block,
            (part, out, _i32(heads), _i32(hd), _i32(chunks), _i64(heads * hd)))
    return out
