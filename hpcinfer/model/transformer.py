"""The decoder transformer, one class for every family: the architecture's features pick the pieces.

Shape legend: T=tokens of the step (all sequences packed), S=sequences of the step, D=hidden, V=vocab.
"""

from __future__ import annotations

import numpy as np

from ..parallel.layers import Replicated, VocabParallelEmbedding
from .attention import Attention
from .mlp import MLP
from .norm import Norm
from .rotary import RotaryTable


class Block:
    def __init__(self, ops, tp, arch, index: int, dtype: str):
        prefix = f"layers.{index}"
        self.parallel_residual = arch.parallel_residual
        self.attn_norm = Norm(ops, arch, f"{prefix}.attn_norm")
        self.attn = Attention(ops, tp, arch, f"{prefix}.attn", dtype)
        self.mlp_norm = Norm(ops, arch, f"{prefix}.mlp_norm")
        self.mlp = MLP(ops, tp, arch, f"{prefix}.mlp", dtype)

    def load(self, ckpt):
        for part in (self.attn_norm, self.attn, self.mlp_norm, self.mlp):
            part.load(ckpt)

    def __call__(self, x, step, cache_k, cache_v, rope):    # x [T, D] -> [T, D]
        if self.parallel_residual:                           # GPT-NeoX: both branches read x
            return x + self.attn(self.attn_norm(x), step, cache_k, cache_v, rope) + self.mlp(self.mlp_norm(x))
        h = x + self.attn(self.attn_norm(x), step, cache_k, cache_v, rope)
        return h + self.mlp(self.mlp_norm(h))


class Decoder:
    """Embeddings, blocks, final norm and LM head. `forward` runs one step (prefill or decode, packed) and returns
    the logits of each sequence's last new token."""

    def __init__(self, ops, groups, arch, dtype: str = "float32"):
        self.ops, self.tp, self.arch, self.dtype = ops, groups.tp, arch, dtype
        self.embed = VocabParallelEmbedding(ops, self.tp, "embed.tokens", arch.vocab_size, dtype)
        self.positions = Replicated(ops, "embed.positions") if arch.position == "learned" else None
        self.rope = (RotaryTable(ops, arch.rotary_dim, arch.rope_theta, arch.max_positions)
                     if arch.position == "rotary" else None)
        self.blocks = [Block(ops, self.tp, arch, i, dtype) for i in range(arch.num_layers)]
        self.final_norm = Norm(ops, arch, "final_norm")
        self.lm_head = (self.embed if arch.tied_embeddings else
                        VocabParallelEmbedding(ops, self.tp, "lm_head.weight", arch.vocab_size, dtype))

    @property
    def kv_heads_local(self) -> int:
        return self.arch.num_kv_heads // self.tp.size

    def load(self, ckpt):
        """Read this rank's shard of every tensor."""
        self.embed.load(ckpt)
        if self.positions is not None:
            self.positions.load(ckpt)
        for block in self.blocks:
            block.load(ckpt)
        self.final_norm.load(ckpt)
        if self.lm_head is not self.embed:
            self.lm_head.load(ckpt)
        return self

    def forward(self, tokens: np.ndarray, step, cache):    # tokens [T] host ints -> logits [S, V] float32
        positions = step.positions                           # [T]
        x = self.embed.embed(tokens)                         # [T, D]
        if self.positions is not None:
            x += self.positions.value[positions]
        rope = self.rope(positions) if self.rope is not None else None
        for i, block in enumerate(self.blocks):
            x = block(x, step, cache.k[i], cache.v[i], rope)
        last = x[step.last_token_index]                      # [S, D]: only the last token of each sequence
        return self.lm_head.logits(self.final_norm(last))    # [S, V]
