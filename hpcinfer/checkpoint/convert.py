"""`hpcinfer convert`: a Hugging Face model folder (hf.py) or a llama.cpp .gguf file (gguf.py) to an hpcinfer
checkpoint."""

from __future__ import annotations

import os

from ..arch import ModelArch
from ..errors import CheckpointError
from .gguf import convert_gguf
from .hf import convert_hf


def convert(source: str, output: str, dtype: str, quantize: str = "none", group_size: int = 64,
            keep_quantized: bool = False) -> ModelArch:
    """Convert `source` into the checkpoint `output` by its kind; return its architecture. keep_quantized: a GGUF's
    Q4_1 / Q8_0 matrices stay as they are (gguf.convert_gguf)."""
    if source.endswith(".gguf"):
        converter = convert_gguf
    elif os.path.isdir(source):
        converter = convert_hf
    else:
        raise CheckpointError(f"convert source '{source}' is neither a .gguf file nor a Hugging Face model "
                              f"folder (a directory with config.json)")
    if keep_quantized and not source.endswith(".gguf"):
        raise CheckpointError("--keep-quantized applies to .gguf sources only")
    extra = {"keep_quantized": True} if keep_quantized else {}
    return converter(source, output, dtype, quantize, group_size, **extra)
