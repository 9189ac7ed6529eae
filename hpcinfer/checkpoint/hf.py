"""Convert a Hugging Face model folder into an hpcinfer checkpoint, one tensor at a time.

    arch = convert_hf("models/llama-folder", "models/llama.h5", dtype="bfloat16")

The folder holds config.json and the weights: model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model.bin (sharded or not; reading it needs torch). Optional files:
generation_config.json (bos/eos ids), tokenizer.json, tokenizer_config.json and chat_template.jinja.

Each family (config.json `model_type`) is a choice of ModelArch features plus a map from canonical tensor names
to the Hugging Face tensors (hf_families.py); hf_weights.py reads the weight files, one source tensor at a time,
and hf_tokenizer.py collects the tokenizer files.
"""

from __future__ import annotations

import os

from ..arch import ModelArch
from ..errors import CheckpointError
from ..quant.formats import DEFAULT_EMBEDDING, DEFAULT_GROUP
from .format import DTYPES
from .hf_families import FAMILIES, Config
from .hf_tokenizer import tokenizer_files
from .hf_weights import WeightSource, read_json
from .writer import CheckpointWriter

SUPPORTED = ("gpt2", "opt", "gpt_neox", "llama", "mixtral", "bert", "roberta", "distilbert")


def convert_hf(folder: str, out: str, dtype: str = "float32", quantize: str = "none",
               group_size: int | None = None, embedding: str = DEFAULT_EMBEDDING) -> ModelArch:
    """Convert the Hugging Face model in `folder` into the checkpoint `out` stored as `dtype` (matrices quantized
    when quantize = "int8" | "int4" | "asym8", docs/quantization.md; group_size None: DEFAULT_GROUP, as float
    weights have no block grid to follow; embedding: int4's embedding / LM head at 8 bits, or "same"); return its
    arch."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not allowed; choose one of {', '.join(DTYPES)}")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"Hugging Face model folder '{folder}' does not exist (or is not a folder)")
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"'{folder}' has no config.json: is it a Hugging Face model folder?")
    config = Config(read_json(config_path), config_path)
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{config_path}: model_type {model_type!r} is not supported; supported model types: "
                              f"{', '.join(SUPPORTED)}")
    arch_of, tensors_of = FAMILIES[model_type]
    generation = read_json(os.path.join(folder, "generation_config.json"), missing_ok=True)
    bos, eos = _special_ids(config.raw, generation)
    try:
        arch = arch_of(config, bos, eos)
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: unsupported {model_type} configuration: {exc}") from None
    tokenizer = tokenizer_files(folder, bos, eos)
    with WeightSource(folder) as src, CheckpointWriter(out, arch, dtype, quantize, group_size or DEFAULT_GROUP,
                                                             embedding) as writer:
        for name, array in tensors_of(arch, config, src):
            writer.add(name, array)
        if tokenizer is not None:
            writer.set_tokenizer(*tokenizer)
    return arch


# ---------------------------------------------------------------------------------------------------------- config

def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _special_ids(config: dict, generation: dict) -> tuple[int, tuple[int, ...]]:
    """bos from config.json (else generation_config.json); eos: every id either file names (generation first)."""
    bos = _id_list(config.get("bos_token_id")) or _id_list(generation.get("bos_token_id")) or [-1]
    eos: list[int] = []
    for value in (generation.get("eos_token_id"), config.get("eos_token_id")):
        eos += [i for i in _id_list(value) if i not in eos]
    return bos[0], tuple(eos)
