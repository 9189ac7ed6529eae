"""The Hugging Face encoder families (BERT incl. MiniLM, RoBERTa, DistilBERT): their ModelArch and tensor maps,
as hf_families.py does for the decoders (same layouts: column-parallel [out, in], row-parallel [in, out]).

All three are post-norm encoders with learned absolute positions, an embedding LayerNorm and a GELU MLP;
BERT and RoBERTa add a token-type table and (when the weights hold one) a pooler. RoBERTa's position table starts
at padding_idx + 1: rows below are never used, so they are cut off here and row p is position p, as for OPT.
"""

from __future__ import annotations

import os

from ..arch import ModelArch
from ..errors import CheckpointError
from .hf_weights import WeightSource

# T=tensor D=hidden H=heads F=MLP width V=vocab P=positions


def _has_tensor(c, names: tuple[str, ...]) -> bool:
    """Whether the folder's weights hold any of `names` (headers only; decides optional parts like the pooler)."""
    with WeightSource(os.path.dirname(os.path.abspath(c.path))) as src:
        return any(name in src.location for name in names)


def _bert_like_arch(c, family: str, bos: int, eos: tuple, position_offset: int, prefix: str) -> ModelArch:
    c.refuse_if(c.get("position_embedding_type", "absolute") != "absolute",
                f"position_embedding_type = {c.get('position_embedding_type')!r} (only 'absolute')")
    c.refuse_if(bool(c.get("is_decoder", False)), "is_decoder is true (a causal BERT)")
    D, H = c.need("hidden_size"), c.need("num_attention_heads")
    positions = c.need("max_position_embeddings") - position_offset
    return ModelArch(family=family, vocab_size=c.need("vocab_size"), hidden_size=D,
                     num_layers=c.need("num_hidden_layers"), num_heads=H, num_kv_heads=H, head_dim=D // H,
                     intermediate_size=c.need("intermediate_size"), max_positions=positions, norm="layernorm",
                     norm_eps=float(c.get("layer_norm_eps", 1e-12)), position="learned",
                     activation=c.activation("hidden_act", "gelu"), qkv_bias=True, out_bias=True, mlp_bias=True,
                     bos_token_id=bos, eos_token_ids=eos, causal=False, norm_position="post",
                     type_vocab_size=int(c.get("type_vocab_size", 2)), embed_norm=True,
                     pooler=_has_tensor(c, (prefix + "pooler.dense.weight", "pooler.dense.weight")))


def _bert_arch(c, bos: int, eos: tuple) -> ModelArch:
    return _bert_like_arch(c, "bert", bos, eos, 0, "bert.")


def roberta_position_offset(c) -> int:
    """RoBERTa numbers positions from padding_idx + 1 (create_position_ids_from_input_ids)."""
    return int(c.get("pad_token_id", 1)) + 1


def _roberta_arch(c, bos: int, eos: tuple) -> ModelArch:
    return _bert_like_arch(c, "roberta", bos, eos, roberta_position_offset(c), "roberta.")


def _bert_like_tensors(arch: ModelArch, c, src: WeightSource, prefix: str, position_offset: int = 0):
    get = src.getter((prefix, ""))
    e = "embeddings."
    yield "embed.tokens", get(e + "word_embeddings.weight")
    table = get(e + "position_embeddings.weight")                                  # [P + offset, D]
    yield "embed.positions", _position_rows(table, position_offset, arch.max_positions, src.folder)
    yield "embed.token_types", get(e + "token_type_embeddings.weight")
    yield "embed.norm.weight", get(e + "LayerNorm.weight")
    yield "embed.norm.bias", get(e + "LayerNorm.bias")
    for i in range(arch.num_layers):
        h, p = f"encoder.layer.{i}.", f"layers.{i}."
        for proj, name in zip("qkv", ("query", "key", "value")):
            yield from _linear(p + f"attn.{proj}", get, h + f"attention.self.{name}")
        yield from _linear(p + "attn.o", get, h + "attention.output.dense", transpose=True)
        yield from _norm(p + "attn_norm", get, h + "attention.output.LayerNorm")
        yield from _linear(p + "mlp.up", get, h + "intermediate.dense")
        yield from _linear(p + "mlp.down", get, h + "output.dense", transpose=True)
        yield from _norm(p + "mlp_norm", get, h + "output.LayerNorm")
    if arch.pooler:
        yield from _linear("pooler", get, "pooler.dense")


def _bert_tensors(arch: ModelArch, c, src: WeightSource):
    yield from _bert_like_tensors(arch, c, src, "bert.")


def _roberta_tensors(arch: ModelArch, c, src: WeightSource):
    yield from _bert_like_tensors(arch, c, src, "roberta.", roberta_position_offset(c))


def _distilbert_arch(c, bos: int, eos: tuple) -> ModelArch:
    D, H = c.need("dim"), c.need("n_heads")
    return ModelArch(family="distilbert", vocab_size=c.need("vocab_size"), hidden_size=D,
                     num_layers=c.need("n_layers"), num_heads=H, num_kv_heads=H, head_dim=D // H,
                     intermediate_size=c.need("hidden_dim"), max_positions=c.need("max_position_embeddings"),
                     norm="layernorm", norm_eps=1e-12,                  # DistilBERT's LayerNorms are built eps=1e-12
                     position="learned", activation=c.activation("activation", "gelu"), qkv_bias=True,
                     out_bias=True, mlp_bias=True, bos_token_id=bos, eos_token_ids=eos, causal=False,
                     norm_position="post", type_vocab_size=0, embed_norm=True, pooler=False)


def _distilbert_tensors(arch: ModelArch, c, src: WeightSource):
    get = src.getter(("distilbert.", ""))
    yield "embed.tokens", get("embeddings.word_embeddings.weight")
    yield "embed.positions", get("embeddings.position_embeddings.weight")
    yield "embed.norm.weight", get("embeddings.LayerNorm.weight")
    yield "embed.norm.bias", get("embeddings.LayerNorm.bias")
    for i in range(arch.num_layers):
        h, p = f"transformer.layer.{i}.", f"layers.{i}."
        for proj in "qkv":
            yield from _linear(p + f"attn.{proj}", get, h + f"attention.{proj}_lin")
        yield from _linear(p + "attn.o", get, h + "attention.out_lin", transpose=True)
        yield from _norm(p + "attn_norm", get, h + "sa_layer_norm")
        yield from _linear(p + "mlp.up", get, h + "ffn.lin1")
        yield from _linear(p + "mlp.down", get, h + "ffn.lin2", transpose=True)
        yield from _norm(p + "mlp_norm", get, h + "output_layer_norm")


def _position_rows(table, offset: int, positions: int, folder: str):
    if table.shape[0] < offset + positions:
        raise CheckpointError(f"{folder}: the position table has {table.shape[0]} rows, expected "
                              f"{offset + positions} (max_position_embeddings)")
    return table[offset:offset + positions]


def _norm(canonical: str, get, hf: str):
    yield canonical + ".weight", get(hf + ".weight")
    yield canonical + ".bias", get(hf + ".bias")


def _linear(canonical: str, get, hf: str, transpose: bool = False):
    """nn.Linear [out, in] (+ bias): as stored for column-parallel, transposed to [in, out] for row-parallel."""
    w = get(hf + ".weight")
    yield canonical + ".weight", w.T if transpose else w
    yield canonical + ".bias", get(hf + ".bias")


ENCODER_FAMILIES = {
    "bert": (_bert_arch, _bert_tensors),
    "roberta": (_roberta_arch, _roberta_tensors),
    "distilbert": (_distilbert_arch, _distilbert_tensors),
}
