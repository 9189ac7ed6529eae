"""Quantized tensors in the HDF5 checkpoint, and the load rule the sharded layers share.

A quantized tensor `name` is three root datasets instead of one: `name.q` (int8, or uint8 for unsigned and packed
4-bit values), `name.scale` and, when asymmetric, `name.min` (float32 [out, in / group_size]). All three hold the
COMPUTE layout [out, in] with groups along `in`, row-parallel weights included (their float form is stored
[in, out]); the attributes of `name.q` say how: mode, bits, group_size, shape (the float tensor's stored shape, as
arch.tensor_shapes gives it) and transposed (true for row-parallel weights).

Which tensors are quantized: the 2-D weight matrices of attention and the dense MLP, the token embedding and the LM
head. Norms, biases, position tables, MoE routers and expert stacks stay in the checkpoint's float dtype.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from ..arch import tensor_shapes
from ..errors import CheckpointError, ConfigError
from .formats import (DEFAULT_GROUP, GROUPED_MODES, LOAD_MODES, QuantError, QuantizedTensor, group_for, quantize,
                      slice_cols, slice_rows, spec)

QUANTIZATIONS = LOAD_MODES + ("gguf",)                       # root attribute `quantization`
_LAYER = re.compile(r"^layers\.\d+\.(attn\.[qkvo]|mlp\.(gate|up|down))\.weight$")
_ROW_PARALLEL = (".attn.o.weight", ".mlp.down.weight")


def is_quantizable(name: str) -> bool:
    return name in ("embed.tokens", "lm_head.weight") or bool(_LAYER.match(name))


def is_row_parallel(name: str) -> bool:
    """Stored [in, out] as float, [out, in] once quantized."""
    return name.endswith(_ROW_PARALLEL)


def write_quantized(file, name: str, qt: QuantizedTensor, stored_shape: tuple) -> None:
    for part, array in qt.arrays().items():
        file.create_dataset(f"{name}.{part}", data=array)
    attrs = file[f"{name}.q"].attrs
    attrs["mode"], attrs["bits"], attrs["group_size"] = qt.mode, qt.bits, qt.group_size
    attrs["shape"] = np.asarray(stored_shape, dtype=np.int64)
    attrs["transposed"] = is_row_parallel(name)


def is_stored_quantized(file, name: str) -> bool:
    return name not in file and f"{name}.q" in file


def stored_shape(file, name: str) -> tuple:
    return tuple(int(n) for n in file[f"{name}.q"].attrs["shape"])


def read_quantized(file, name: str, rows: slice | None = None, cols: slice | None = None) -> QuantizedTensor:
    """The quantized tensor in compute layout [out, in], or a block of its output rows (`rows`) or input columns
    (`cols`): only that block is read from the file."""
    q = file[f"{name}.q"]
    mode, g = str(q.attrs["mode"]), int(q.attrs["group_size"])
    has_min = f"{name}.min" in file
    # a lazy view: h5py datasets slice like arrays, so slice_rows / slice_cols read just the block
    lazy = QuantizedTensor(mode, q, file[f"{name}.scale"], file[f"{name}.min"] if has_min else None, g)
    if rows is not None:
        part = slice_rows(lazy, rows)
    elif cols is not None:
        try:
            part = slice_cols(lazy, cols)
        except QuantError as exc:
            raise CheckpointError(f"tensor '{name}': {exc}; use a tp degree whose shards hold whole groups") from None
    else:
        part = lazy

    def load(a):
        return np.asarray(a[()] if hasattr(a, "id") else a)          # an h5py Dataset has .id, an array not

    return QuantizedTensor(mode, load(part.q), load(part.scale).astype(np.float32, copy=False),
                           None if part.min is None else load(part.min).astype(np.float32, copy=False),
                           part.group_size)


def quantized_nbytes(mode: str, rows: int, cols: int, group_size: int = DEFAULT_GROUP) -> int:
    """Bytes of a QuantizedTensor [rows, cols] of `mode` (q, scale and min), without making one."""
    groups = rows * (cols // group_for(mode, cols, group_size))
    bits, symmetric = spec(mode)
    return rows * cols * bits // 8 + groups * 4 * (1 if symmetric else 2)       # float32 scale (and min)


class LoadQuant(NamedTuple):
    """`[model] quantize` as one load applies it: a float checkpoint's quantizable matrices become `mode`, in
    groups of `group_size`, as they are read."""
    mode: str
    group_size: int


def load_quant(ckpt, mode: str, group_size: int = DEFAULT_GROUP) -> LoadQuant | None:
    """Check `[model] quantize` against the checkpoint and say what to quantize while loading: a LoadQuant for a
    float checkpoint (pass it to Decoder.load / Encoder.load, quant_of), None when nothing is (quantize = "none",
    or a quantized checkpoint, which keeps its own format). On a quantized checkpoint, quantize = "none" (the
    default) uses the stored weights as they are, whatever quantize_group says; naming the stored mode is accepted
    too, but then a group-wise (int4, asym8) quantize_group must equal the stored group size; any other mode is an
    error. The checkpoint is not changed."""
    if mode not in LOAD_MODES:
        raise ConfigError(f"[model] quantize = {mode!r} is not allowed; choose one of {', '.join(LOAD_MODES)}")
    stored = getattr(ckpt, "quantization", "none")
    if stored == "none":
        return None if mode == "none" else LoadQuant(mode, group_size)
    if mode != "none":
        _check_stored_mode(ckpt, stored, mode, group_size)
    return None


class QuantizingReader:
    """A checkpoint reader as one model load sees it: every attribute of `ckpt` (the reading interface of
    checkpoint.format.Checkpoint or a PresetSource), plus `load_quant`, what load_matrix quantizes while reading.
    The wrapped reader is not changed, so one open checkpoint can feed loads of different settings."""

    def __init__(self, ckpt, quant: LoadQuant):
        self.ckpt, self.load_quant = ckpt, quant

    def __getattr__(self, name: str):                # only names this view does not hold itself
        return getattr(self.ckpt, name)


def quantizing_reader(ckpt, quant: LoadQuant | None):
    """The reader a load reads through: `ckpt` itself when nothing is quantized while loading."""
    return ckpt if quant is None else QuantizingReader(ckpt, quant)


def _wanted(ckpt) -> LoadQuant | None:
    """What the reader a load reads through quantizes while loading: a QuantizingReader's load_quant (or one that
    configure() recorded on the reader itself), else nothing."""
    wanted = getattr(ckpt, "load_quant", None)
    return None if wanted is None else LoadQuant(*wanted)


def quant_of(ckpt, quant: LoadQuant | None = None):
    """tensor name -> (mode, group_size) for each tensor this checkpoint's model holds quantized (stored so, or
    quantized while it loads by `[model] quantize`: `quant`, load_quant's value; when not given, what the reader
    carries), else None. Read now: it stays valid once the file is closed."""
    file = getattr(ckpt, "file", None)
    wanted = quant if quant is not None else _wanted(ckpt)
    modes = {}
    for name in tensor_shapes(ckpt.arch):
        if file is not None and is_stored_quantized(file, name):
            attrs = file[f"{name}.q"].attrs
            modes[name] = (str(attrs["mode"]), int(attrs["group_size"]))
        elif wanted is not None and is_quantizable(name):
            modes[name] = tuple(wanted)
    return modes.get


def configure(ckpt, mode: str, group_size: int = DEFAULT_GROUP) -> LoadQuant | None:
    """load_quant, also recorded on `ckpt` (its `load_quant`) so that a later `Decoder(...).load(ckpt)` or
    quant_of(ckpt) applies it: the shorthand tests and benchmarks use on a reader they hold. The runtime and the
    Python API pass load_quant's value explicitly instead, and leave the checkpoint as it was opened."""
    quant = load_quant(ckpt, mode, group_size)
    ckpt.load_quant = quant
    return quant


def _check_stored_mode(ckpt, stored: str, mode: str, group_size: int) -> None:
    """`[model] quantize` = `mode` (not "none") on a checkpoint stored quantized as `stored`: allowed only when it
    names the stored format exactly."""
    if stored == "gguf":
        raise ConfigError(f"[model] quantize = {mode!r} conflicts with checkpoint '{ckpt.path}', which keeps the "
                          f"GGUF file's own quantized blocks (q4_1 / q8_0, `convert --keep-quantized`); set "
                          f"quantize = \"none\" to run them as they are, or convert the GGUF file again without "
                          f"--keep-quantized (optionally with --quantize {mode})")
    if mode != stored:
        raise ConfigError(f"[model] quantize = {mode!r} conflicts with checkpoint '{ckpt.path}', which is already "
                          f"quantized as {stored!r}; set quantize = \"none\" or \"{stored}\", or convert the float "
                          f"model again")
    stored_group = stored_group_size(ckpt)
    if mode in GROUPED_MODES and stored_group is not None and group_size != stored_group:
        raise ConfigError(f"[model] quantize_group = {group_size} conflicts with checkpoint '{ckpt.path}', whose "
                          f"{mode} weights are stored in groups of {stored_group}; set quantize_group = "
                          f"{stored_group}, or quantize = \"none\" (the stored groups are used as they are)")


def stored_group_size(ckpt) -> int | None:
    """The group size of the checkpoint's stored quantized matrices (one per checkpoint: convert writes every
    matrix with the same --group-size), None when it stores none."""
    file = getattr(ckpt, "file", None)
    for name in tensor_shapes(ckpt.arch) if file is not None else ():
        if is_stored_quantized(file, name) and str(file[f"{name}.q"].attrs["mode"]) in GROUPED_MODES:
            return int(file[f"{name}.q"].attrs["group_size"])
    return None


def load_matrix(ckpt, name: str, rows: slice | None = None, cols: slice | None = None, row_max=None):
    """A layer's weight block as a QuantizedTensor in compute layout [out, in] when the checkpoint stores it
    quantized or `[model] quantize` asks for it; None when it stays float (the caller reads it as before).
    rows: block of output rows (column-parallel, vocabulary); cols: block of input rows (row-parallel).
    row_max (row-parallel): combines the per-row max |w| of every tp shard [O] -> [O] (max over the tp group), so
    an int8 row scale quantized at load is the same at every tp degree."""
    file = getattr(ckpt, "file", None)
    if file is not None and is_stored_quantized(file, name):
        return read_quantized(file, name, rows, cols)
    wanted = _wanted(ckpt)                                           # QuantizingReader (Decoder.load)
    if wanted is None or not is_quantizable(name):
        return None
    mode, group_size = wanted
    if cols is not None:
        w = ckpt.read(name, cols).T                                  # stored [in_local, out] -> [out, in_local]
    else:
        w = ckpt.read(name, rows)
    w = np.asarray(w, dtype=np.float32)
    absmax = row_max(np.abs(w).max(axis=1)) if (row_max is not None and mode == "int8") else None
    try:
        return quantize(w, mode, group_size, absmax)
    except QuantError as exc:
        where = f" (this rank's tp shard of {ckpt.shape(name)[0]} input rows)" if cols is not None else ""
        raise ConfigError(f"[model] quantize = {mode!r}, tensor '{name}'{where}: {exc}") from None
