"""Convert a Hugging Face model folder into an hpcinfer checkpoint, one tensor at a time.

    arch = convert_hf("models/llama-folder", "models/llama.h5", dtype="bfloat16")

The folder holds config.json and the weights: model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model.bin (sharded or not; reading it needs torch). Optional files:
generation_config.json (bos/eos ids), tokenizer.json, tokenizer_config.json and chat_template.jinja.

Each family (config.json `model_type`) is a choice of ModelArch features plus a map from canonical tensor names
to the Hugging Face tensors, laid out as model.arch.tensor_shapes says: column-parallel matrices [out, in] (what
nn.Linear stores), row-parallel matrices (attn.o, mlp.down) [in, out] (nn.Linear's transpose; GPT-2's Conv1D
already stores [in, out]). Only one source tensor (and what is cut from it) is in memory at a time.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from ..errors import CheckpointError
from ..model.arch import ModelArch
from .format import DTYPES
from .writer import CheckpointWriter

# T=tensor D=hidden H=heads Hkv=KV heads hd=head dim F=MLP width V=vocab P=positions

SUPPORTED = ("gpt2", "opt", "gpt_neox", "llama")

# transformers' ACT2FN name -> ModelArch.activation (gelu_new, gelu_fast and gelu_pytorch_tanh are the same tanh
# approximation written three ways)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}


def convert_hf(folder: str, out: str, dtype: str = "float32") -> ModelArch:
    """Convert the Hugging Face model in `folder` into the checkpoint `out` stored as `dtype`; return its arch."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not allowed; choose one of {', '.join(DTYPES)}")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"Hugging Face model folder '{folder}' does not exist (or is not a folder)")
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"'{folder}' has no config.json: is it a Hugging Face model folder?")
    config = _Config(_read_json(config_path), config_path)
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise CheckpointError(f"{config_path}: model_type {model_type!r} is not supported; supported model types: "
                              f"{', '.join(SUPPORTED)}")
    arch_of, tensors_of = _FAMILIES[model_type]
    generation = _read_json(os.path.join(folder, "generation_config.json"), missing_ok=True)
    bos, eos = _special_ids(config.raw, generation)
    try:
        arch = arch_of(config, bos, eos)
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: unsupported {model_type} configuration: {exc}") from None
    tokenizer = _tokenizer_files(folder, bos, eos)
    with _WeightSource(folder) as src, CheckpointWriter(out, arch, dtype) as writer:
        for name, array in tensors_of(arch, config, src):
            writer.add(name, array)
        if tokenizer is not None:
            writer.set_tokenizer(*tokenizer)
    return arch


# ---------------------------------------------------------------------------------------------------------- config

class _Config:
    """config.json with errors that name the file and the key."""

    def __init__(self, raw: dict, path: str):
        self.raw, self.path = raw, path

    def get(self, key: str, default=None):
        value = self.raw.get(key)
        return default if value is None else value

    def need(self, key: str):
        if self.raw.get(key) is None:
            raise CheckpointError(f"{self.path} has no '{key}'")
        return self.raw[key]

    def refuse_if(self, condition: bool, why: str) -> None:
        if condition:
            raise CheckpointError(f"{self.path}: {why}; this model variant is not supported")

    def activation(self, key: str, default: str) -> str:
        name = self.get(key, default)
        if name not in _ACTIVATIONS:
            raise CheckpointError(f"{self.path}: {key} = {name!r} is not supported; supported: "
                                  f"{', '.join(sorted(_ACTIVATIONS))}")
        return _ACTIVATIONS[name]

    def rope(self, legacy_theta_keys: tuple[str, ...] = ("rope_theta",)) -> tuple[float, float]:
        """(rope theta, partial rotary factor or 0 when not given), refusing scaled RoPE variants.

        transformers 5 writes `rope_parameters = {rope_type, rope_theta, partial_rotary_factor?}`; older configs
        use top-level `rope_theta` (or GPT-NeoX's `rotary_emb_base`) and `rope_scaling` (null for plain RoPE)."""
        params = self.get("rope_parameters") or self.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"{self.path}: RoPE type {rope_type!r} (rope scaling) is not supported; only "
                                  f"plain RoPE ('default') is")
        theta = params.get("rope_theta")
        for key in legacy_theta_keys:
            theta = self.get(key) if theta is None else theta
        return float(10000.0 if theta is None else theta), float(params.get("partial_rotary_factor", 0.0))


def _read_json(path: str, missing_ok: bool = False) -> dict:
    if missing_ok and not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read '{path}': {exc}") from None


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


# -------------------------------------------------------------------------------------------------------- families
# Each family: arch(config, bos, eos) -> ModelArch and tensors(arch, config, src) -> (canonical name, array) pairs.

def _gpt2_arch(c: _Config, bos: int, eos: tuple) -> ModelArch:
    c.refuse_if(c.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx is true")
    c.refuse_if(not c.get("scale_attn_weights", True), "scale_attn_weights is false (unscaled attention)")
    D, H = c.need("n_embd"), c.need("n_head")
    return ModelArch(family="gpt2", vocab_size=c.need("vocab_size"), hidden_size=D, num_layers=c.need("n_layer"),
                     num_heads=H, num_kv_heads=H, head_dim=D // H, intermediate_size=c.get("n_inner", 4 * D),
                     max_positions=c.need("n_positions"), norm="layernorm",
                     norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), position="learned",
                     activation=c.activation("activation_function", "gelu_new"), qkv_bias=True, out_bias=True,
                     mlp_bias=True, tied_embeddings=bool(c.get("tie_word_embeddings", True)),
                     bos_token_id=bos, eos_token_ids=eos)


def _gpt2_tensors(arch: ModelArch, c: _Config, src: "_WeightSource"):
    get = src.getter(("transformer.", ""))
    D = arch.hidden_size
    yield "embed.tokens", get("wte.weight")
    yield "embed.positions", get("wpe.weight")
    for i in range(arch.num_layers):
        h, p = f"h.{i}.", f"layers.{i}."
        yield from _norm(p + "attn_norm", get, h + "ln_1")
        w, b = get(h + "attn.c_attn.weight"), get(h + "attn.c_attn.bias")         # Conv1D [D, 3D], [3D]
        for j, proj in enumerate("qkv"):
            yield p + f"attn.{proj}.weight", w[:, j * D:(j + 1) * D].T            # [D_out, D_in]
            yield p + f"attn.{proj}.bias", b[j * D:(j + 1) * D]
        del w, b
        yield p + "attn.o.weight", get(h + "attn.c_proj.weight")                  # Conv1D [in, out] as stored
        yield p + "attn.o.bias", get(h + "attn.c_proj.bias")
        yield from _norm(p + "mlp_norm", get, h + "ln_2")
        yield p + "mlp.up.weight", get(h + "mlp.c_fc.weight").T                    # [D, F] -> [F, D]
        yield p + "mlp.up.bias", get(h + "mlp.c_fc.bias")
        yield p + "mlp.down.weight", get(h + "mlp.c_proj.weight")                  # [F, D] as stored
        yield p + "mlp.down.bias", get(h + "mlp.c_proj.bias")
    yield from _norm("final_norm", get, "ln_f")
    if not arch.tied_embeddings:
        yield "lm_head.weight", src.get(("lm_head.weight",))


def _opt_arch(c: _Config, bos: int, eos: tuple) -> ModelArch:
    D, H = c.need("hidden_size"), c.need("num_attention_heads")
    c.refuse_if(not c.get("do_layer_norm_before", True), "do_layer_norm_before is false (post-norm OPT-350m)")
    c.refuse_if(c.get("word_embed_proj_dim", D) != D, f"word_embed_proj_dim ({c.get('word_embed_proj_dim')}) "
                f"differs from hidden_size ({D}): project_in/project_out layers")
    c.refuse_if(c.get("_remove_final_layer_norm", False), "_remove_final_layer_norm is true")
    bias = bool(c.get("enable_bias", True))
    return ModelArch(family="opt", vocab_size=c.need("vocab_size"), hidden_size=D,
                     num_layers=c.need("num_hidden_layers"), num_heads=H, num_kv_heads=H, head_dim=D // H,
                     intermediate_size=c.need("ffn_dim"), max_positions=c.need("max_position_embeddings"),
                     norm="layernorm", norm_eps=1e-5, position="learned",       # nn.LayerNorm's default eps
                     activation=c.activation("activation_function", "relu"), qkv_bias=bias, out_bias=bias,
                     mlp_bias=bias, tied_embeddings=bool(c.get("tie_word_embeddings", True)),
                     bos_token_id=bos, eos_token_ids=eos)


_OPT_POSITION_OFFSET = 2   # OPTLearnedPositionalEmbedding looks up row p + 2 for position p


def _opt_tensors(arch: ModelArch, c: _Config, src: "_WeightSource"):
    get = src.getter(("model.decoder.", "decoder.", ""))
    affine = bool(c.get("layer_norm_elementwise_affine", True))
    yield "embed.tokens", get("embed_tokens.weight")
    table = get("embed_positions.weight")                                          # [P + 2, D]
    P = arch.max_positions
    if table.shape[0] < P + _OPT_POSITION_OFFSET:
        raise CheckpointError(f"{src.folder}: OPT position table has {table.shape[0]} rows, expected "
                              f"max_position_embeddings + 2 = {P + _OPT_POSITION_OFFSET}")
    yield "embed.positions", table[_OPT_POSITION_OFFSET:_OPT_POSITION_OFFSET + P]
    del table
    norm = (lambda canonical, prefix: _norm(canonical, get, prefix)) if affine else \
        (lambda canonical, prefix: _unit_norm(canonical, arch.hidden_size))
    for i in range(arch.num_layers):
        h, p = f"layers.{i}.", f"layers.{i}."
        yield from norm(p + "attn_norm", h + "self_attn_layer_norm")
        for proj in "qkv":
            yield from _linear(p + f"attn.{proj}", get, h + f"self_attn.{proj}_proj", arch.qkv_bias)
        yield from _linear(p + "attn.o", get, h + "self_attn.out_proj", arch.out_bias, transpose=True)
        yield from norm(p + "mlp_norm", h + "final_layer_norm")
        yield from _linear(p + "mlp.up", get, h + "fc1", arch.mlp_bias)
        yield from _linear(p + "mlp.down", get, h + "fc2", arch.mlp_bias, transpose=True)
    yield from norm("final_norm", "final_layer_norm")
    if not arch.tied_embeddings:
        yield "lm_head.weight", src.get(("lm_head.weight",))


def _gpt_neox_arch(c: _Config, bos: int, eos: tuple) -> ModelArch:
    D, H = c.need("hidden_size"), c.need("num_attention_heads")
    hd = D // H
    theta, factor = c.rope(("rope_theta", "rotary_emb_base"))
    factor = factor or float(c.get("rotary_pct", 0.25))          # transformers' default partial factor is 0.25
    bias = bool(c.get("attention_bias", True))
    return ModelArch(family="gpt_neox", vocab_size=c.need("vocab_size"), hidden_size=D,
                     num_layers=c.need("num_hidden_layers"), num_heads=H, num_kv_heads=H, head_dim=hd,
                     intermediate_size=c.need("intermediate_size"), max_positions=c.need("max_position_embeddings"),
                     norm="layernorm", norm_eps=float(c.get("layer_norm_eps", 1e-5)), position="rotary",
                     rotary_dim=int(hd * factor), rope_theta=theta, activation=c.activation("hidden_act", "gelu"),
                     parallel_residual=bool(c.get("use_parallel_residual", True)), qkv_bias=bias, out_bias=bias,
                     mlp_bias=True, tied_embeddings=bool(c.get("tie_word_embeddings", False)),
                     bos_token_id=bos, eos_token_ids=eos)


def _gpt_neox_tensors(arch: ModelArch, c: _Config, src: "_WeightSource"):
    get = src.getter(("gpt_neox.", ""))
    D, H, hd = arch.hidden_size, arch.num_heads, arch.head_dim
    yield "embed.tokens", get("embed_in.weight")
    for i in range(arch.num_layers):
        h, p = f"layers.{i}.", f"layers.{i}."
        yield from _norm(p + "attn_norm", get, h + "input_layernorm")
        w = get(h + "attention.query_key_value.weight").reshape(H, 3, hd, D)     # rows ordered [H, 3, hd]
        for j, proj in enumerate("qkv"):
            yield p + f"attn.{proj}.weight", w[:, j].reshape(H * hd, D)
        del w
        if arch.qkv_bias:
            b = get(h + "attention.query_key_value.bias").reshape(H, 3, hd)
            for j, proj in enumerate("qkv"):
                yield p + f"attn.{proj}.bias", b[:, j].reshape(H * hd)
        yield from _linear(p + "attn.o", get, h + "attention.dense", arch.out_bias, transpose=True)
        yield from _norm(p + "mlp_norm", get, h + "post_attention_layernorm")
        yield from _linear(p + "mlp.up", get, h + "mlp.dense_h_to_4h", arch.mlp_bias)
        yield from _linear(p + "mlp.down", get, h + "mlp.dense_4h_to_h", arch.mlp_bias, transpose=True)
    yield from _norm("final_norm", get, "final_layer_norm")
    if not arch.tied_embeddings:
        yield "lm_head.weight", src.get(("embed_out.weight", "lm_head.weight"))  # transformers 5 renames on load


def _llama_arch(c: _Config, bos: int, eos: tuple) -> ModelArch:
    D, H = c.need("hidden_size"), c.need("num_attention_heads")
    hd = c.get("head_dim", D // H)
    theta, _ = c.rope()                     # plain RoPE rotates the whole head (partial_rotary_factor is unused)
    return ModelArch(family="llama", vocab_size=c.need("vocab_size"), hidden_size=D,
                     num_layers=c.need("num_hidden_layers"), num_heads=H,
                     num_kv_heads=c.get("num_key_value_heads", H), head_dim=hd,
                     intermediate_size=c.need("intermediate_size"), max_positions=c.need("max_position_embeddings"),
                     norm="rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-6)), position="rotary",
                     rotary_dim=hd, rope_theta=theta, activation=c.activation("hidden_act", "silu"), gated_mlp=True,
                     qkv_bias=bool(c.get("attention_bias", False)), out_bias=bool(c.get("attention_bias", False)),
                     mlp_bias=bool(c.get("mlp_bias", False)), tied_embeddings=bool(c.get("tie_word_embeddings", False)),
                     bos_token_id=bos, eos_token_ids=eos)


def _llama_tensors(arch: ModelArch, c: _Config, src: "_WeightSource"):
    get = src.getter(("model.", ""))
    yield "embed.tokens", get("embed_tokens.weight")
    for i in range(arch.num_layers):
        h, p = f"layers.{i}.", f"layers.{i}."
        yield p + "attn_norm.weight", get(h + "input_layernorm.weight")
        for proj in "qkv":
            yield from _linear(p + f"attn.{proj}", get, h + f"self_attn.{proj}_proj", arch.qkv_bias)
        yield from _linear(p + "attn.o", get, h + "self_attn.o_proj", arch.out_bias, transpose=True)
        yield p + "mlp_norm.weight", get(h + "post_attention_layernorm.weight")
        yield from _linear(p + "mlp.gate", get, h + "mlp.gate_proj", arch.mlp_bias)
        yield from _linear(p + "mlp.up", get, h + "mlp.up_proj", arch.mlp_bias)
        yield from _linear(p + "mlp.down", get, h + "mlp.down_proj", arch.mlp_bias, transpose=True)
    yield "final_norm.weight", get("norm.weight")
    if not arch.tied_embeddings:
        yield "lm_head.weight", src.get(("lm_head.weight",))


def _norm(canonical: str, get, hf: str):
    yield canonical + ".weight", get(hf + ".weight")
    yield canonical + ".bias", get(hf + ".bias")


def _unit_norm(canonical: str, D: int):
    """A LayerNorm without learned affine parameters: weight 1, bias 0."""
    yield canonical + ".weight", np.ones(D, np.float32)
    yield canonical + ".bias", np.zeros(D, np.float32)


def _linear(canonical: str, get, hf: str, bias: bool, transpose: bool = False):
    """nn.Linear [out, in]: as stored for column-parallel, transposed to [in, out] for row-parallel."""
    w = get(hf + ".weight")
    yield canonical + ".weight", w.T if transpose else w
    if bias:
        yield canonical + ".bias", get(hf + ".bias")


_FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "gpt2": (_gpt2_arch, _gpt2_tensors),
    "opt": (_opt_arch, _opt_tensors),
    "gpt_neox": (_gpt_neox_arch, _gpt_neox_tensors),
    "llama": (_llama_arch, _llama_tensors),
}


# --------------------------------------------------------------------------------------------------------- weights

class _WeightSource:
    """Tensors by Hugging Face name, as float32 NumPy arrays, read one at a time from the folder's weight files."""

    def __init__(self, folder: str):
        self.folder = folder
        self.location: dict[str, str] = {}      # tensor name -> weight file
        self.kind = ""                          # "safetensors" | "bin"
        self._open: dict[str, object] = {}      # safetensors file -> safe_open handle
        self._headers: dict[str, tuple[dict, int]] = {}
        self._bin: tuple[str, dict] | None = None
        self._find_files()

    def _find_files(self) -> None:
        for kind, single, index in (("safetensors", "model.safetensors", "model.safetensors.index.json"),
                                    ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json")):
            index_path = os.path.join(self.folder, index)
            if os.path.isfile(index_path):
                weight_map = _read_json(index_path).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index_path} has no 'weight_map'")
                self.kind = kind
                self.location = {n: os.path.join(self.folder, f) for n, f in weight_map.items()}
                for path in sorted(set(self.location.values())):
                    if not os.path.isfile(path):
                        raise CheckpointError(f"{index_path} names the shard '{os.path.basename(path)}', "
                                              f"which is not in {self.folder}")
                return
            files = [single] if os.path.isfile(os.path.join(self.folder, single)) else \
                sorted(f for f in os.listdir(self.folder)            # shards without an index
                       if f.endswith(".safetensors" if kind == "safetensors" else ".bin")
                       and (kind == "safetensors" or f.startswith("pytorch_model")))
            if files:
                self.kind = kind
                for f in files:
                    path = os.path.join(self.folder, f)
                    names = self._safetensors_header(path)[0] if kind == "safetensors" else \
                        self._load_bin(path).keys()
                    self.location.update({n: path for n in names})
                return
        raise CheckpointError(f"'{self.folder}' has no weights: expected model.safetensors, sharded safetensors "
                              f"with model.safetensors.index.json, or pytorch_model.bin")

    def getter(self, prefixes: tuple[str, ...]) -> Callable[[str], np.ndarray]:
        """get(name) tries the name under each prefix (HF checkpoints are saved with or without the base model's
        prefix, e.g. 'transformer.h.0...' or 'h.0...')."""
        return lambda name: self.get(tuple(prefix + name for prefix in prefixes))

    def get(self, candidates: tuple[str, ...]) -> np.ndarray:
        for name in candidates:
            if name in self.location:
                return self._read(name)
        raise CheckpointError(f"the weights in '{self.folder}' have no tensor '{candidates[0]}'"
                              + (f" (also tried {', '.join(repr(n) for n in candidates[1:])})"
                                 if len(candidates) > 1 else ""))

    def _read(self, name: str) -> np.ndarray:
        path = self.location[name]
        if self.kind == "bin":
            tensor = self._load_bin(path)[name].detach()
            return tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
        header, data_start = self._safetensors_header(path)
        info = header[name]
        if info["dtype"] == "BF16":
            # NumPy has no bfloat16 (safe_open(framework="np") refuses it): read the raw 16 bits and widen them;
            # bfloat16 is the top half of a float32, so this is exact and needs no torch.
            begin, end = info["data_offsets"]
            bits = np.fromfile(path, dtype="<u2", count=(end - begin) // 2, offset=data_start + begin)
            if bits.size != int(np.prod(info["shape"])):
                raise CheckpointError(f"'{path}' is truncated or corrupt: tensor '{name}' is incomplete")
            return (bits.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
        if info["dtype"] not in ("F64", "F32", "F16"):
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {info['dtype']}; only F32, F16, BF16 and F64 "
                                  f"weights can be converted (quantized checkpoints are not supported)")
        try:
            if path not in self._open:
                from safetensors import safe_open

                self._open[path] = safe_open(path, framework="np")
            return np.asarray(self._open[path].get_tensor(name), dtype=np.float32)
        except Exception as exc:   # noqa: BLE001 - safetensors raises its own SafetensorError for a bad file
            raise CheckpointError(f"cannot read tensor '{name}' from '{path}': {exc}") from None

    def _safetensors_header(self, path: str) -> tuple[dict, int]:
        """The JSON header of a .safetensors file (name -> dtype, shape, data_offsets) and where its data starts."""
        if path not in self._headers:
            try:
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"'{path}' is not a readable safetensors file ({exc})") from None
            header.pop("__metadata__", None)
            self._headers[path] = (header, 8 + size)
        return self._headers[path]

    def _load_bin(self, path: str) -> dict:
        """One pytorch_model*.bin shard at a time, memory-mapped."""
        if self._bin is None or self._bin[0] != path:
            self._bin = None
            try:
                import torch
            except ImportError:
                raise CheckpointError(f"'{path}' is a PyTorch pickle: reading it needs torch, which is not "
                                      f"installed (pip install torch), or convert the folder to safetensors "
                                      f"first") from None
            try:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:   # files from torch < 1.6 (not zip archives) cannot be memory-mapped
                    state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:   # noqa: BLE001 - torch raises many kinds for a bad file
                raise CheckpointError(f"cannot read '{path}' with torch.load: {exc}") from None
            self._bin = (path, state)
        return self._bin[1]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._open.clear()      # safe_open handles close when released
        self._bin = None
        return False


# ------------------------------------------------------------------------------------------------------- tokenizer

def _tokenizer_files(folder: str, bos_id: int, eos_ids: tuple) -> tuple | None:
    """(tokenizer.json text, chat template, bos string, eos string), or None when the folder has no tokenizer."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        text = _tokenizer_json_via_transformers(folder)
        if text is None:
            return None
    config = _read_json(os.path.join(folder, "tokenizer_config.json"), missing_ok=True)
    template = None
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    else:
        template = config.get("chat_template") or \
            _read_json(os.path.join(folder, "chat_template.json"), missing_ok=True).get("chat_template")
        if isinstance(template, list):        # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
    vocab = _id_to_token(text)
    bos = _token_string(config.get("bos_token")) or vocab.get(bos_id)
    eos = _token_string(config.get("eos_token")) or (vocab.get(eos_ids[0]) if eos_ids else None)
    return text, template, bos, eos


def _tokenizer_json_via_transformers(folder: str) -> str | None:
    """Older folders (e.g. facebook/opt-125m) ship only vocab.json + merges.txt or a SentencePiece model: let
    transformers, when installed, build the fast tokenizer and serialize it. The tokenizer is optional, so any
    failure here means "no tokenizer stored", not a failed conversion."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("vocab.json", "tokenizer.model", "vocab.txt")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder).backend_tokenizer.to_str()
    except Exception:   # noqa: BLE001 - ImportError, missing files, slow-only tokenizers, ...
        return None


def _token_string(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as serialized AddedTokens {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_to_token(tokenizer_json: str) -> dict[int, str]:
    """Added (special) tokens and, for vocabularies stored as a mapping, every token: id -> string."""
    try:
        data = json.loads(tokenizer_json)
    except ValueError:
        return {}
    table: dict[int, str] = {}
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        table.update({int(i): t for t, i in vocab.items()})
    for token in data.get("added_tokens") or []:
        table[int(token["id"])] = token["content"]
    return table

