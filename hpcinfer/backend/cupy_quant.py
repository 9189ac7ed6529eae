"""Quantized weights on the CuPy backend: their device form, and linear_q / embedding_q without a float copy.

A QuantizedTensor (quant/formats.py) reaches the device once, through `to_device` (CupyOps.prepare_quantized, called
by the sharded layers at load), as a DeviceQuantizedTensor: its bytes re-laid in the quant layout that the kernels
read coalesced (kernels/layout.py quant_pack, cuda_src/quant_core.cuh), scales and minimums transposed to [G, out].
Then
- linear_q, 2 <= T <= 64: cuda_src/tc_quant_gemm.cu (tensor cores, backend/cupy_tc_gemm.py) reads the bytes and
  dequantizes in registers;
- linear_q, T = 1 (and formats tc_quant_gemm does not read, up to GEMV_MAX_TOKENS): cuda_src/quant_gemv.cu reads
  the int8 / int4 bytes and dequantizes in registers;
- linear_q, larger T: cuda_src/quant_dequant.cu dequantizes `tile_rows` output rows at a time into one reused
  float32 tile, multiplied by cuBLAS right away (never the whole weight in float, as NumpyOps.linear_q);
- embedding_q: quant_dequant gathers only the ids' rows.
With kernels off (CupyOps(kernels=False)), or a group size the kernels do not take (not a multiple of the 16 / 32
elements of a 16-byte vector), the same tiles are dequantized by plain CuPy array code (`dequantize_rows`).

The wrappers check layout and dtype and compute the launch, nothing else. cupy itself is never imported here: every
array op goes through `ops.xp`.

Shape legend: T=tokens, O=output rows, I=input columns, B=bytes per row (I, or I / 2 at 4 bits), KV=ceil(B / 16)
vectors per row, G=groups per row, R=rows of a tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.layout import quant_pack
from . import cupy_tc_gemm

F32 = np.float32
GEMV_MAX_TOKENS = 16                      # linear_q: tokens up to which quant_gemv runs (its MAX_TOKENS buckets)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)          # MAX_TOKENS of the compiled variants (fewer registers for fewer tokens)
WARPS, ROWS, UNROLL = 4, 1, 4             # quant_gemv tiling: block (32, WARPS), 32 * ROWS output rows per block
DEQUANT_BLOCK = 256
TILE_BYTES = 64 << 20                     # the float32 tile of the large-batch path (as NumpyOps' 4096 x 4096)
_i32, _i64 = np.int32, np.int64


@dataclass
class DeviceQuantizedTensor:
    """A QuantizedTensor [O, I] on the device, in the kernels' layout (quant_core.cuh)."""

    mode: str
    bits: int
    signed: bool                  # q holds int8 values (symmetric modes int8, q8_0), else unsigned ones
    group_size: int
    shape: tuple[int, int]        # (O, I)
    q: object                     # [KV, O, 16] uint8: the bytes (the kernels read `unsigned char`)
    scale: object                 # [G, O] float32
    min: object | None            # [G, O] float32; None when symmetric

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes + (0 if self.min is None else self.min.nbytes))

    @property
    def groups(self) -> int:
        return self.scale.shape[0]

    @property
    def qvec(self) -> int:
        """Input elements per 16-byte vector: 16 at 8 bits, 32 at 4 bits."""
        return 128 // self.bits

    def defines(self) -> dict | None:
        """The quant_core.cuh defines of this format, or None when the kernels cannot read it (a group size that
        is not a multiple of the vector's elements: a vector would straddle two groups)."""
        group = 0 if self.groups == 1 else self.group_size
        if group % self.qvec:
            return None
        return {"QBITS": self.bits, "QSIGNED": int(self.signed), "HAS_MIN": int(self.min is not None),
                "GROUP": group}


def to_device(qt, xp) -> DeviceQuantizedTensor:
    """QuantizedTensor (host arrays) -> DeviceQuantizedTensor on the current device: re-laid on the host, then one
    upload of each array. A DeviceQuantizedTensor is returned as it is."""
    if isinstance(qt, DeviceQuantizedTensor):
        return qt
    qp, scale, minimum = quant_pack(np.asarray(qt.q), np.asarray(qt.scale),
                                    None if qt.min is None else np.asarray(qt.min))
    return DeviceQuantizedTensor(qt.mode, qt.bits, bool(qp.dtype == np.int8), qt.group_size, tuple(qt.shape),
                                 xp.asarray(qp.view(np.uint8)),
                                 xp.asarray(scale), None if minimum is None else xp.asarray(minimum))


# ---- the ops ---------------------------------------------------------------------------------------------------
def linear_q(ops, x, qt, bias=None):
    """x [T, I] @ W[O, I].T (+ bias [O]) -> [T, O] float32 for a quantized W (device form, or a host
    QuantizedTensor uploaded for this call)."""
    cp = ops.xp
    dq = to_device(qt, cp)
    out, n_in = dq.shape
    x = ops._f32(x)
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"linear_q: x {tuple(x.shape)} does not match the weight's [out, in] {dq.shape}")
    if bias is not None:
        bias = cp.ascontiguousarray(bias, dtype=F32)
    T = x.shape[0]
    if T == 0:
        return cp.zeros((0, out), dtype=F32)
    y = tensor_core_linear(ops, x, dq, bias)
    if y is None and T <= GEMV_MAX_TOKENS:
        y = gemv(ops, x, dq, bias)
    return y if y is not None else tiled_linear(ops, x, dq, bias)


def embedding_q(ops, qt, ids):
    """Rows `ids` [T] (host or device ints) of a quantized table [V, D] -> [T, D] float32."""
    cp = ops.xp
    dq = to_device(qt, cp)
    ids = cp.ascontiguousarray(cp.asarray(ids, dtype=np.int64)).reshape(-1)
    out = cp.empty((ids.shape[0], dq.shape[1]), dtype=F32)
    if ids.shape[0]:
        dequantize_rows(ops, dq, out, ids)
    return out


# ---- launch wrappers -------------------------------------------------------------------------------------------
def gemv(ops, x, dq: DeviceQuantizedTensor, bias, splits: int | None = None):
    """quant_gemv for 1 <= T <= GEMV_MAX_TOKENS -> y [T, O] float32, or None when the kernel cannot run (kernels
    off, a format it does not read). `splits`: blocks along the input (default: enough blocks for the device)."""
    defines = dq.defines()
    T = x.shape[0]
    if defines is None or not 1 <= T <= GEMV_MAX_TOKENS:
        return None
    cp = ops.xp
    out, n_in = dq.shape
    x, ldx = ops._rows(x)
    x_vec = _address(x) % 16 == 0 and (ldx * 4) % 16 == 0
    common = {**defines, "MAX_TOKENS": next(b for b in TOKEN_BUCKETS if b >= T), "WARPS": WARPS, "ROWS": ROWS,
              "UNROLL": UNROLL, "HAS_BIAS": int(bias is not None)}
    fn = ops._kernel("quant_gemv", "quant_gemv", **common, X_VEC=int(x_vec))
    if fn is None:
        return None
    kvecs = dq.q.shape[0]
    blocks = -(-out // (32 * ROWS))
    if splits is None:
        splits = _splits(ops, blocks, kvecs)
    y = cp.empty((T, out), dtype=F32)
    partial = cp.empty((splits, T, out), dtype=F32) if splits > 1 else y     # y: never read when splits == 1
    unused = dq.scale                                                          # a valid pointer the kernel ignores
    fn((blocks, splits), (32, WARPS),
       (x, dq.q, dq.scale, unused if dq.min is None else dq.min, unused if bias is None else bias, y, partial,
        _i32(T), _i32(n_in), _i32(out), _i64(ldx), _i64(out)))
    if splits > 1:
        reduce = ops._kernel("quant_gemv", "quant_gemv_reduce", **common, X_VEC=int(x_vec))
        reduce((-(-T * out // 256),), (256,),
               (partial, unused if bias is None else bias, y, _i32(T), _i32(out), _i32(splits), _i64(out)))
    return y


def tensor_core_linear(ops, x, dq: DeviceQuantizedTensor, bias, *, tile=None, splits=None):
    """tc_quant_gemm (backend/cupy_tc_gemm.py) for 2 <= T <= 64 -> y [T, O] float32, or None where it does not apply
    (kernels off, T outside 2 .. 64, a format the kernels do not read, in % 16). The mma multiplies the integer q
    exactly; scales and minimums are applied per group in float32."""
    defines = dq.defines()
    if not ops.kernels or defines is None or cupy_tc_gemm.token_bucket(x.shape[0]) is None:
        return None
    if bias is not None and not (bias.dtype == F32 and bias.shape == (dq.shape[0],)):
        return None
    weights = (dq.q, dq.scale, dq.scale if dq.min is None else dq.min)
    return cupy_tc_gemm.launch(ops, x, None, "__half", dq.shape, bias, None, None, False, None,
                               name="tc_quant_gemm", extra=defines, weight_args=weights, tile=tile, splits=splits)


def tiled_linear(ops, x, dq: DeviceQuantizedTensor, bias, tile_rows: int | None = None):
    """The large-batch linear_q: `tile_rows` output rows at a time dequantized into one reused float32 tile, each
    multiplied by cuBLAS right away -> [T, O] float32."""
    cp = ops.xp
    out, n_in = dq.shape
    R = min(out, tile_rows or max(32, TILE_BYTES // (4 * n_in)))
    buffer = _tile_buffer(ops, (R, n_in))
    y = cp.empty((x.shape[0], out), dtype=F32)
    for start in range(0, out, R):
        stop = min(start + R, out)
        tile = buffer[:stop - start]
        dequantize_rows(ops, dq, tile, cp.arange(start, stop, dtype=np.int64))
        y[:, start:stop] = ops.matmul(x, tile.T)
    if bias is not None:
        y += bias
    return y


def dequantize_rows(ops, dq: DeviceQuantizedTensor, tile, rows) -> None:
    """tile [R, I] float32 (rows contiguous) <- the dequantized rows `rows` [R] (device int64) of W: quant_dequant,
    or plain CuPy array code when the kernel cannot run."""
    defines = dq.defines()
    fn = None if defines is None else ops._kernel("quant_dequant", "quant_dequant", **defines, BLOCK=DEQUANT_BLOCK)
    R, n_in = tile.shape
    if fn is None or tile.dtype != F32 or tile.strides[1] != 4:
        tile[...] = dequantize_array(ops.xp, dq, rows)
        return
    out = dq.shape[0]
    work = R * dq.q.shape[0]
    fn((ops._grid(work, DEQUANT_BLOCK),), (DEQUANT_BLOCK,),
       (dq.q, dq.scale, dq.scale if dq.min is None else dq.min, rows, tile, _i32(R), _i32(0), _i32(n_in),
        _i32(out), _i64(tile.strides[0] // 4)))


def dequantize_array(cp, dq: DeviceQuantizedTensor, rows):
    """The plain-CuPy twin of quant_dequant: rows [R] (device int64 or a slice) of W -> [R, I] float32."""
    out, n_in = dq.shape
    raw = cp.ascontiguousarray(dq.q[:, rows, :].transpose(1, 0, 2))            # [R, KV, 16]
    R = raw.shape[0]
    raw = raw.reshape(R, -1)                                                   # [R, KV * 16] bytes
    if dq.bits == 4:
        values = cp.empty((R, 2 * raw.shape[1]), dtype=np.uint8)
        values[:, 0::2] = raw & 0x0F
        values[:, 1::2] = raw >> 4
    else:
        values = raw.view(np.int8) if dq.signed else raw
    w = values[:, :n_in].astype(F32)                                           # [R, I]
    g = n_in if dq.groups == 1 else dq.group_size
    w3 = w.reshape(R, n_in // g, g)                                            # [R, G, g]
    w3 *= dq.scale[:, rows].T[..., None]
    if dq.min is not None:
        w3 += dq.min[:, rows].T[..., None]
    return w


# ---- helpers ---------------------------------------------------------------------------------------------------
def _splits(ops, blocks: int, kvecs: int) -> int:
    """Blocks along the input so that the grid fills about two blocks per SM, each split keeping at least two
    rounds of its warps' loads (WARPS * UNROLL * 2 vectors)."""
    sms = _sm_count(ops)
    want = -(-2 * sms // blocks)
    return max(1, min(want, kvecs // (WARPS * UNROLL * 2), 32))


def _sm_count(ops) -> int:
    if getattr(ops, "_sm_count", None) is None:
        try:
            ops._sm_count = ops.xp.cuda.Device().attributes["MultiProcessorCount"]
        except Exception:   # noqa: BLE001 - no device attributes (a fake device in tests): one SM
            return 1
    return ops._sm_count


def _address(a) -> int:
    """The device (or host, for a test double) address of an array's first element."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    return int(ptr) if ptr is not None else int(a.__array_interface__["data"][0])


def _tile_buffer(ops, shape):
    """One float32 tile per shape, kept by the Ops object and reused by every call (the only float copy)."""
    cache = ops.__dict__.setdefault("_quant_tiles", {})
    if shape not in cache:
        cache[shape] = ops.xp.empty(shape, dtype=F32)
    return cache[shape]
