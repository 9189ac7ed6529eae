"""`hpcinfer convert`: a Hugging Face model folder (hf.py) or a llama.cpp .gguf file (gguf.py) to an hpcinfer
checkpoint."""

from __future__ import annotations

import os

from ..arch import ModelArch
from ..errors import CheckpointError
from ..quant.formats import DEFAULT_EMBEDDING, EMBEDDINGS
from .gguf import convert_gguf
from .hf import convert_hf


def convert(source: str, output: str, dtype: str, quantize: str = "none", group_size: int | None = None,
            keep_quantized: bool = False, embedding: str = DEFAULT_EMBEDDING) -> ModelArch:
    """Convert `source` into the checkpoint `output` by its kind; return its architecture. keep_quantized: a GGUF's
    Q4_1 / Q8_0 matrices stay as they are (gguf.convert_gguf). group_size None: the source's block grid (a GGUF's),
    else 64. embedding: with int4, the embedding / LM head at 8 bits ("int8") or int4 ("same")."""
    if source.endswith(".gguf"):
        converter = convert_gguf
    elif os.path.isdir(source):
        converter = convert_hf
    else:
        raise CheckpointError(f"convert source '{source}' is neither a .gguf file nor a Hugging Face model "
                              f"folder (a directory with config.json)")
    if keep_quantized and not source.endswith(".gguf"):
        raise CheckpointError("--keep-quantized applies to .gguf sources only")
    if embedding not in EMBEDDINGS:
        raise CheckpointError(f"--quantize-embedding {embedding!r} is not allowed; choose one of "
                              f"{', '.join(EMBEDDINGS)}")
    extra = {"keep_quantized": True} if keep_quantized else {}
    return converter(source, output, dtype, quantize, group_size, embedding=embedding, **extra)
