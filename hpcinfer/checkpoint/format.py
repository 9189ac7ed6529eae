"""The hpcinfer HDF5 checkpoint: open, validate, hand out datasets and row slices.

Layout (docs/checkpoint-format.md): root attributes `format = "hpcinfer"`, `format_version`, `dtype` and the
ModelArch fields; one dataset per tensor at the root under its canonical name (arch.tensor_shapes);
the tokenizer, when known, under the group `tokenizer/`. The reader stays dumb: sharded layers decide what to read.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np

from ..arch import ModelArch, tensor_shapes
from ..errors import CheckpointError
from ..quant.formats import dequantize
from ..quant.storage import (QUANTIZATIONS, is_stored_quantized, read_quantized, stored_format, stored_nbytes,
                             stored_shape)
from . import integrity
from .integrity import truncation_report

FORMAT_NAME = "hpcinfer"
FORMAT_VERSION = 2          # 2 added quantized tensors (docs/quantization.md); version 1 files still open
READABLE_VERSIONS = (1, 2)
DTYPES = ("float32", "float16", "bfloat16")
# bfloat16 has no HDF5 type: stored as its raw 16 bits (uint16) with the dataset attribute dtype = "bfloat16".
_STORED_AS = {"float32": np.dtype("float32"), "float16": np.dtype("float16"), "bfloat16": np.dtype("uint16")}


def bfloat16_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_storage(array: np.ndarray, dtype: str) -> np.ndarray:
    """Cast to a checkpoint storage dtype (bfloat16 -> its uint16 bits, rounded to nearest even)."""
    if dtype == "bfloat16":
        return np.ascontiguousarray(array, dtype=np.float32).astype(bfloat16_dtype()).view(np.uint16)
    return np.ascontiguousarray(array, dtype=_STORED_AS[dtype])


def from_storage(array: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of to_storage: float32/float16 as they are, bfloat16 as an ml_dtypes bfloat16 array."""
    if dtype == "bfloat16":
        return array.view(bfloat16_dtype())
    return array


class Checkpoint:
    """An open, validated checkpoint. Use as a context manager, or call close()."""

    def __init__(self, path: str, file: h5py.File, arch: ModelArch, dtype: str, quantization: str = "none"):
        self.path, self.file, self.arch, self.dtype = path, file, arch, dtype
        self.quantization = quantization          # how the file stores its matrices (quant/storage.py)

    def shape(self, name: str) -> tuple[int, ...]:
        if is_stored_quantized(self.file, name):
            return stored_shape(self.file, name)
        return tuple(self.file[name].shape)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Read a tensor, or only a block of its leading rows (a contiguous read). A quantized tensor comes back
        dequantized to float32 in its stored float layout; layers that keep it quantized use quant.storage."""
        if is_stored_quantized(self.file, name):
            return _read_dequantized(self.file, name, rows)
        ds = self.file[name]
        data = ds[()] if rows is None else ds[rows]
        return from_storage(np.asarray(data), self.dtype)

    def read_slab(self, name: str, index: tuple) -> np.ndarray:
        """A hyperslab: one slice per leading dimension, e.g. (experts, rows) of an [E, F, D] expert stack."""
        key = tuple(slice(s.start, s.stop) for s in index)
        return from_storage(np.asarray(self.file[name][key]), self.dtype)

    def read_into(self, name: str, rows: slice, out: np.ndarray) -> None:
        """Read a block of leading rows of a float tensor straight into `out` (its storage dtype, or bfloat16),
        with no intermediate copy: loaders fill their preallocated shard this way."""
        if is_stored_quantized(self.file, name):
            out[...] = self.read(name, rows)
            return
        target = out.view(np.uint16) if self.dtype == "bfloat16" else out
        self.file[name].read_direct(target, np.s_[rows.start:rows.stop])

    def verify(self, rank: int = 0, world: int = 1) -> dict:
        """`[model] verify`: the metadata, and this rank's share of the tensors' CRC-32s (integrity.py)."""
        return integrity.verify(self.path, self.file, rank, world)

    def tokenizer_json(self) -> str | None:
        group = self.file.get("tokenizer")
        if group is None or "json" not in group:
            return None
        return bytes(group["json"][()]).decode("utf-8")

    def tokenizer_attrs(self) -> dict:
        group = self.file.get("tokenizer")
        return {} if group is None else {k: _attr_value(v) for k, v in group.attrs.items()}

    def close(self):
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_dequantized(file, name: str, rows: slice | None) -> np.ndarray:
    if file[f"{name}.q"].attrs["transposed"]:                  # compute layout [out, in]; stored rows = `in`
        w = dequantize(read_quantized(file, name)).T
        return np.ascontiguousarray(w if rows is None else w[rows])
    return dequantize(read_quantized(file, name, rows))


def _attr_value(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


def open_checkpoint(path: str) -> Checkpoint:
    """Open and validate: HDF5, our format and version, architecture, every tensor's presence, shape and dtype."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    try:
        file = h5py.File(path, "r")
    except OSError as exc:
        truncated = truncation_report(path, exc)
        raise CheckpointError(truncated or f"checkpoint '{path}' is not a readable HDF5 file ({exc})") from None
    try:
        arch, dtype = _validate(path, file)
    except Exception:
        file.close()
        raise
    return Checkpoint(path, file, arch, dtype, _attr_value(file.attrs.get("quantization", "none")))


def _validate(path: str, file: h5py.File) -> tuple[ModelArch, str]:
    attrs = {k: _attr_value(v) for k, v in file.attrs.items()}
    if attrs.get("format") != FORMAT_NAME:
        raise CheckpointError(f"'{path}' is an HDF5 file but not an hpcinfer checkpoint (no root attribute "
                              f"format = \"{FORMAT_NAME}\"); create one with `hpcinfer convert`")
    version = attrs.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint '{path}' has format_version {version}; this hpcinfer reads versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}: convert the model again with this version")
    if attrs.get("quantization", "none") not in QUANTIZATIONS:
        raise CheckpointError(f"checkpoint '{path}' has quantization {attrs.get('quantization')!r}; allowed: "
                              f"{', '.join(QUANTIZATIONS)}")
    dtype = attrs.get("dtype")
    if dtype not in DTYPES:
        raise CheckpointError(f"checkpoint '{path}' has dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    try:
        arch = ModelArch.from_attrs(attrs)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint '{path}' has an invalid architecture: {exc}") from None
    for name, shape in tensor_shapes(arch).items():
        if version >= 2 and is_stored_quantized(file, name):
            if stored_shape(file, name) != shape:
                raise CheckpointError(f"checkpoint '{path}': quantized tensor '{name}' has shape "
                                      f"{stored_shape(file, name)}, expected {shape}")
            continue
        if name not in file:
            raise CheckpointError(f"checkpoint '{path}' is missing tensor '{name}' (expected shape {shape})")
        ds = file[name]
        if tuple(ds.shape) != shape:
            raise CheckpointError(f"checkpoint '{path}': tensor '{name}' has shape {tuple(ds.shape)}, "
                                  f"expected {shape}")
        if ds.dtype != _STORED_AS[dtype]:
            raise CheckpointError(f"checkpoint '{path}': tensor '{name}' is stored as {ds.dtype}, expected "
                                  f"{_STORED_AS[dtype]} for a {dtype} checkpoint")
    return arch, dtype


def describe(ckpt: Checkpoint) -> str:
    """Human-readable summary for `hpcinfer inspect`."""
    arch = ckpt.arch
    lines = [f"checkpoint: {ckpt.path}", f"format: {FORMAT_NAME} v{ckpt.file.attrs['format_version']}, dtype {ckpt.dtype}, "
             f"quantization {ckpt.quantization}",
             "architecture:"]
    lines += [f"  {k} = {json.dumps(v)}" for k, v in arch.to_attrs().items()]
    tok = ckpt.tokenizer_attrs()
    lines.append("tokenizer: " + ("none" if ckpt.tokenizer_json() is None else
                                  "stored" + (" (with chat template)" if tok.get("chat_template") else "")))
    shapes = tensor_shapes(arch)
    total = stored = 0
    lines.append(f"tensors ({len(shapes)}): name, shape, format (group), bytes per parameter")
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        size = stored_nbytes(ckpt.file, name)
        total, stored = total + n, stored + size
        lines.append(f"  {name:40s} {str(list(shape)):>16s} {stored_format(ckpt.file, name, ckpt.dtype):28s} "
                     f"{size / max(n, 1):.4f}")
    lines.append(f"parameters: {total:,}")
    lines.append(f"bytes: {stored:,} for all tensors, {stored / max(total, 1):.4f} bytes per parameter")
    lines.append("checksums: " + ("crc32 per tensor, and a metadata manifest" if integrity.has_checksums(ckpt.file)
                                  else integrity.NO_CHECKSUMS))
    lines.append("check: OK (format, version, architecture, every tensor's shape and dtype)")
    return "\n".join(lines)
