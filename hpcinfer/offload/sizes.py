"""Bytes of a model's weights as one rank holds them: the one rule that the budget check (budget.py) and the
planner's cost model (cost_model.py) both count with, so that they agree with each other and with the runtime.

What the runtime holds (parallel/layers.py, model/*.py): matrices of the layers at the model dtype, split over
tp (column-parallel by output rows, row-parallel by input rows), or as QuantizedTensors (q, scale, min) when
quantized; the token table and the LM head split by vocabulary rows, ceil(V / tp) each (the last zero-padded);
vectors (norms, biases), routers, MoE mixing coefficients and the learned position table whole, in float32;
expert stacks at the dtype, split over tp as the existing plan counts them.
The embedding tables (token table, position table, final norm, LM head: one copy when tied) stay on the device,
outside the layers: neither the runtime nor the planner streams them.

quant_of: tensor name -> (mode, group_size) when that tensor is held quantized, else None (quant.storage).

The KV cache has its rule here too (`kv_token_bytes`): the runtime's (quant/kv.kv_bytes_per_token),
float32 rows, or with `[model] kv_cache = "int8" | "int4"` the format's packed values + a float16 scale and minimum
per group (quant.kv.KVFormat.row_bytes). The budget check counts with it, and the cost model's KV term moves it.

Rows: of a GPU batch's KV or activation rows, `device_rows` stay on the device under a placement percentage, and a
hidden-state row is float32 (`ACT_ITEMSIZE`); the budget, the cost model and the schedules count with these too.
"""

from __future__ import annotations

import math

from ..arch import tensor_shapes
from ..quant.kv import kv_bytes_per_token
from ..quant.storage import is_row_parallel, quantized_nbytes

FLOAT32 = 4
ACT_ITEMSIZE = 4                  # hidden states are computed in float32 whatever the weights' dtype (the Ops)
TABLES = ("embed.tokens", "lm_head.weight")
_WHOLE_FLOAT32 = ("embed.positions", ".router.", ".moe.coef.")


def device_rows(rows: int, cache_gpu: float) -> int:
    """Of a GPU batch's KV rows (N sequences x Hkv local heads) or activation rows (its T tokens), how many stay on
    the device under `cache_gpu` (`act_gpu`) percent: the nearest whole row, halves up (FlexGen's tensor
    granularity; the zig-zag schedule's KV cache and offload/activations.py hold them so)."""
    return min(rows, math.floor(rows * cache_gpu / 100 + 0.5))


def tensor_bytes(arch, name: str, shape: tuple, itemsize: int, tp: int = 1, quant_of=None) -> int:
    """Bytes one rank holds of tensor `name` (stored shape `shape`)."""
    numel = math.prod(shape)
    if len(shape) == 1 or any(part in name for part in _WHOLE_FLOAT32):
        return numel * FLOAT32
    if len(shape) > 2:                                            # an expert stack
        return numel * itemsize // tp
    if name in TABLES:
        rows, cols = -(-arch.vocab_size // tp), shape[1]
    elif is_row_parallel(name):
        rows, cols = shape[1], shape[0] // tp                     # stored [in, out]; held [out, in_local]
    else:
        rows, cols = shape[0] // tp, shape[1]
    quant = quant_of(name) if quant_of is not None else None
    return rows * cols * itemsize if quant is None else quantized_nbytes(quant[0], rows, cols, quant[1])


def layer_bytes(arch, layer: int, itemsize: int, tp: int = 1, quant_of=None) -> int:
    """Bytes one rank holds of decoder layer `layer`."""
    prefix = f"layers.{layer}."
    return sum(tensor_bytes(arch, name, shape, itemsize, tp, quant_of)
               for name, shape in tensor_shapes(arch).items() if name.startswith(prefix))


def table_bytes(arch, first: bool, last: bool, itemsize: int, tp: int = 1, quant_of=None) -> int:
    """The embedding tables of a stage: token and position tables on the first, final norm and LM head on the
    last (a tied head is the first stage's token table; a later last stage reads its own copy)."""
    shapes = tensor_shapes(arch)
    size = lambda name, shape=None: tensor_bytes(arch, name, shape or shapes[name], itemsize, tp, quant_of)
    total = 0
    if first:
        total += size("embed.tokens") + (size("embed.positions") if "embed.positions" in shapes else 0)
    if last:
        total += sum(size(name) for name in shapes if name.startswith("final_norm."))
        if not arch.tied_embeddings:
            total += size("lm_head.weight")
        elif not first:
            total += tensor_bytes(arch, "embed.tokens", shapes["embed.tokens"], itemsize, tp, quant_of)
    return total


def kv_token_bytes(arch, tp: int = 1, kv_format=None, itemsize: int = FLOAT32) -> int:
    """Bytes of one token's K and V in one decoder layer on one rank: 2 Hkv/tp rows of head_dim values, each
    head_dim * itemsize bytes (float; the runtime's cache is float32) or kv_format.row_bytes(head_dim) quantized
    (kv_format: a quant.kv.KVFormat; int4 at head_dim 64, group 64: 32 bytes of values + 4 of scale and min)."""
    if kv_format is not None:
        return kv_bytes_per_token(arch.num_kv_heads // tp, arch.head_dim, 1, kv_format)
    return 2 * (arch.num_kv_heads // tp) * arch.head_dim * itemsize
