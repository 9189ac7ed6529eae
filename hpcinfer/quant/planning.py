"""What a planned model holds quantized, read from the planners' options (`hpcinfer plan --quantize / --kv-cache`)
exactly as the runtime reads `[model] quantize` / `kv_cache`. Both planners (offload: cli; layouts: perf.report)
call these, so they agree on what is quantized; they live here, below both, so neither imports the other."""

from __future__ import annotations

import os
import types

from ..errors import ConfigError
from .formats import QuantError
from .kv import kv_format
from .storage import configure, quant_of


def planned_quant_of(model: str, arch, quantize: str, group: int):
    """quant.storage.quant_of of the planned model: a checkpoint's own quantization (checked against `quantize`
    as `[model] quantize` is), or `quantize` applied to float weights (a preset, or a float checkpoint)."""
    if model.endswith((".h5", ".hdf5")) and os.path.exists(model):
        from ..checkpoint.format import open_checkpoint

        with open_checkpoint(model) as ckpt:
            configure(ckpt, quantize, group)
            return quant_of(ckpt)
    wanted = None if quantize == "none" else (quantize, group)
    return quant_of(types.SimpleNamespace(arch=arch, load_quant=wanted))


def planned_kv_format(kv_cache: str, group: int, head_dim: int):
    """`--kv-cache` / `--kv-cache-group` as `[model] kv_cache` reads them: a quant.kv.KVFormat, or None."""
    try:
        return kv_format(kv_cache, group, head_dim)
    except QuantError as exc:
        raise ConfigError(f"--kv-cache-group {group}: {exc}") from None
