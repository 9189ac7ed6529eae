"""The encoder transformer (BERT, RoBERTa, DistilBERT): the decoder's Block (attention, MLP, norms) run with
bidirectional attention and no KV cache, under summed token + position (+ token-type) embeddings and their
LayerNorm; no LM head. The pooler (tanh(dense(x[CLS]))) is optional.

Shape legend: T=tokens of the batch (all sequences packed), S=sequences, D=hidden.
"""

from __future__ import annotations

import numpy as np

from ..backend.interface import StepLayout
from ..parallel.layers import Replicated, VocabParallelEmbedding
from ..quant.storage import quantizing_reader
from .norm import Norm
from .transformer import Block


def encoder_layout(lengths) -> StepLayout:
    """The packed layout of a batch of whole sequences: sequence s holds lengths[s] tokens at positions 0.."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return StepLayout.build(np.arange(len(lengths)), np.zeros(len(lengths)), lengths)


class Encoder:
    def __init__(self, ops, groups, arch, dtype: str = "float32"):
        if not arch.is_encoder:
            raise ValueError(f"Encoder needs an encoder architecture (causal = false); {arch.family} is a decoder")
        self.ops, self.tp, self.arch, self.dtype = ops, groups.tp, arch, dtype
        self.embed = VocabParallelEmbedding(ops, self.tp, "embed.tokens", arch.vocab_size, dtype)
        self.positions = Replicated(ops, "embed.positions")
        self.token_types = Replicated(ops, "embed.token_types") if arch.type_vocab_size else None
        self.embed_norm = Norm(ops, arch, "embed.norm") if arch.embed_norm else None
        self.blocks = [Block(ops, groups, arch, i, dtype) for i in range(arch.num_layers)]
        self.pooler_w = Replicated(ops, "pooler.weight") if arch.pooler else None
        self.pooler_b = Replicated(ops, "pooler.bias") if arch.pooler else None

    def load(self, ckpt, quantize=None):
        """quantize: what `[model] quantize` quantizes while loading (quant.storage.load_quant's value)."""
        ckpt = quantizing_reader(ckpt, quantize)
        for part in (self.embed, self.positions, self.token_types, self.embed_norm, self.pooler_w, self.pooler_b,
                     *self.blocks):
            if part is not None:
                part.load(ckpt)
        return self

    def embed_tokens(self, tokens: np.ndarray, step: StepLayout):    # tokens [T] host ints -> x [T, D]
        x = self.embed.embed(tokens)
        x += self.positions.value[step.positions]
        if self.token_types is not None:                  # one segment: every token has type 0
            x += self.token_types.value[0]
        return self.embed_norm(x) if self.embed_norm is not None else x

    def forward(self, tokens: np.ndarray, step: StepLayout):        # tokens [T] -> hidden states [T, D]
        x = self.embed_tokens(tokens, step)
        for block in self.blocks:
            x = block(x, step, None, None, None)
        return x

    def pool(self, hidden, step: StepLayout):                        # hidden [T, D] -> [S, D]
        """The pooler: tanh(W x[CLS] + b) over each sequence's first token (BERT's pooler_output)."""
        if self.pooler_w is None:
            raise ValueError(f"this {self.arch.family} checkpoint has no pooler weights")
        first = hidden[step.offsets[:-1]]
        return self.ops.xp.tanh(self.ops.linear(first, self.pooler_w.value, self.pooler_b.value))
