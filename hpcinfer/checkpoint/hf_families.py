"""The Hugging Face model families: for each config.json `model_type`, the ModelArch it describes and the map from
canonical tensor names to its Hugging Face tensors.

Tensors are laid out as arch.tensor_shapes says: column-parallel matrices [out, in] (what nn.Linear stores),
row-parallel matrices (attn.o, mlp.down) [in, out] (nn.Linear's transpose; GPT-2's Conv1D already stores [in, out]).
Each tensors() generator reads one source tensor at a time, so only it (and what is cut from it) is in memory.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..arch import ModelArch
from ..errors import CheckpointError
from .hf_encoders import ENCODER_FAMILIES
from .hf_weights import WeightSource

# T=tensor D=hidden H=heads Hkv=KV heads hd=head dim F=MLP width V=vocab P=positions

# transformers' ACT2FN name -> ModelArch.activation (gelu_new, gelu_fast and gelu_pytorch_tanh are the same tanh
# approximation written three ways)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}


class Config:
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



# Each family: arch(config, bos, eos) -> ModelArch and tensors(arch, config, src) -> (canonical name, array) pairs.

def _gpt2_arch(c: Config, bos: int, eos: tuple) -> ModelArch:
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


def _gpt2_tensors(arch: ModelArch, c: Config, src: WeightSource):
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


def _opt_arch(c: Config, bos: int, eos: tuple) -> ModelArch:
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


def _opt_tensors(arch: ModelArch, c: Config, src: WeightSource):
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


def _gpt_neox_arch(c: Config, bos: int, eos: tuple) -> ModelArch:
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


def _gpt_neox_tensors(arch: ModelArch, c: Config, src: WeightSource):
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


def _llama_arch(c: Config, bos: int, eos: tuple) -> ModelArch:
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


def _llama_tensors(arch: ModelArch, c: Config, src: WeightSource, dense_mlp: bool = True):
    get = src.getter(("model.", ""))
    yield "embed.tokens", get("embed_tokens.weight")
    for i in range(arch.num_layers):
        h, p = f"layers.{i}.", f"layers.{i}."
        yield p + "attn_norm.weight", get(h + "input_layernorm.weight")
        for proj in "qkv":
            yield from _linear(p + f"attn.{proj}", get, h + f"self_attn.{proj}_proj", arch.qkv_bias)
        yield from _linear(p + "attn.o", get, h + "self_attn.o_proj", arch.out_bias, transpose=True)
        yield p + "mlp_norm.weight", get(h + "post_attention_layernorm.weight")
        if not dense_mlp:
            continue
        yield from _linear(p + "mlp.gate", get, h + "mlp.gate_proj", arch.mlp_bias)
        yield from _linear(p + "mlp.up", get, h + "mlp.up_proj", arch.mlp_bias)
        yield from _linear(p + "mlp.down", get, h + "mlp.down_proj", arch.mlp_bias, transpose=True)
    yield "final_norm.weight", get("norm.weight")
    if not arch.tied_embeddings:
        yield "lm_head.weight", src.get(("lm_head.weight",))


def _mixtral_arch(c: Config, bos: int, eos: tuple) -> ModelArch:
    """Llama attention, and in every layer a top-k softmax-renormalized MoE of SiLU-gated experts."""
    import dataclasses

    E = c.need("num_local_experts")
    return dataclasses.replace(_llama_arch(c, bos, eos), family="mixtral",
                               moe_experts=(E,) * c.need("num_hidden_layers"),
                               moe_top_k=c.get("num_experts_per_tok", 2), moe_normalize="topk", mlp_bias=False)


def _mixtral_tensors(arch: ModelArch, c: Config, src: WeightSource):
    """As Llama's, with block_sparse_moe (router `gate`; experts w1 = gate, w3 = up, w2 = down) instead of mlp.
    Each expert stack [E, F, D] is assembled from its E source tensors, one layer at a time."""
    get = src.getter(("model.", ""))
    yield from _llama_tensors(arch, c, src, dense_mlp=False)
    for i in range(arch.num_layers):
        h, p = f"layers.{i}.block_sparse_moe.", f"layers.{i}.moe."
        yield p + "router.weight", get(h + "gate.weight")
        experts = range(arch.experts_in(i))
        yield p + "experts.gate.weight", np.stack([get(h + f"experts.{e}.w1.weight") for e in experts])
        yield p + "experts.up.weight", np.stack([get(h + f"experts.{e}.w3.weight") for e in experts])
        yield p + "experts.down.weight", np.stack([get(h + f"experts.{e}.w2.weight").T for e in experts])


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


FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "gpt2": (_gpt2_arch, _gpt2_tensors),
    "opt": (_opt_arch, _opt_tensors),
    "gpt_neox": (_gpt_neox_arch, _gpt_neox_tensors),
    "llama": (_llama_arch, _llama_tensors),
    "mixtral": (_mixtral_arch, _mixtral_tensors),
    **ENCODER_FAMILIES,                      # bert, roberta, distilbert (hf_encoders.py)
}
