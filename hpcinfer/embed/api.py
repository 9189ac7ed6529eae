"""A small Python API over the encoder, for tests, notebooks and benchmarks.

    model, tokenizer = load_encoder("models/minilm.h5")         # one process, NumPy backend (groups= for tp)
    vectors = embed_texts(model, tokenizer, ["A man is eating food.", "Hi"])   # [S, D], mean pooled, L2 = 1
    states = hidden_states(model, [[101, 7592, 102], [101, 102]])            # [[n_s, D]] per sequence
"""

from __future__ import annotations

import numpy as np

from ..backend.ops import make_ops
from ..checkpoint.format import open_checkpoint
from ..comm.group import Groups
from ..model.encoder import Encoder, encoder_layout
from .inputs import EmbedInput, EncoderTokenizer
from .job import embed_batch


def load_encoder(path: str, groups: Groups | None = None, dtype: str = "float32",
                 backend: str = "numpy") -> tuple[Encoder, EncoderTokenizer | None]:
    with open_checkpoint(path) as ckpt:
        text = ckpt.tokenizer_json()
        model = Encoder(make_ops(backend), groups or Groups(), ckpt.arch, dtype).load(ckpt)
    return model, (EncoderTokenizer(text) if text is not None else None)


def hidden_states(model: Encoder, sequences: list) -> list[np.ndarray]:
    """Last hidden states of each token sequence, the batch run packed: [[n_s, D]] float32."""
    step = encoder_layout([len(s) for s in sequences])
    hidden = model.ops.to_host(model.forward(np.concatenate([np.asarray(s, np.int64) for s in sequences]), step))
    return [hidden[a:b] for a, b in zip(step.offsets[:-1], step.offsets[1:])]


def embed_texts(model: Encoder, tokenizer: EncoderTokenizer, texts: list[str], pooling: str = "mean",
                normalize: bool = True, max_length: int = 512) -> np.ndarray:
    """Embeddings of texts as one batch (truncated to max_length tokens): [S, D] (pooling none: a list)."""
    items = [EmbedInput(str(i), tokenizer.encode(t, max_length), i) for i, t in enumerate(texts)]
    rows = embed_batch(model, items, pooling, normalize)
    return rows if pooling == "none" else np.stack(rows)
