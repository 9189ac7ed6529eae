"""Tiny random-weight Hugging Face encoders (BERT, RoBERTa, DistilBERT), built offline with a tokenizer trained
on a little standard-library prose, and what `transformers` answers for them; plus the real MiniLM folder.

A helper module for tests (not a test file).

    folder = save_tiny_encoder("bert", tmp_path / "bert")     # config.json, model.safetensors, tokenizer.json
    states = hf_hidden_states(folder, [[101, 5, 6, 102], [101, 7, 102]])   # list of [n_i, D] float32

Sizes (V=vocab D=hidden L=layers H=heads F=MLP width P=max positions):
    bert        V=200 D=64 L=2 H=4 F=128 P=160 WordPiece, 2 token types, pooler, gelu
    roberta     V=260 D=64 L=2 H=4 F=96  P=160 byte-level BPE, positions offset by pad + 1 = 2, pooler
    distilbert  V=200 D=64 L=2 H=4 F=128 P=160 WordPiece, no token types, no pooler
Weights are re-drawn as tests/helpers/hf_models.py does (biases and norm weights far from 0 and 1).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hf_models import _rescale

ENCODER_FAMILIES = ("bert", "roberta", "distilbert")
SEED = 4321
MINILM = Path(__file__).resolve().parents[2] / "models" / "all-MiniLM-L6-v2"
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "Two men pushed carts through the woods and then sat down by a river "
             "to talk about what they had seen on the way there.", "Hi", ""]


def minilm_available() -> bool:
    return (MINILM / "model.safetensors").is_file()


def _config(family: str):
    from transformers import BertConfig, DistilBertConfig, RobertaConfig

    common = dict(attn_implementation="eager")
    if family == "bert":
        return BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=160, type_vocab_size=2,
                          hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0, **common)
    if family == "roberta":
        return RobertaConfig(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=96, max_position_embeddings=162, type_vocab_size=1,
                             hidden_act="gelu", layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
                             eos_token_id=2, **common)
    if family == "distilbert":
        return DistilBertConfig(vocab_size=200, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                max_position_embeddings=160, activation="gelu", pad_token_id=0, **common)
    raise ValueError(f"unknown tiny encoder family {family!r}; choose one of {', '.join(ENCODER_FAMILIES)}")


def _corpus() -> list[str]:
    import pydoc_data.topics as topics

    text = " ".join(list(topics.topics.values())[:40])
    return [line for line in text.splitlines() if line.strip()][:2000] + SENTENCES


def _tokenizer(family: str, vocab_size: int):
    """A WordPiece (BERT-style, [CLS] x [SEP]) or byte-level BPE (RoBERTa-style, <s> x </s>) tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if family == "roberta":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = ["<s>", "<pad>", "</s>", "<unk>"]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_corpus(), trainer)
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        return tok
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(_corpus(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def save_tiny_encoder(family: str, folder) -> str:
    """Build a tiny random float32 encoder of `family` with its tokenizer, save it, return the folder."""
    import torch
    from transformers import AutoModel

    config = _config(family)
    torch.manual_seed(SEED)
    model = AutoModel.from_config(config, dtype=torch.float32, attn_implementation="eager")
    _rescale(model)
    folder = os.fspath(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tok = _tokenizer(family, config.vocab_size)
    assert tok.get_vocab_size() <= config.vocab_size, tok.get_vocab_size()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def load_hf_encoder(folder):
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(os.fspath(folder), dtype=torch.float32, attn_implementation="eager").eval()


def hf_hidden_states(folder, sequences: list[list[int]], model=None) -> list[np.ndarray]:
    """Last hidden states of each sequence, the batch padded right with an attention mask (as an embedding
    job would batch it): a list of [n_i, D] float32. RoBERTa's position ids come from the pad id, so the pad
    id used is the config's."""
    import torch

    model = model or load_hf_encoder(folder)
    pad = model.config.pad_token_id or 0
    L = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in sequences], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    return [out[i, :len(s)].astype(np.float32) for i, s in enumerate(sequences)]


def hf_pooler(folder, sequences: list[list[int]]) -> np.ndarray:
    """BERT's pooler_output (tanh(dense(x[CLS]))) of each sequence, run alone: [S, D]."""
    import torch

    model = load_hf_encoder(folder)
    with torch.no_grad():
        return np.stack([model(input_ids=torch.tensor([s])).pooler_output[0].numpy() for s in sequences])


def mean_pool(states: list[np.ndarray], normalize: bool = True) -> np.ndarray:
    """sentence-transformers' mean pooling over the tokens, then L2 normalization: [S, D]."""
    pooled = np.stack([s.mean(axis=0) for s in states])
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True) if normalize else pooled
