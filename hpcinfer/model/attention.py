"""Self-attention: column-parallel fused QKV (heads split across tp), rotary, KV-cache attention, row-parallel
output projection. Shape legend: T=tokens, D=hidden, H/Hkv=local query/KV heads, hd=head dim."""

from __future__ import annotations

import math

from ..parallel.layers import ColumnParallelLinear, RowParallelLinear


class Attention:
    def __init__(self, ops, tp, arch, prefix: str, dtype: str, topk: float = 0.0):
        self.ops, self.arch = ops, arch
        self.heads = arch.num_heads // tp.size
        self.kv_heads = arch.num_kv_heads // tp.size
        self.head_dim = arch.head_dim
        self.scale = 1.0 / math.sqrt(arch.head_dim)
        self.topk = float(topk)                              # top-k sparse decode attention (0 = dense)
        self.qkv = ColumnParallelLinear(ops, tp, [f"{prefix}.{p}" for p in "qkv"],
                                        [arch.q_size, arch.kv_size, arch.kv_size], arch.qkv_bias, dtype)
        self.out = RowParallelLinear(ops, tp, f"{prefix}.o", arch.q_size, arch.out_bias, dtype)

    def load(self, ckpt):
        self.qkv.load(ckpt)
        self.out.load(ckpt)

    def __call__(self, x, step, cache_k, cache_v, rope, norm=None, residual=None):   # x [T, D] -> [T, D]
        """attn(norm(x)) (+ residual): norm and residual run inside the QKV and output projections."""
        T, hd = x.shape[0], self.head_dim
        qkv = self.qkv(x, norm)                              # [T, (H + 2 Hkv) hd]
        k_end = (self.heads + self.kv_heads) * hd
        qk = qkv[:, :k_end].reshape(T, self.heads + self.kv_heads, hd)
        rope = None if rope is None else (*rope, self.arch.rotary_dim)
        if rope is not None and not self.arch.causal:        # q and k heads rotate together, in one call
            qk, rope = self.ops.rotary(qk, *rope), None
        q, k = qk[:, :self.heads], qk[:, self.heads:]
        v = qkv[:, k_end:].reshape(T, self.kv_heads, hd)
        if self.arch.causal:                                 # rotary inside (fused into the GPU decode kernels)
            ctx = self.ops.attention(q, k, v, cache_k, cache_v, step, self.scale, self.topk, rope)   # [T, H hd]
        else:                                                # an encoder: no cache, whole sequences
            ctx = self.ops.bidirectional_attention(q, k, v, step, self.scale)
        return self.out(ctx, residual)
