"""Write an hpcinfer checkpoint tensor by tensor, atomically (a temporary file renamed on success), sealed with a
CRC-32 per dataset and a metadata manifest (integrity.py)."""

from __future__ import annotations

import os

import numpy as np

import h5py

from ..arch import ModelArch, tensor_shapes
from ..errors import CheckpointError
from ..quant.formats import DEFAULT_EMBEDDING, DEFAULT_GROUP, LOAD_MODES, QuantError, SourceGrid, quantize
from ..quant.storage import (QUANTIZATIONS, LoadQuant, is_quantizable, is_row_parallel, write_quantized,
                             write_source_grid)
from .format import DTYPES, FORMAT_NAME, FORMAT_VERSION, to_storage
from .integrity import seal


class CheckpointWriter:
    """Usage:
        with CheckpointWriter("out.h5", arch, "float32") as w:
            w.add("embed.tokens", array)          # canonical name, stored layout (arch.tensor_shapes)
            w.set_tokenizer(tokenizer_json, chat_template="...", bos_token="<s>", eos_token="</s>")
    A failure inside the block leaves no output file behind; success checks that every tensor was written.
    """

    def __init__(self, path: str, arch: ModelArch, dtype: str = "float32", quantize: str = "none",
                 group_size: int = DEFAULT_GROUP, embedding: str = DEFAULT_EMBEDDING):
        """quantize: "int8" | "int4" | "asym8" stores every quantizable matrix (quant/storage.py) that `add` gets in
        the mode quant.storage.tensor_mode gives it (group_size: int4 / asym8; embedding: int4's embedding and LM
        head at 8 bits, or "same"); "gguf" marks a file whose matrices come quantized through `add_quantized`."""
        if dtype not in DTYPES:
            raise CheckpointError(f"--dtype {dtype!r} is not allowed; choose one of {', '.join(DTYPES)}")
        if quantize not in QUANTIZATIONS:
            raise CheckpointError(f"--quantize {quantize!r} is not allowed; choose one of {', '.join(QUANTIZATIONS)}")
        self.path, self.arch, self.dtype = path, arch, dtype
        self.quantize, self.group_size = quantize, group_size
        self.plan = LoadQuant(quantize, group_size, embedding) if quantize in LOAD_MODES[1:] else None
        self.expected = tensor_shapes(arch)
        self.written: set[str] = set()
        self.tmp_path = f"{path}.tmp.{os.getpid()}"
        self.file = None

    def __enter__(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.file = h5py.File(self.tmp_path, "w")
        self.file.attrs["format"] = FORMAT_NAME
        self.file.attrs["format_version"] = FORMAT_VERSION
        self.file.attrs["dtype"] = self.dtype
        self.file.attrs["quantization"] = self.quantize
        for key, value in self.arch.to_attrs().items():
            self.file.attrs[key] = np.asarray(value, dtype=np.int64) if key == "eos_token_ids" else value
        return self

    def add(self, name: str, array, grid: SourceGrid | None = None) -> None:
        """Store a float tensor (quantized as the writer's setting says). grid: the block grid its values came on
        (a GGUF block type), recorded on a float dataset so that quantizing it later follows the grid."""
        if name not in self.expected:
            raise CheckpointError(f"tensor '{name}' is not part of a {self.arch.family} checkpoint")
        array = np.asarray(array)
        if tuple(array.shape) != self.expected[name]:
            raise CheckpointError(f"tensor '{name}' has shape {tuple(array.shape)}, expected {self.expected[name]}")
        if name in self.written:
            raise CheckpointError(f"tensor '{name}' written twice")
        if self.plan is not None and is_quantizable(name):
            compute = array.T if is_row_parallel(name) else array            # [out, in]
            try:
                qt = quantize(compute, *self.plan.tensor(name))
            except QuantError as exc:
                raise CheckpointError(f"--quantize {self.quantize}: tensor '{name}': {exc}") from None
            self.add_quantized(name, qt)
            return
        ds = self.file.create_dataset(name, data=to_storage(array, self.dtype))
        if self.dtype == "bfloat16":
            ds.attrs["dtype"] = "bfloat16"
        if grid is not None:
            write_source_grid(ds, grid)
        self.written.add(name)

    def add_quantized(self, name: str, qt) -> None:
        """Store a QuantizedTensor (compute layout [out, in]) for the tensor `name`."""
        shape = self.expected.get(name)
        if shape is None or not is_quantizable(name):
            raise CheckpointError(f"tensor '{name}' cannot be stored quantized")
        if tuple(qt.shape) != (shape[::-1] if is_row_parallel(name) else shape):
            raise CheckpointError(f"quantized tensor '{name}' has shape {qt.shape}, expected {shape} (stored)")
        if name in self.written:
            raise CheckpointError(f"tensor '{name}' written twice")
        write_quantized(self.file, name, qt, shape)
        self.written.add(name)

    def set_tokenizer(self, tokenizer_json: str, chat_template: str | None = None,
                      bos_token: str | None = None, eos_token: str | None = None) -> None:
        """Store a Hugging Face `tokenizers` JSON (as UTF-8 bytes) and what chat templates need."""
        group = self.file.require_group("tokenizer")
        group.create_dataset("json", data=np.frombuffer(tokenizer_json.encode("utf-8"), dtype=np.uint8))
        for key, value in (("chat_template", chat_template), ("bos_token", bos_token), ("eos_token", eos_token)):
            if value is not None:
                group.attrs[key] = value

    def __exit__(self, exc_type, exc, tb):
        try:
            missing = [n for n in self.expected if n not in self.written]
            if exc_type is None and missing:
                raise CheckpointError(f"conversion wrote no tensor {missing[0]!r} ({len(missing)} tensors missing)")
            if exc_type is None:
                seal(self.file)                   # a CRC-32 per dataset and the manifest (integrity.py)
                self.file.close()
                os.replace(self.tmp_path, self.path)
        finally:
            self.file.close()
            if os.path.exists(self.tmp_path):
                os.remove(self.tmp_path)
        return False
