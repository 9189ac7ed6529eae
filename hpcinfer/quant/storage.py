"""Quantized tensors in the HDF5 checkpoint, and the load rule the sharded layers share.

A quantized tensor `name` is three root datasets instead of one: `name.q` (int8, or uint8 for unsigned and packed
4-bit values), `name.scale` and, when asymmetric, `name.min` (float32 [out, in / group_size]). All three hold the
COMPUTE layout [out, in] with groups along `in`, row-parallel weights included (their float form is stored
[in, out]); the attributes of `name.q` say how: mode, bits, group_size, shape (the float tensor's stored shape, as
arch.tensor_shapes gives it) and transposed (true for row-parallel weights).

Which tensors are quantized: the 2-D weight matrices of attention and the dense MLP, the token embedding and the LM
head. Norms, biases, position tables, MoE routers and expert stacks stay in the checkpoint's float dtype. With int4,
the embedding and LM head are kept at 8 bits by default (`embedding = "int8"`: int8 per row, or the source's own
8-bit blocks); `embedding = "same"` makes them int4 like the rest.

Source grids (quant/formats.py): a float tensor converted from a block-quantized GGUF tensor records its grid in
the attributes `source_kind`, `source_block`, `source_bits`; a kept q4_1 / q8_0 tensor is its own grid. A quantize
setting without a group size uses the gcd of the grids of the tensors it quantizes group-wise (32 for SmolLM2's
Q4_1 / Q8_0 GGUF), and tensors already at the target's bits keep their blocks.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import numpy as np

from ..arch import tensor_shapes
from ..errors import CheckpointError, ConfigError
from .formats import (DEFAULT_EMBEDDING, DEFAULT_GROUP, EMBEDDINGS, GROUPED_MODES, LOAD_MODES, STORED_GRIDS,
                      QuantError, QuantizedTensor, SourceGrid, as_mode, grid_group, grid_note, group_for,
                      keeps_blocks, kept_mode, off_grid_warning, quantize, slice_cols, slice_rows, spec)

log = logging.getLogger("hpcinfer")

QUANTIZATIONS = LOAD_MODES + ("gguf",)                       # root attribute `quantization`
_LAYER = re.compile(r"^layers\.\d+\.(attn\.[qkvo]|mlp\.(gate|up|down))\.weight$")
_ROW_PARALLEL = (".attn.o.weight", ".mlp.down.weight")
EMBEDDING_TENSORS = ("embed.tokens", "lm_head.weight")      # what `embedding` (quantize_embedding) applies to
SOURCE_ATTRS = ("source_kind", "source_block", "source_bits")


def is_quantizable(name: str) -> bool:
    return name in ("embed.tokens", "lm_head.weight") or bool(_LAYER.match(name))


def is_row_parallel(name: str) -> bool:
    """Stored [in, out] as float, [out, in] once quantized."""
    return name.endswith(_ROW_PARALLEL)


def tensor_mode(name: str, mode: str, embedding: str = DEFAULT_EMBEDDING) -> str:
    """The mode a quantize setting gives the tensor `name`: `mode`, except that int4 with embedding = "int8" keeps
    the token embedding and the LM head at 8 bits (int8 per row, or the source's 8-bit blocks kept)."""
    if mode == "int4" and embedding == "int8" and name in EMBEDDING_TENSORS:
        return "int8"
    return mode


def write_source_grid(dataset, grid: SourceGrid) -> None:
    """Record on a float dataset the block grid its values came on (convert from a block-quantized GGUF tensor)."""
    dataset.attrs["source_kind"], dataset.attrs["source_block"], dataset.attrs["source_bits"] = grid


def source_grid(file, name: str) -> SourceGrid | None:
    """The grid the stored values of `name` sit on: a kept q4_1 / q8_0 tensor's blocks, or the grid a float tensor
    recorded at conversion; None for anything else."""
    if is_stored_quantized(file, name):
        mode = str(file[f"{name}.q"].attrs["mode"])
        return SourceGrid(mode, *STORED_GRIDS[mode]) if mode in STORED_GRIDS else None
    attrs = file[name].attrs if name in file else {}
    if "source_kind" not in attrs:
        return None
    return SourceGrid(str(attrs["source_kind"]), int(attrs["source_block"]), int(attrs["source_bits"]))


def source_grids(ckpt) -> dict[str, SourceGrid]:
    """Quantizable tensor name -> its source grid, for the tensors that have one (none for a preset)."""
    file = getattr(ckpt, "file", None)
    if file is None:
        return {}
    grids = {name: source_grid(file, name) for name in tensor_shapes(ckpt.arch) if is_quantizable(name)}
    return {name: grid for name, grid in grids.items() if grid is not None}


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


def stored_nbytes(file, name: str) -> int:
    """Bytes the checkpoint stores for the tensor `name`: its float dataset, or its q, scale and min."""
    if not is_stored_quantized(file, name):
        return int(file[name].nbytes)
    return sum(int(file[f"{name}.{part}"].nbytes) for part in ("q", "scale", "min") if f"{name}.{part}" in file)


def stored_format(file, name: str, dtype: str) -> str:
    """How the tensor `name` is stored, for `hpcinfer inspect`: "int4 g32", "int8 per row", "q8_0 g32", or the
    float dtype, with the grid its values came on when the conversion recorded one ("float32 (source Q4_1 g32)")."""
    if is_stored_quantized(file, name):
        attrs = file[f"{name}.q"].attrs
        mode = str(attrs["mode"])
        return f"{mode} per row" if mode == "int8" else f"{mode} g{int(attrs['group_size'])}"
    grid = source_grid(file, name)
    return dtype if grid is None else f"{dtype} (source {grid.kind} g{grid.block})"


def quantized_nbytes(mode: str, rows: int, cols: int, group_size: int = DEFAULT_GROUP) -> int:
    """Bytes of a QuantizedTensor [rows, cols] of `mode` (q, scale and min), without making one."""
    groups = rows * (cols // group_for(mode, cols, group_size))
    bits, symmetric = spec(mode)
    return rows * cols * bits // 8 + groups * 4 * (1 if symmetric else 2)       # float32 scale (and min)


class LoadQuant(NamedTuple):
    """A quantize setting as one load (or one conversion) applies it: each quantizable matrix becomes
    tensor_mode(name, mode, embedding) in groups of `group_size`, as it is read, except a tensor whose source blocks
    already have that mode's bits: it keeps them unless a group size was given (group_given) that differs from
    its blocks."""
    mode: str
    group_size: int
    embedding: str = DEFAULT_EMBEDDING
    group_given: bool = True

    def tensor(self, name: str) -> tuple[str, int]:
        """(mode, group size) that this setting gives the tensor `name`."""
        return tensor_mode(name, self.mode, self.embedding), self.group_size

    def keeps(self, name: str, grid: SourceGrid | None) -> bool:
        """Whether the tensor `name`, whose values sit on `grid`, keeps its source blocks."""
        return keeps_blocks(self.tensor(name)[0], grid, self.group_size if self.group_given else None)


def check_embedding(embedding: str, setting: str) -> None:
    if embedding not in EMBEDDINGS:
        raise ConfigError(f"{setting} = {embedding!r} is not allowed; choose one of {', '.join(EMBEDDINGS)}")


def plan_quant(mode: str, group_size: int | None, embedding: str, grids: dict[str, SourceGrid],
               setting: str) -> tuple[LoadQuant, list[tuple[int, str]]]:
    """A quantize setting (`mode`, not "none") against the source's grids (name -> SourceGrid) -> the LoadQuant to
    apply, and what to tell (logging level, line): the grid a group size left unset (None) follows, or the warning
    for a given one (`setting` names its key or flag) that does not divide into the blocks. Only the tensors
    quantized group-wise count: with embedding = "int8" the 8-bit embedding's grid does not choose int4's groups."""
    grouped = [grid for name, grid in grids.items() if tensor_mode(name, mode, embedding) in GROUPED_MODES]
    if group_size is None:
        fit = grid_group(grouped)
        note = grid_note(mode, fit, grouped) + (_EMBEDDING_NOTE if tensor_mode(EMBEDDING_TENSORS[0], mode, embedding)
                                                 != mode else "")
        told = [(logging.INFO, note)] if fit is not None else []
        return LoadQuant(mode, fit or DEFAULT_GROUP, embedding, False), told
    warning = off_grid_warning(mode, group_size, grouped, setting)
    return LoadQuant(mode, group_size, embedding, True), [(logging.WARNING, warning)] if warning else []


_EMBEDDING_NOTE = "; the embedding / LM head at 8 bits (quantize_embedding = \"same\" makes them int4)"


def tell(told: list[tuple[int, str]]) -> None:
    for level, line in told:
        log.log(level, line)


def load_quant(ckpt, mode: str, group_size: int | None = None,
               embedding: str = DEFAULT_EMBEDDING) -> LoadQuant | None:
    """Check `[model] quantize` against the checkpoint and say what to quantize while loading: a LoadQuant for a
    float checkpoint or one that keeps a GGUF's blocks (pass it to Decoder.load / Encoder.load, quant_of), None
    when nothing is (quantize = "none", or a checkpoint stored as int8 / int4 / asym8, which keeps its own format).
    group_size None (or 0, `quantize_group = 0`): the source's block grid when it has one, else DEFAULT_GROUP,
    said in one log line; a given group size off that grid is a logged warning. On a quantized checkpoint,
    quantize = "none" (the default) uses the stored weights as they are, whatever quantize_group says; naming the
    stored mode is accepted too, but then a group-wise (int4, asym8) quantize_group, when given, must equal the
    stored group size; any other mode is an error. The checkpoint is not changed."""
    if mode not in LOAD_MODES:
        raise ConfigError(f"[model] quantize = {mode!r} is not allowed; choose one of {', '.join(LOAD_MODES)}")
    check_embedding(embedding, "[model] quantize_embedding")
    stored = getattr(ckpt, "quantization", "none")
    if mode == "none":
        return None
    if stored in ("none", "gguf"):
        quant, told = plan_quant(mode, group_size or None, embedding, source_grids(ckpt), "[model] quantize_group")
        tell(told)
        return quant
    _check_stored_mode(ckpt, stored, mode, group_size or None)
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


def _kept(file, name: str, wanted: LoadQuant | None) -> bool:
    """Whether the load reads the stored quantized tensor `name` as it is: always when nothing is quantized while
    loading, else when `wanted` keeps its blocks (a --keep-quantized checkpoint's q4_1 / q8_0 at their own bits)."""
    if file is None or not is_stored_quantized(file, name):
        return False
    return wanted is None or wanted.keeps(name, source_grid(file, name))


def quant_of(ckpt, quant: LoadQuant | None = None):
    """tensor name -> (mode, group_size) for each tensor this checkpoint's model holds quantized (stored so, or
    quantized while it loads by `[model] quantize`: `quant`, load_quant's value; when not given, what the reader
    carries), else None. Read now: it stays valid once the file is closed."""
    file = getattr(ckpt, "file", None)
    wanted = quant if quant is not None else _wanted(ckpt)
    modes = {}
    for name in tensor_shapes(ckpt.arch):
        if _kept(file, name, wanted):
            attrs = file[f"{name}.q"].attrs
            stored = str(attrs["mode"])
            modes[name] = (stored if wanted is None else kept_mode(stored, wanted.mode), int(attrs["group_size"]))
        elif wanted is not None and is_quantizable(name):
            modes[name] = wanted.tensor(name)
    return modes.get


def configure(ckpt, mode: str, group_size: int | None = None,
              embedding: str = DEFAULT_EMBEDDING) -> LoadQuant | None:
    """load_quant, also recorded on `ckpt` (its `load_quant`) so that a later `Decoder(...).load(ckpt)` or
    quant_of(ckpt) applies it: the shorthand tests and benchmarks use on a reader they hold. The runtime and the
    Python API pass load_quant's value explicitly instead, and leave the checkpoint as it was opened."""
    quant = load_quant(ckpt, mode, group_size, embedding)
    ckpt.load_quant = quant
    return quant


def _check_stored_mode(ckpt, stored: str, mode: str, group_size: int | None) -> None:
    """`[model] quantize` = `mode` (not "none") on a checkpoint stored quantized as `stored` (int8, int4, asym8):
    allowed only when it names the stored format (and group size, when one is given) exactly."""
    if mode != stored:
        raise ConfigError(f"[model] quantize = {mode!r} conflicts with checkpoint '{ckpt.path}', which is already "
                          f"quantized as {stored!r}; set quantize = \"none\" or \"{stored}\", or convert the float "
                          f"model again")
    stored_group = stored_group_size(ckpt)
    if mode in GROUPED_MODES and None not in (stored_group, group_size) and group_size != stored_group:
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
    wanted = _wanted(ckpt)                                           # QuantizingReader (Decoder.load)
    if _kept(file, name, wanted):
        stored = read_quantized(file, name, rows, cols)
        return stored if wanted is None else as_mode(stored, wanted.mode)
    if wanted is None or not is_quantizable(name):
        return None
    mode, group_size = wanted.tensor(name)                          # a stored tensor not kept: read dequantized
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
