"""Convert a llama.cpp GGUF file (Llama architecture) into an hpcinfer checkpoint.

    arch = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.h5", dtype="float32")

The `gguf` reader memory-maps the file; tensors are dequantized to float32 one at a time, put into our canonical
layout and written, so memory stays at about one tensor. Three things differ from a Hugging Face checkpoint:

- Shapes: GGUF lists dimensions fastest-first (`ne`), numpy slowest-first. `ReaderTensor.shape` is the `ne` order
  (token_embd shows [D, V]); `ReaderTensor.data` and `dequantize` give the numpy order ([V, D]), which for a matrix
  is nn.Linear's [out, in].
- Rotary layout: llama.cpp's converter permutes the rows of Q and K within each head (HF rotates half-and-half,
  llama.cpp rotates adjacent pairs); `_unpermute_rows` undoes it.
- Tokenizer: a GGUF has no tokenizer.json, only metadata under `tokenizer.ggml.*`. We rebuild the same `tokenizers`
  object that transformers builds from it (transformers/integrations/gguf/gguf_tokenizer_mapping.py), so that token
  ids match `AutoTokenizer.from_pretrained(dir, gguf_file=...)` exactly; gguf_tokenizer.py holds that part.
"""

from __future__ import annotations

import numpy as np

from ..arch import ModelArch, tensor_shapes
from ..errors import CheckpointError
from ..quant.formats import (DEFAULT_EMBEDDING, DEFAULT_GROUP, as_mode, from_gguf_q4_0, from_gguf_q4_1,
                             from_gguf_q8_0, gguf_grid, slice_rows)
from ..quant.storage import LoadQuant, is_quantizable, plan_quant, tell
from .gguf_file import GgufFile
from .gguf_tokenizer import read_tokenizer
from .writer import CheckpointWriter

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor names (llama.cpp's) -> canonical names (arch.tensor_shapes).
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed.tokens",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_output.weight": "attn.o.weight",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
}
# Row-parallel matrices are stored [in, out]: the transpose of nn.Linear's (and GGUF's numpy-order) [out, in].
_TRANSPOSED = ("attn.o.weight", "mlp.down.weight")
# GGUF block types whose blocks can be stored as they are: by --keep-quantized (as q4_1 / q8_0), and by --quantize
# when they already have the target's bits (Q4_0 / Q4_1 as int4 in groups of 32, Q8_0 as q8_0).
_KEEP_QUANTIZED = {"Q4_1": from_gguf_q4_1, "Q8_0": from_gguf_q8_0}
_KEPT_BLOCKS = {"Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q8_0": from_gguf_q8_0}


def convert_gguf(src: str, out: str, dtype: str = "float32", quantize: str = "none", group_size: int | None = None,
                 keep_quantized: bool = False, embedding: str = DEFAULT_EMBEDDING) -> ModelArch:
    """Convert the GGUF file `src` into the checkpoint `out` (written atomically); return its architecture.
    keep_quantized: Q4_1 and Q8_0 matrices are stored as they are (quant/formats.py, modes q4_1 and q8_0), the rest
    dequantized. quantize = "int8" | "int4" | "asym8": matrices whose blocks already have the target's bits keep
    them (Q4_0 / Q4_1 under int4, Q8_0 under int8 and int4's 8-bit embedding) unless a group_size other than their
    block is given; the rest are dequantized and re-quantized, in groups of group_size, or when None on the source's
    block grid (quant.storage.plan_quant, which also logs the choice, or warns of a group off the grid). A float
    conversion records each tensor's block grid on it, for `[model] quantize` to follow later."""
    if keep_quantized and quantize != "none":
        raise CheckpointError("--keep-quantized keeps the GGUF's own blocks; it cannot be combined with --quantize")
    gguf_file = GgufFile(src)
    arch = _read_arch(gguf_file)
    sources = _map_tensors(gguf_file, arch)
    tokenizer = read_tokenizer(gguf_file)
    grids = {name: gguf_grid(tensor.tensor_type.name) for name, tensor in sources.items()}
    plan = None
    if quantize != "none":
        plan, told = plan_quant(quantize, group_size, embedding,
                                {n: g for n, g in grids.items() if g is not None and is_quantizable(n)},
                                "--group-size")
        tell(told)
    with CheckpointWriter(out, arch, dtype, "gguf" if keep_quantized else quantize,
                          plan.group_size if plan else DEFAULT_GROUP, embedding) as writer:
        for name, tensor in sources.items():
            kept = _kept_blocks(gguf_file, name, tensor, arch, keep_quantized, plan, grids[name])
            if kept is not None:
                writer.add_quantized(name, kept)
                continue
            writer.add(name, _to_canonical(name, _dequantize(gguf_file, tensor), arch), grids[name])
        if tokenizer is not None:
            writer.set_tokenizer(**tokenizer)
    return arch


def _float32_value(x) -> float:
    """GGUF floats are float32: give back the shortest decimal that rounds to it (1e-05, not 9.999999747e-06)."""
    return float(str(np.float32(x)))


def _read_arch(f: GgufFile) -> ModelArch:
    name = f.require("general.architecture")
    if name not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"GGUF file '{f.path}' holds a {name!r} model; the GGUF converter supports "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)} (other families convert from Hugging Face "
                              f"folders)")
    p = name + "."
    if f.get(p + "expert_count", 0):
        raise CheckpointError(f"GGUF file '{f.path}' is a mixture-of-experts {name} model "
                              f"({f.get(p + 'expert_count')} experts); the GGUF converter supports dense models only")
    scaling = f.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise CheckpointError(f"GGUF file '{f.path}' uses rope scaling {scaling!r}, which hpcinfer does not support")
    hidden = int(f.require(p + "embedding_length"))
    heads = int(f.require(p + "attention.head_count"))
    kv_heads = int(f.get(p + "attention.head_count_kv", heads))
    head_dim = int(f.get(p + "attention.key_length", hidden // heads))
    value_dim = int(f.get(p + "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise CheckpointError(f"GGUF file '{f.path}' has key length {head_dim} but value length {value_dim}; "
                              f"hpcinfer needs them equal")
    embed = _find_tensor(f, "token_embd.weight")
    vocab = int(embed.shape[-1])  # ne order: [D, V]
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos_ids = []  # llama.cpp also ends generation on the end-of-turn and end-of-message tokens
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = f.get(key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    try:
        return ModelArch(
            family=name,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=int(f.require(p + "block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(f.require(p + "feed_forward_length")),
            max_positions=int(f.require(p + "context_length")),
            norm="rmsnorm",
            norm_eps=_float32_value(f.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            position="rotary",
            rotary_dim=int(f.get(p + "rope.dimension_count", head_dim)),
            rope_theta=_float32_value(f.get(p + "rope.freq_base", 10000.0)),
            activation="silu",
            gated_mlp=True,
            tied_embeddings=_find_tensor(f, "output.weight", required=False) is None,
            bos_token_id=-1 if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
        )
    except ValueError as exc:
        raise CheckpointError(f"GGUF file '{f.path}' describes an invalid {name} model: {exc}") from None


def _find_tensor(f: GgufFile, name: str, required: bool = True):
    for tensor in f.reader.tensors:
        if tensor.name == name:
            return tensor
    if required:
        raise CheckpointError(f"GGUF file '{f.path}' has no tensor '{name}'")
    return None


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)  # blk.{i}.{rest}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _map_tensors(f: GgufFile, arch: ModelArch) -> dict:
    """Canonical name -> GGUF tensor, checking names, shapes and quantization types before anything is written."""
    expected = tensor_shapes(arch)
    sources, probed = {}, set()
    for tensor in f.reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise CheckpointError(f"GGUF file '{f.path}' scales its rotary frequencies (tensor 'rope_freqs.weight', "
                                  f"Llama 3.1 style); hpcinfer does not support rope scaling")
        name = _canonical_name(tensor.name)
        if name is None or name not in expected:
            raise CheckpointError(f"GGUF file '{f.path}' has tensor '{tensor.name}', which a {arch.family} model "
                                  f"with this configuration does not have")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ne order -> numpy order
        if name.endswith(_TRANSPOSED):
            shape = shape[::-1]
        if shape != expected[name]:
            raise CheckpointError(f"GGUF file '{f.path}': tensor '{tensor.name}' has shape {list(shape)} (as stored "
                                  f"here), expected {list(expected[name])}")
        if tensor.tensor_type not in probed:  # dequantize a sliver of one tensor per type: fail before writing
            _dequantize(f, tensor, probe=True)
            probed.add(tensor.tensor_type)
        sources[name] = tensor
    missing = [n for n in expected if n not in sources]
    if missing:
        raise CheckpointError(f"GGUF file '{f.path}' lacks the tensor for '{missing[0]}' "
                              f"({len(missing)} of {len(expected)} missing)")
    return sources


def _dequantize(f: GgufFile, tensor, probe: bool = False) -> np.ndarray:
    """float32 array in numpy order (slowest dimension first)."""
    data = tensor.data[:1] if probe and tensor.data.ndim > 1 else tensor.data
    try:
        values = f.gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"GGUF file '{f.path}': tensor '{tensor.name}' is stored as "
                              f"{tensor.tensor_type.name}, which the gguf package cannot dequantize; "
                              f"re-quantize the model to a common type (F32, F16, BF16, Q8_0, Q4_K ...)") from None
    if probe:
        return values
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _kept_blocks(f: GgufFile, name: str, tensor, arch: ModelArch, keep_quantized: bool, plan: LoadQuant | None,
                 grid):
    """The matrix's own blocks as a QuantizedTensor in compute layout [out, in] (GGUF's numpy order already is), its
    Q/K rows un-permuted like the float path, when they are stored as they are: every Q4_1 / Q8_0 matrix under
    keep_quantized; under `plan` (--quantize) a Q4_0 / Q4_1 / Q8_0 matrix the plan keeps (already at the target's
    bits), in the mode it runs as (q4_1 -> int4). None for the others (they are dequantized)."""
    kind = tensor.tensor_type.name
    readers = _KEEP_QUANTIZED if keep_quantized else _KEPT_BLOCKS
    wanted = keep_quantized or (plan is not None and plan.keeps(name, grid))
    if not wanted or kind not in readers or not is_quantizable(name):
        return None
    rows, cols = (int(n) for n in reversed(tensor.shape))
    raw = np.asarray(tensor.data).reshape(-1)
    qt = readers[kind](raw, rows, cols)
    if plan is not None:
        qt = as_mode(qt, plan.mode)
    heads = (arch.num_heads if name.endswith("attn.q.weight") else
             arch.num_kv_heads if name.endswith("attn.k.weight") else None)
    if heads is not None:                                  # permuting whole rows keeps every group intact
        order = _unpermute_rows(np.arange(rows)[:, None], heads)[:, 0]
        qt = slice_rows(qt, order)
    return qt


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, 2) back to (2, half) order."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _to_canonical(name: str, w: np.ndarray, arch: ModelArch) -> np.ndarray:
    if name.endswith("attn.q.weight"):
        return _unpermute_rows(w, arch.num_heads)
    if name.endswith("attn.k.weight"):
        return _unpermute_rows(w, arch.num_kv_heads)
    if name.endswith(_TRANSPOSED):
        return w.T
    return w
