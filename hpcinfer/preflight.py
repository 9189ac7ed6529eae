"""Set-up checks that the generation job (job.py) and the embedding job (embed/job.py) share, run on every rank
before any weight is read: the model source (a checkpoint or a preset's random weights), `[model] quantize` against
the checkpoint, and output paths that can be written."""

from __future__ import annotations

import os

from .checkpoint.format import open_checkpoint
from .checkpoint.presets import open_preset
from .errors import ConfigError
from .offload.budget import kv_format_of
from .quant.storage import LoadQuant, load_quant


def open_model_source(model_section):
    """The checkpoint file, or a preset's random weights (the same reading interface, made on each rank)."""
    if model_section.preset is not None:
        return open_preset(model_section.preset)
    return open_checkpoint(model_section.checkpoint)


def check_quantization(config, ckpt, ops) -> LoadQuant | None:
    """`[model] quantize` against the checkpoint's own format (quantized weights run on both backends: NumpyOps
    dequantizes tiles, CupyOps dequantizes in registers, backend/cupy_quant.py) -> what the model load quantizes
    (quant.storage.load_quant: pass it to the model's load and to quant_of; the checkpoint is not changed)."""
    quant = load_quant(ckpt, config.model.quantize, config.model.quantize_group, config.model.quantize_embedding)
    kv_format_of(config, ckpt.arch)          # a quantized KV cache and top-k run on both backends (cupy_kv.py)
    return quant


def check_writable(path: str, key: str) -> None:
    """`path` (the value of config `key`) names a file this process can create or overwrite."""
    if os.path.isdir(path):
        raise ConfigError(f"{key} = '{path}' is a directory; give a file path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{key} = '{path}' exists and is not writable")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key} = '{path}': cannot create directory '{directory}' ({exc.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"{key} = '{path}': directory '{directory}' is not writable")
