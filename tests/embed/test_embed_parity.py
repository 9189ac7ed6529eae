"""Encoders against Hugging Face transformers on the same weights, single rank: per-token hidden states (1e-4),
mean-pooled L2-normalized embeddings (cosine > 0.99999) and the pooler, on a batch of mixed-length real sentences;
for tiny random BERT, RoBERTa and DistilBERT models and for the real all-MiniLM-L6-v2 (`make minilm`)."""

import numpy as np
import pytest

from encoder_models import (ENCODER_FAMILIES, MINILM, SENTENCES, hf_hidden_states, hf_pooler, load_hf_encoder,
                            mean_pool, minilm_available, save_tiny_encoder)
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.embed.api import embed_texts, hidden_states, load_encoder

needs_minilm = pytest.mark.skipif(not minilm_available(), reason=f"needs {MINILM} (run `make minilm`)")


def _check(folder, model, tokenizer, hf_model=None):
    sequences = [tokenizer.encode(t) for t in SENTENCES]
    assert len({len(s) for s in sequences}) >= 5                     # mixed lengths in one packed batch
    ours = hidden_states(model, sequences)
    ref = hf_hidden_states(folder, sequences, hf_model)
    assert max(np.abs(a - b).max() for a, b in zip(ours, ref)) < 1e-4
    pooled = embed_texts(model, tokenizer, SENTENCES)                 # [S, D], L2-normalized
    cosine = np.sum(pooled * mean_pool(ref), axis=1)
    assert cosine.min() > 0.99999
    return sequences


@pytest.fixture(scope="module", params=ENCODER_FAMILIES)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = save_tiny_encoder(request.param, root / "hf")
    convert_hf(folder, str(root / "model.h5"))
    model, tokenizer = load_encoder(str(root / "model.h5"))
    return folder, model, tokenizer


def test_tiny_encoder_matches_transformers(tiny):
    folder, model, tokenizer = tiny
    sequences = _check(folder, model, tokenizer)
    if model.arch.pooler:                                             # bert, roberta
        ours = embed_texts(model, tokenizer, SENTENCES, pooling="pooler", normalize=False)
        assert np.abs(ours - hf_pooler(folder, sequences)).max() < 1e-4


def test_cls_pooling_is_the_first_token_state(tiny):
    folder, model, tokenizer = tiny
    ref = hf_hidden_states(folder, [tokenizer.encode(t) for t in SENTENCES])
    ours = embed_texts(model, tokenizer, SENTENCES, pooling="cls", normalize=False)   # [S, D]
    assert np.abs(ours - np.stack([r[0] for r in ref])).max() < 1e-4
    normalized = embed_texts(model, tokenizer, SENTENCES, pooling="cls")
    assert np.allclose(normalized, ours / np.linalg.norm(ours, axis=1, keepdims=True), atol=1e-6)


def test_tiny_encoder_arch(tiny):
    _, model, _ = tiny
    arch = model.arch
    assert arch.is_encoder and arch.norm_position == "post" and arch.embed_norm
    assert arch.type_vocab_size == {"bert": 2, "roberta": 1, "distilbert": 0}[arch.family]
    assert arch.max_positions == 160                                 # roberta: 162 rows minus pad + 1 = 2


@needs_minilm
def test_minilm_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    _, tokenizer = load_encoder(_minilm_h5())
    hf = AutoTokenizer.from_pretrained(str(MINILM))
    for text in SENTENCES + ["x " * 600]:
        assert tokenizer.encode(text, 256) == hf(text, truncation=True, max_length=256)["input_ids"]
    assert tokenizer.encode("") == [101, 102]                         # an empty text is [CLS] [SEP]


@needs_minilm
def test_minilm_matches_transformers_and_sentence_transformers():
    model, tokenizer = load_encoder(_minilm_h5())
    _check(str(MINILM), model, tokenizer, load_hf_encoder(MINILM))


@needs_minilm
def test_minilm_paraphrases_score_higher_than_unrelated_pairs():
    model, tokenizer = load_encoder(_minilm_h5())
    v = embed_texts(model, tokenizer, ["A man is eating food.", "A man is eating a piece of bread.",
                                       "The girl is carrying a baby.", "A cheetah is running behind its prey."])
    paraphrase, unrelated = float(v[0] @ v[1]), max(float(v[0] @ v[2]), float(v[0] @ v[3]))
    assert paraphrase > unrelated + 0.2, (paraphrase, unrelated)


_CACHE = {}


def _minilm_h5() -> str:
    """models/minilm.h5 when `make minilm` made it, else one converted for this session."""
    made = MINILM.parent / "minilm.h5"
    if made.is_file():
        return str(made)
    if "h5" not in _CACHE:
        import tempfile

        _CACHE["h5"] = tempfile.mkdtemp(prefix="hpcinfer-minilm-") + "/minilm.h5"
        convert_hf(str(MINILM), _CACHE["h5"])
    return _CACHE["h5"]
