"""The planned model, read from the planners' options (`hpcinfer plan --model / --quantize / --kv-cache`) exactly as
the runtime reads `[model] preset | checkpoint`, `quantize` and `kv_cache`. Both planners (offload: offload/report.py;
layouts: perf/report.py) call these, so they agree on the model and on what is quantized; they live here, below
both, so neither imports the other."""

from __future__ import annotations

import os
import types

from ..checkpoint.format import open_checkpoint
from ..checkpoint.presets import PRESETS
from ..errors import ConfigError
from ..quant.formats import QuantError
from ..quant.kv import kv_format
from ..quant.storage import LoadQuant, load_quant, quant_of


def planned_model(spec: str):
    """(arch, dtype) of `--model`: a preset name (float32) or a checkpoint file (its stored dtype)."""
    if spec in PRESETS:
        return PRESETS[spec], "float32"
    if os.path.exists(spec) or spec.endswith((".h5", ".hdf5")):
        with open_checkpoint(spec) as ckpt:
            return ckpt.arch, ckpt.dtype
    raise ConfigError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint file")


def planned_quant_of(model: str, arch, quantize: str, group: int):
    """quant.storage.quant_of of the planned model: a checkpoint's own quantization (checked against `quantize`
    as `[model] quantize` is), or `quantize` applied to float weights (a preset, or a float checkpoint)."""
    if model.endswith((".h5", ".hdf5")) and os.path.exists(model):
        with open_checkpoint(model) as ckpt:
            return quant_of(ckpt, load_quant(ckpt, quantize, group))
    return quant_of(types.SimpleNamespace(arch=arch), None if quantize == "none" else LoadQuant(quantize, group))


def planned_kv_format(kv_cache: str, group: int, head_dim: int):
    """`--kv-cache` / `--kv-cache-group` as `[model] kv_cache` reads them: a quant.kv.KVFormat, or None."""
    try:
        return kv_format(kv_cache, group, head_dim)
    except QuantError as exc:
        raise ConfigError(f"--kv-cache-group {group}: {exc}") from None
