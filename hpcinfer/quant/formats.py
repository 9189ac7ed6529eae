"""Weight quantization formats: quantize, dequantize and slice a weight matrix held in compute layout [out, in].

Every format is one rule, x = scale * q + min, applied per group of `group_size` consecutive elements along the
INPUT dimension of one output row (FlexGen's group-wise compression; DeepSpeed's per-channel INT8 is the case
group_size = in). Groups never cross an output row, so any block of output rows (a column-parallel tp shard, a
vocabulary shard) is a block of rows of q, scale and min; a block of input columns (a row-parallel tp shard) is one
when its edges fall on group edges (`slice_cols` checks).

Modes (bits, symmetric, group):
    int8   8 bits, symmetric, one group per output row: q int8 in [-127, 127], scale = max|w| / 127, no min
    int4   4 bits, asymmetric, groups of group_size (default 64): q in [0, 15], scale = (max - min) / 15
    asym8  8 bits, asymmetric, groups of group_size: q uint8 in [0, 255], scale = (max - min) / 255
    q4_1   GGUF Q4_1 kept as it is: int4 with groups of 32 (fp16 scale d and minimum m, x = d * q + m)
    q8_0   GGUF Q8_0 kept as it is: 8-bit symmetric with groups of 32 (fp16 scale d, x = d * q)

Packing (4 bits): two values per byte along the input dimension, LOW NIBBLE FIRST: byte j of a row holds element
2j in bits 0-3 and element 2j+1 in bits 4-7, so q [out, in / 2] uint8. (GGUF's own Q4_1 blocks put element j and
j + 16 in one byte; `from_gguf_q4_1` repacks to ours, keeping every value.)
Scales and minimums are float32 [out, in / group_size] (GGUF's fp16 ones convert exactly).

Source grids: weights that come block-quantized (a GGUF's Q4_0 / Q4_1 / Q8_0 ... tensors, or a checkpoint that
keeps them) already sit on a grid of `block` consecutive input elements. Re-quantizing them in groups that straddle
those blocks rounds every weight a second time onto a grid that does not match (SmolLM2's Q4_1 GGUF, int4 on the
layers: g64 1.26x float32 perplexity, g32 1.00x), so a group size left unset follows the source (`grid_group`),
a tensor already at the target's bits keeps its blocks (`keeps_blocks`), and a group that does not divide into the
blocks is a warning (`off_grid_warning`).

Shape legend: O=output rows, I=input columns, G=groups per row (I / group_size), g=group_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

F32 = np.float32
MODES = ("int8", "int4", "asym8", "q4_1", "q8_0")
LOAD_MODES = ("none", "int8", "int4", "asym8")               # what `[model] quantize` and `convert --quantize` take
GROUPED_MODES = ("int4", "asym8")                             # load modes whose group size is configurable
DEFAULT_GROUP = 64                                            # a group size left unset, on a source with no grid
EMBEDDINGS = ("int8", "same")          # int4's token embedding / LM head: at 8 bits, or int4 like the other matrices
DEFAULT_EMBEDDING = "int8"
_SPEC = {"int8": (8, True), "int4": (4, False), "asym8": (8, False), "q4_1": (4, False), "q8_0": (8, True)}


class QuantError(ValueError):
    """A group size or mode that cannot quantize this tensor (callers turn it into a Config/CheckpointError)."""


@dataclass
class QuantizedTensor:
    """A weight in compute layout [out, in]: x[o, i] = scale[o, i // g] * q_value[o, i] + min[o, i // g]."""

    mode: str
    q: np.ndarray                  # int8 [O, I] (symmetric) | uint8 [O, I] (asym8) | uint8 [O, I / 2] (4 bits)
    scale: np.ndarray              # float32 [O, G]
    min: np.ndarray | None         # float32 [O, G]; None when symmetric
    group_size: int

    @property
    def bits(self) -> int:
        return _SPEC[self.mode][0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.min is None else self.min.nbytes)

    def arrays(self) -> dict[str, np.ndarray]:
        """The named arrays stored in a checkpoint (`name.q`, `name.scale`, `name.min`)."""
        out = {"q": self.q, "scale": self.scale}
        if self.min is not None:
            out["min"] = self.min
        return out


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise QuantError(f"unknown quantization mode {mode!r}; choose one of {', '.join(MODES)}")


def spec(mode: str) -> tuple[int, bool]:
    """(bits per value, symmetric) of a mode."""
    check_mode(mode)
    return _SPEC[mode]


def group_for(mode: str, in_size: int, group_size: int) -> int:
    """The group size a mode uses on rows of `in_size` elements (int8: the whole row; GGUF modes: 32)."""
    check_mode(mode)
    if mode == "int8":
        return in_size
    g = 32 if mode in ("q4_1", "q8_0") else group_size
    if g <= 0 or in_size % g:
        raise QuantError(f"group size {g} does not divide the input dimension {in_size}")
    if _SPEC[mode][0] == 4 and g % 2:
        raise QuantError(f"group size {g} must be even for 4-bit packing")
    return g


class SourceGrid(NamedTuple):
    """The block grid a tensor's values already sit on: `kind` (a GGUF type such as "Q4_1", or a stored mode such as
    "q4_1"), the block length along the input dimension and the bits per value."""
    kind: str
    block: int
    bits: int


# GGUF block types -> (elements per block that share one scale / min, bits per value). K-quants: the sub-block.
GGUF_GRIDS = {"Q4_0": (32, 4), "Q4_1": (32, 4), "Q5_0": (32, 5), "Q5_1": (32, 5), "Q8_0": (32, 8),
              "Q2_K": (16, 2), "Q3_K": (16, 3), "Q4_K": (32, 4), "Q5_K": (32, 5), "Q6_K": (16, 6)}
STORED_GRIDS = {"q4_1": (32, 4), "q8_0": (32, 8)}           # modes that keep a GGUF's blocks as they are

# What re-rounding off the source's grid cost where we measured it (docs/quantization.md, perplexity table).
OFF_GRID_COST = {"int4": "on SmolLM2's Q4_1 GGUF, int4 in groups of 64 on the layers costs 1.26x float32 "
                         "perplexity, groups of 32 nothing (1.00x)",
                 "asym8": "at 8 bits the second rounding is small (SmolLM2's Q4_1 GGUF: asym8 g64 1.003x float32 "
                          "perplexity)"}


def gguf_grid(kind: str) -> SourceGrid | None:
    """The grid of a GGUF tensor type (its name, e.g. "Q4_1"); None for float types."""
    block_bits = GGUF_GRIDS.get(kind)
    return None if block_bits is None else SourceGrid(kind, *block_bits)


def grid_group(grids) -> int | None:
    """The largest group on every grid in `grids` (SourceGrids): the gcd of their blocks; None when there is none."""
    blocks = {g.block for g in grids}
    return math.gcd(*blocks) if blocks else None


def keeps_blocks(mode: str, grid: SourceGrid | None, group_size: int | None) -> bool:
    """Whether a tensor on `grid` is kept as its blocks when quantized to `mode`: it already has the mode's bits, and
    no other group was asked for (group_size None = not given; int8 has no group to ask for)."""
    if grid is None or mode not in LOAD_MODES[1:]:
        return False
    return grid.bits == _SPEC[mode][0] and (group_size is None or mode == "int8" or group_size == grid.block)


def off_grid_warning(mode: str, group_size: int, grids, setting: str) -> str | None:
    """The warning for a group size (`setting` names where it was given) that does not divide into the source's
    blocks, so that every weight is rounded a second time on a grid that does not match; None when it does."""
    if mode not in GROUPED_MODES:
        return None
    off = sorted({f"{g.kind} blocks of {g.block}" for g in grids if g.block % group_size})
    if not off:
        return None
    fit = grid_group(grids)
    return (f"{setting} {group_size} does not divide into the source's {', '.join(off)}: {mode} rounds every weight "
            f"a second time, on a grid that does not match ({OFF_GRID_COST[mode]}); leave the group size unset "
            f"(it then follows the source) or use {fit} or a divisor of it")


def grid_note(mode: str, group_size: int, grids) -> str:
    """The log line for a group size left unset that follows the source's grid."""
    kinds = ", ".join(sorted({g.kind for g in grids}))
    return f"{mode} in groups of {group_size}, on the source's block grid ({kinds}; no group size given)"


def kept_mode(stored: str, mode: str) -> str:
    """The mode kept blocks of mode `stored` run as when `mode` is asked: a q4_1 tensor IS int4 in groups of 32
    (x = scale * q + min, unsigned 4 bits, the same packing), so it runs as int4 (no value changes, and it fuses with
    int4 parts); any other keeps its own mode."""
    return "int4" if (stored, mode) == ("q4_1", "int4") else stored


def as_mode(qt: QuantizedTensor, mode: str) -> QuantizedTensor:
    """Kept blocks relabelled as kept_mode says (the same arrays)."""
    return QuantizedTensor(kept_mode(qt.mode, mode), qt.q, qt.scale, qt.min, qt.group_size)


def quantize(w: np.ndarray, mode: str, group_size: int = DEFAULT_GROUP,
             row_absmax: np.ndarray | None = None) -> QuantizedTensor:
    """w [O, I] float -> QuantizedTensor. Round to nearest: |w - dequantize(q)| <= scale / 2 per element.
    row_absmax [O] (int8 only): the max |w| of each whole row when w is one tp shard of the row's inputs, so that
    every shard uses the scale the whole matrix would have."""
    w = np.asarray(w, dtype=F32)
    if w.ndim != 2:
        raise QuantError(f"quantize takes a matrix [out, in], got shape {w.shape}")
    rows, cols = w.shape
    g = group_for(mode, cols, group_size)
    bits, symmetric = _SPEC[mode]
    groups = w.reshape(rows, cols // g, g)                                    # [O, G, g]
    if symmetric:
        top = (1 << (bits - 1)) - 1                                           # 127
        peak = np.abs(groups).max(axis=-1) if row_absmax is None else np.asarray(row_absmax, F32)[:, None]
        scale = (peak / F32(top)).astype(F32)                                 # [O, G]
        safe = np.where(scale > 0, scale, F32(1))
        q = np.clip(np.rint(groups / safe[..., None]), -top, top).astype(np.int8).reshape(rows, cols)
        return QuantizedTensor(mode, q, scale.astype(F32), None, g)
    top = (1 << bits) - 1                                                     # 15 or 255
    low, high = groups.min(axis=-1), groups.max(axis=-1)                      # [O, G]
    scale = ((high - low) / F32(top)).astype(F32)
    safe = np.where(scale > 0, scale, F32(1))
    q = np.clip(np.rint((groups - low[..., None]) / safe[..., None]), 0, top).astype(np.uint8).reshape(rows, cols)
    return QuantizedTensor(mode, pack4(q) if bits == 4 else q, scale, low.astype(F32), g)


def pack4(q: np.ndarray) -> np.ndarray:
    """[O, I] values in [0, 15] -> [O, I / 2] bytes, element 2j in the low nibble of byte j."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack4(packed: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[O, I / 2] bytes -> [O, I] uint8 values (into `out` when given)."""
    rows, half = packed.shape
    if out is None:
        out = np.empty((rows, 2 * half), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[:, 0::2])
    np.right_shift(packed, 4, out=out[:, 1::2])
    return out


def dequantize(qt: QuantizedTensor, out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> np.ndarray:
    """-> float32 [O, I], written into `out` when given (a reused buffer). `scratch`: a uint8 [O, I] buffer for the
    unpacked 4-bit values. Arithmetic is float32 scale * q then + min, as GGUF's own dequantizer does."""
    rows, cols = qt.shape
    if out is None:
        out = np.empty((rows, cols), dtype=F32)
    q = unpack4(qt.q, scratch) if qt.bits == 4 else qt.q
    groups = cols // qt.group_size
    out3 = out.reshape(rows, groups, qt.group_size)
    np.multiply(q.reshape(rows, groups, qt.group_size), qt.scale[..., None], out=out3)
    if qt.min is not None:
        out3 += qt.min[..., None]
    return out


def slice_rows(qt: QuantizedTensor, rows: slice) -> QuantizedTensor:
    """A block of output rows (a column-parallel or vocabulary shard): always whole groups."""
    return QuantizedTensor(qt.mode, qt.q[rows], qt.scale[rows], None if qt.min is None else qt.min[rows],
                           qt.group_size)


def slice_cols(qt: QuantizedTensor, cols: slice) -> QuantizedTensor:
    """A block of input columns (a row-parallel tp shard). Its edges must fall on group edges, except for a
    per-row (int8) scale, which every column block shares whole."""
    start, stop, _ = cols.indices(qt.shape[1])
    if qt.mode == "int8":
        return QuantizedTensor(qt.mode, qt.q[:, start:stop], qt.scale, None, stop - start)
    g = qt.group_size
    if start % g or stop % g:
        raise QuantError(f"group size {g} does not divide the shard boundaries {start}:{stop} of the input "
                         f"dimension {qt.shape[1]}")
    per = 2 if qt.bits == 4 else 1
    groups = slice(start // g, stop // g)
    return QuantizedTensor(qt.mode, qt.q[:, start // per:stop // per], qt.scale[:, groups],
                           None if qt.min is None else qt.min[:, groups], g)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack the row blocks of fused parts (q, k, v or gate, up) that share a mode and group size."""
    first = parts[0]
    if any(p.mode != first.mode or p.group_size != first.group_size for p in parts):
        raise QuantError("fused weights must share one quantization mode and group size")
    return QuantizedTensor(first.mode, np.concatenate([p.q for p in parts]),
                           np.concatenate([p.scale for p in parts]),
                           None if first.min is None else np.concatenate([p.min for p in parts]),
                           first.group_size)


def pad_rows(qt: QuantizedTensor, rows: int) -> QuantizedTensor:
    """Append zero rows (scale and min 0: they dequantize to 0) up to `rows` (vocabulary shards)."""
    extra = rows - qt.q.shape[0]
    if extra <= 0:
        return qt

    def pad(a):
        return np.concatenate([a, np.zeros((extra,) + a.shape[1:], a.dtype)])

    return QuantizedTensor(qt.mode, pad(qt.q), pad(qt.scale), None if qt.min is None else pad(qt.min),
                           qt.group_size)


def take_rows(qt: QuantizedTensor, ids: np.ndarray) -> np.ndarray:
    """Dequantize only the gathered rows (an embedding lookup): ids [T] -> float32 [T, I]."""
    return dequantize(QuantizedTensor(qt.mode, qt.q[ids], qt.scale[ids],
                                      None if qt.min is None else qt.min[ids], qt.group_size))


# ---- GGUF blocks ----------------------------------------------------------------------------------------------
def from_gguf_q4_1(raw: np.ndarray, rows: int, cols: int) -> QuantizedTensor:
    """GGUF Q4_1 raw bytes (blocks of 20: fp16 d, fp16 m, 16 bytes holding elements j and j+16 of the block in the
    low and high nibbles of byte j) -> q4_1 QuantizedTensor [rows, cols], the same values repacked."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * cols // 32, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32).reshape(rows, cols // 32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(F32).reshape(rows, cols // 32)
    qs = blocks[:, 4:]
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)      # element order within a block
    return QuantizedTensor("q4_1", pack4(values), d, m, 32)


def from_gguf_q4_0(raw: np.ndarray, rows: int, cols: int) -> QuantizedTensor:
    """GGUF Q4_0 raw bytes (blocks of 18: fp16 d, 16 bytes of nibbles as in Q4_1, x = d * (q - 8)) -> int4
    QuantizedTensor in groups of 32 with scale d and minimum -8 d: the same values (d * q and -8 d are exact in
    float32, so is their sum)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * cols // 32, 18)
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32).reshape(rows, cols // 32)
    qs = blocks[:, 2:]
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)
    return QuantizedTensor("int4", pack4(values), d, (F32(-8) * d).astype(F32), 32)


def from_gguf_q8_0(raw: np.ndarray, rows: int, cols: int) -> QuantizedTensor:
    """GGUF Q8_0 raw bytes (blocks of 34: fp16 d, 32 int8) -> q8_0 QuantizedTensor [rows, cols]."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * cols // 32, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32).reshape(rows, cols // 32)
    q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return QuantizedTensor("q8_0", q, d, None, 32)
