"""The decoder transformer, one class for every family: the architecture's features pick the pieces.

Shape legend: T=tokens of the step (all sequences packed), S=sequences of the step, D=hidden, V=vocab.
"""

from __future__ import annotations

import numpy as np

from ..parallel.layers import Replicated, VocabParallelEmbedding
from ..parallel.stages import StageSpec
from ..quant.storage import quantizing_reader
from .attention import Attention
from .mlp import MLP
from .moe import MoE
from .norm import Norm
from .rotary import RotaryTable


class Block:
    def __init__(self, ops, groups, arch, index: int, dtype: str, capacity_factor: float | None = None,
                 topk: float = 0.0):
        prefix = f"layers.{index}"
        self.parallel_residual = arch.parallel_residual
        self.post_norm = arch.norm_position == "post"
        self.attn_norm = Norm(ops, arch, f"{prefix}.attn_norm")
        self.attn = Attention(ops, groups.tp, arch, f"{prefix}.attn", dtype, topk)
        self.mlp_norm = Norm(ops, arch, f"{prefix}.mlp_norm")
        self.mlp = (MoE(ops, groups, arch, index, dtype, capacity_factor) if arch.experts_in(index) else
                    MLP(ops, groups.tp, arch, f"{prefix}.mlp", dtype))

    def load(self, ckpt):
        for part in (self.attn_norm, self.attn, self.mlp_norm, self.mlp):
            part.load(ckpt)

    def __call__(self, x, step, cache_k, cache_v, rope):    # x [T, D] -> [T, D]
        if self.post_norm:                                   # BERT: the norm after each residual sum
            # the residual adds run in the epilogue of the output projections (as below); the norms stay apart
            h = self.attn_norm(self.attn(x, step, cache_k, cache_v, rope, residual=x))     # norm(x + attn(x))
            return self.mlp_norm(self.mlp(h, residual=h))                                 # norm(h + mlp(h))
        # Deep-Fusion: each norm runs inside the projection after it and each residual add in the epilogue of the
        # projection before it (one kernel each on the GPU for a few tokens; the same ops in sequence on NumPy).
        h = self.attn(x, step, cache_k, cache_v, rope, norm=self.attn_norm, residual=x)   # x + attn(attn_norm(x))
        y = x if self.parallel_residual else h               # GPT-NeoX: both branches read x
        if isinstance(self.mlp, MoE):                        # no fused entry: norm, experts, add
            return h + self.mlp(self.mlp_norm(y))
        return self.mlp(y, norm=self.mlp_norm, residual=h)   # h + mlp(mlp_norm(y))


class Decoder:
    """Embeddings, blocks, final norm and LM head -- or, on a pipeline stage, the part of them that stage holds.
    `embed_tokens`, `run_layers` and `logits` are the three pieces a stage may run; `forward` runs all three.

    Built whole: kv_format is `[model] kv_cache` (a quant.kv.KVFormat, None = float32; the generate loop builds
    its caches so), attention_topk `[generate] attention_topk` (fraction of cached positions each decode query
    keeps; 0 = dense), and weights, when the weights are offloaded, a function of the blocks that makes their
    weight source (offload.tiers.WeightTiers: run_layers fetches and releases each layer's weights around it)."""

    def __init__(self, ops, groups, arch, dtype: str = "float32", stage: StageSpec | None = None,
                 capacity_factor: float | None = None, *, kv_format=None, attention_topk: float = 0.0,
                 weights=None):
        self.ops, self.tp, self.arch, self.dtype = ops, groups.tp, arch, dtype
        self.stage = stage or StageSpec(0, 1, 0, arch.num_layers)
        first, last = self.stage.is_first, self.stage.is_last
        self.embed = VocabParallelEmbedding(ops, self.tp, "embed.tokens", arch.vocab_size, dtype) if first else None
        self.positions = Replicated(ops, "embed.positions") if first and arch.position == "learned" else None
        self.rope = (RotaryTable(ops, arch.rotary_dim, arch.rope_theta, arch.max_positions)
                     if arch.position == "rotary" else None)
        self.blocks = [Block(ops, groups, arch, i, dtype, capacity_factor, attention_topk)
                       for i in self.stage.layers]
        self.weights = weights(self.blocks) if weights is not None else None    # None: every weight on the device
        self.kv_format = kv_format                            # quant.kv.KVFormat of the KV caches; None = float32
        self.final_norm = Norm(ops, arch, "final_norm") if last else None
        self.lm_head = None
        if last:                                      # tied: the first stage's table, or the last stage's own copy
            head_name = "embed.tokens" if arch.tied_embeddings else "lm_head.weight"
            self.lm_head = (self.embed if first and arch.tied_embeddings else
                            VocabParallelEmbedding(ops, self.tp, head_name, arch.vocab_size, dtype))

    def set_attention(self, kv_format=None, topk: float = 0.0) -> "Decoder":
        """Change the KV format and top-k attention of this model in place (the constructor's kv_format and
        attention_topk) and return it: for trying one loaded model with several settings (tests, notebooks).
        `hpcinfer run` builds its model with them instead."""
        self.kv_format = kv_format
        for block in self.blocks:
            block.attn.topk = float(topk)
        return self

    @property
    def kv_heads_local(self) -> int:
        return self.arch.num_kv_heads // self.tp.size

    @property
    def num_local_layers(self) -> int:
        return len(self.blocks)

    def load(self, ckpt, after_block=None, quantize=None):
        """Read this rank's shard of the tensors of its stage. `after_block(i)` runs once block i is loaded (the
        offload tiers move its weights out before the next one is read). quantize: what `[model] quantize`
        quantizes while loading (quant.storage.load_quant's value; None: nothing)."""
        ckpt = quantizing_reader(ckpt, quantize)
        parts = [self.embed, self.positions, self.final_norm]
        if self.lm_head is not self.embed:
            parts.append(self.lm_head)
        for part in parts:
            if part is not None:
                part.load(ckpt)
        for i, block in enumerate(self.blocks):
            block.load(ckpt)
            if after_block is not None:
                after_block(i)
        return self

    def embed_tokens(self, tokens: np.ndarray, step):      # tokens [T] host or backend ints -> x [T, D]
        x = self.embed.embed(tokens)
        if self.positions is not None:
            x += self.positions.value[step.positions]
        return x

    def rope_for(self, step):
        return self.rope(step.positions) if self.rope is not None else None

    def run_layer(self, i: int, x, step, cache, rope):       # local layer i: x [T, D] -> [T, D] (zig-zag's order)
        return self.blocks[i](x, cache.layer_step(i, step), cache.k[i], cache.v[i], rope)

    def run_layers(self, x, step, cache):                     # x [T, D] -> [T, D]
        rope = self.rope_for(step)
        for i, block in enumerate(self.blocks):
            if self.weights is not None:                      # streamed weights (offload/tiers.py)
                self.weights.fetch(i)
            x = block(x, cache.layer_step(i, step), cache.k[i], cache.v[i], rope)      # (run_layer, one frame less)
            if self.weights is not None:
                self.weights.release(i)
        return x

    def logits(self, x, step):                                # x [T, D] -> [S, V]: each sequence's last token
        last = x if step.is_decode else x[step.last_token_index]   # decode: one token per sequence, no gather
        return self.lm_head.logits(self.final_norm(last))

    def forward(self, tokens: np.ndarray, step, cache):      # the whole model (one stage): tokens [T] -> [S, V]
        return self.logits(self.run_layers(self.embed_tokens(tokens, step), step, cache), step)
