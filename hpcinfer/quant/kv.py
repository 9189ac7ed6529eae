"""Quantized KV cache rows: FlexGen's group-wise asymmetric compression of the cache (`[model] kv_cache`).

A cached row is the head_dim vector of one (sequence, KV head, position). It is cut into groups of `group`
consecutive values along head_dim; each group keeps a scale and a minimum (float16) and its values as integers
q in [0, 2^bits - 1], x ~= scale * q + min. int4: two values per byte, LOW NIBBLE FIRST (element 2j in bits 0-3
of byte j, as quant/formats.pack4); int8: one value per byte (asymmetric 8-bit, same grouping).

Float16 scale and min (FlexGen's choice, half the bytes of float32: at head_dim 64 and group 64, an int4 row is
32 bytes of values + 4 of scale/min). To keep the half-step bound exact despite the fp16 rounding, the minimum is
rounded DOWN to float16 and the scale UP, and q is computed from those rounded values: every value then lies on
the grid's span and |x - dequantize(x)| <= scale / 2 (plus float32 rounding of the multiply-add).

Shape legend: ... = leading axes (N slots, Hkv heads, L positions), hd=head dim, G=groups per row (hd / g),
g=group, B=bytes of values per row (hd / 2 for int4, hd for int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import QuantError

F32, F16 = np.float32, np.float16
KV_MODES = ("none", "int8", "int4")
DEFAULT_KV_GROUP = 64
_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class KVFormat:
    """How one layer's K and V rows are stored. Build it with `kv_format` (which checks the group)."""

    mode: str                    # "int8" | "int4"
    group: int                   # values per (scale, min) pair along head_dim

    @property
    def bits(self) -> int:
        return _BITS[self.mode]

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one cached row: packed values + fp16 scale and min per group."""
        return head_dim * self.bits // 8 + 2 * 2 * (head_dim // self.group)


def kv_format(mode: str, group: int, head_dim: int) -> KVFormat | None:
    """`[model] kv_cache` and `kv_cache_group` for a model of this head_dim -> KVFormat (None for "none").
    The group is clamped to head_dim (a group of 64 on heads of 32 is one group per row) and must divide it."""
    if mode not in KV_MODES:
        raise QuantError(f"unknown KV cache mode {mode!r}; choose one of {', '.join(KV_MODES)}")
    if mode == "none":
        return None
    if group < 1:
        raise QuantError(f"KV cache group {group} must be >= 1")
    g = min(group, head_dim)
    if head_dim % g:
        raise QuantError(f"KV cache group {g} does not divide head_dim {head_dim}")
    if _BITS[mode] == 4 and g % 2:
        raise QuantError(f"KV cache group {g} must be even for int4 (two values per byte)")
    return KVFormat(mode, g)


def _f16_down(x: np.ndarray) -> np.ndarray:
    """Largest float16 <= x (x float32)."""
    h = x.astype(F16)
    return np.where(h.astype(F32) > x, np.nextafter(h, F16(-np.inf)), h)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """Smallest float16 >= x (x float32, >= 0)."""
    h = x.astype(F16)
    return np.where(h.astype(F32) < x, np.nextafter(h, F16(np.inf)), h)


def quantize_rows(x, fmt: KVFormat):
    """x [..., hd] float -> (q uint8 [..., B], scale float16 [..., G], min float16 [..., G])."""
    x = np.asarray(x, dtype=F32)
    *lead, hd = x.shape
    groups = x.reshape(*lead, hd // fmt.group, fmt.group)                       # [..., G, g]
    top = (1 << fmt.bits) - 1
    with np.errstate(over="ignore", invalid="ignore"):                           # checked just below
        low = _f16_down(groups.min(axis=-1))                                     # [..., G] fp16
        scale = _f16_up((groups.max(axis=-1) - low.astype(F32)) / F32(top))      # [..., G] fp16
    if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(low))):
        raise QuantError("KV cache values exceed the float16 range of the quantized cache's scale and minimum")
    s32 = scale.astype(F32)[..., None]
    safe = np.where(s32 > 0, s32, F32(1))
    q = np.clip(np.rint((groups - low.astype(F32)[..., None]) / safe), 0, top).astype(np.uint8)
    q = q.reshape(*lead, hd)
    if fmt.bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)                                  # [..., hd / 2], low nibble first
    return q, scale, low


def dequantize_rows(q, scale, low, fmt: KVFormat, out=None, scratch=None):
    """Inverse of quantize_rows: (q [..., B], scale, min [..., G]) -> float32 [..., hd], into `out` when given.
    `scratch`: a uint8 [..., hd] buffer for the unpacked nibbles (int4)."""
    *lead, nbytes = q.shape
    hd = nbytes * 8 // fmt.bits
    if out is None:
        out = np.empty((*lead, hd), dtype=F32)
    if fmt.bits == 4:
        values = np.empty((*lead, hd), dtype=np.uint8) if scratch is None else scratch
        np.bitwise_and(q, 0x0F, out=values[..., 0::2])
        np.right_shift(q, 4, out=values[..., 1::2])
    else:
        values = q
    G = hd // fmt.group
    out_g = out.reshape(*lead, G, fmt.group)                                     # [..., G, g] (a view)
    if not np.may_share_memory(out_g, out):
        raise ValueError("dequantize_rows: `out` must have a contiguous last axis")
    np.multiply(values.reshape(*lead, G, fmt.group), scale.astype(F32)[..., None], out=out_g)
    out_g += low.astype(F32)[..., None]
    return out


NO_SCALES = np.zeros((0, 0, 0, 0), dtype=np.uint16)     # a float store's (absent) scale and min, for the kernels


class FloatKV:
    """Float KV rows (the array a store holds: float32, or a half dtype on the GPU) through the interface of
    QuantizedKV, so that attention reads either kind alike (`kv_rows`). A view: nothing is copied.

    The interface, both kinds: quantized, exact (the store holds a row as given, so a step's new rows may be stored
    before they are read back; a quantized store would round them: they are attended as given, stored after),
    group (values per scale), bits (per value), shape, nbytes, parts() (the stored arrays), map(fn) (the rows with
    fn applied to each stored array: a slot taken, a view reshaped, moved to host or device; a float array stays a
    plain array), read(index, out, scratch) (float rows at index: a view of a float store where index is basic and
    no `out` is given), kernel_arrays() (values, scales, mins as the compiled kernels read them), encoded(fmt)
    (these rows as a store of format fmt holds them)."""

    quantized, exact, group, bits = False, True, 1, 32

    def __init__(self, array):
        self.array = array

    @property
    def shape(self) -> tuple:
        return self.array.shape

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def parts(self) -> tuple:
        return (self.array,)

    def map(self, fn):
        return fn(self.array)

    def read(self, index, out=None, scratch=None):
        if out is None:
            return self.array[index]
        out[...] = self.array[index]
        return out

    def kernel_arrays(self) -> tuple:
        return self.array, NO_SCALES, NO_SCALES

    def encoded(self, fmt: KVFormat) -> tuple:
        return quantize_rows(self.array, fmt)


class QuantizedKV:
    """One layer's K (or V) cache, logically float [N, Hkv, Lmax, hd], held as q [N, Hkv, Lmax, B] uint8 and
    scale, min [N, Hkv, Lmax, G] float16. Indexing the leading axes works as on the float array it replaces; the
    rest of the interface is FloatKV's."""

    quantized, exact = True, False

    def __init__(self, fmt: KVFormat, q, scale, low):
        self.fmt, self.q, self.scale, self.min = fmt, q, scale, low

    @classmethod
    def zeros(cls, ops, fmt: KVFormat, shape: tuple) -> "QuantizedKV":
        n, heads, length, hd = shape
        return cls(fmt, ops.zeros((n, heads, length, hd * fmt.bits // 8), np.uint8),
                   ops.zeros((n, heads, length, hd // fmt.group), F16),
                   ops.zeros((n, heads, length, hd // fmt.group), F16))

    @property
    def shape(self) -> tuple:
        """The float cache's shape [N, Hkv, Lmax, hd]."""
        return (*self.q.shape[:3], self.q.shape[3] * 8 // self.fmt.bits)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes + self.min.nbytes)

    @property
    def group(self) -> int:
        return self.fmt.group

    @property
    def bits(self) -> int:
        return self.fmt.bits

    def parts(self) -> tuple:
        return self.q, self.scale, self.min

    def kernel_arrays(self) -> tuple:
        """q, and scale and min as their float16 bits (uint16: what the compiled kernels read)."""
        return self.q, self.scale.view(np.uint16), self.min.view(np.uint16)

    def encoded(self, fmt: KVFormat) -> tuple:
        if fmt != self.fmt:
            raise QuantError(f"KV rows of format {self.fmt} cannot be stored as {fmt}")
        return self.parts()

    def map(self, fn) -> "QuantizedKV":
        """The same cache with fn applied to each stored array (a slot taken, moved to host or device)."""
        return QuantizedKV(self.fmt, *(fn(a) for a in self.parts()))

    def __getitem__(self, index) -> "QuantizedKV":
        """Rows of the leading axes (e.g. [slot], [slots, :, :L]), still quantized."""
        return self.map(lambda a: a[index])

    def __setitem__(self, index, value) -> None:
        """Store float rows value [..., hd] (quantizing them) or another QuantizedKV's arrays at index."""
        for dst, src in zip(self.parts(), kv_rows(value).encoded(self.fmt)):
            dst[index] = src

    def read(self, index, out=None, scratch=None):
        """Dequantize the rows at index -> float32 [..., hd] (into `out` when given)."""
        return dequantize_rows(self.q[index], self.scale[index], self.min[index], self.fmt, out, scratch)


def kv_rows(rows) -> FloatKV | QuantizedKV:
    """KV rows as they are stored, through the one interface of both kinds: a QuantizedKV as it is, a float array
    (or float rows to store) as a FloatKV view."""
    return rows if isinstance(rows, QuantizedKV) else FloatKV(rows)


def kv_bytes_per_token(kv_heads: int, head_dim: int, layers: int, kv_format: KVFormat | None = None) -> int:
    row = head_dim * np.dtype(np.float32).itemsize if kv_format is None else kv_format.row_bytes(head_dim)
    return 2 * kv_heads * row * layers
