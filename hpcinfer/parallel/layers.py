"""Sharded layers: each is built at its local size and owns the rule for reading its shard of the checkpoint.

Stored layouts put the split dimension first (arch.tensor_shapes), so every shard is one contiguous block of
rows: column-parallel weights are stored [out, in], row-parallel ones [in, out], vocab tables [V, D].
Shape legend: T=tokens, S=sequences, D=hidden, V=vocab, Vs=vocab rows per tp rank.
"""

from __future__ import annotations

import math

import numpy as np

from ..comm.mappings import gather_from_tp, reduce_from_tp
from ..quant.formats import concat_rows, pad_rows
from ..quant.storage import load_matrix


def weight_dtype(name: str) -> np.dtype:
    """Storage dtype of weights in compute memory: float32, float16 or bfloat16 (ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def read_rows_into(ckpt, name: str, rows: slice, out: np.ndarray) -> None:
    """out[...] = the tensor's leading rows `rows`, read straight into `out` when the file stores its dtype (no
    intermediate copy), else through one block read and a cast: loading holds this rank's shard plus at most one
    tensor (docs/checkpoint-format.md)."""
    if hasattr(ckpt, "read_into") and weight_dtype(ckpt.dtype) == out.dtype and out.flags.c_contiguous:
        ckpt.read_into(name, rows, out)
    else:
        out[...] = ckpt.read(name, rows)


def even_shard(total: int, parts: int, index: int) -> slice:
    """Rows of shard `index` when `total` splits evenly into `parts` (checked when the config is validated)."""
    assert total % parts == 0, (total, parts)
    n = total // parts
    return slice(index * n, (index + 1) * n)


def vocab_shard(vocab: int, parts: int, index: int) -> tuple[int, int, int]:
    """(start, stop, rows_per_rank): every rank holds ceil(V / parts) rows, the last ones zero-padded, so
    vocabularies that do not divide (GPT-2's 50257) work."""
    per = math.ceil(vocab / parts)
    start = min(index * per, vocab)
    return start, min(start + per, vocab), per


def weight_bytes(layer) -> int:
    """Bytes of weights a sharded layer holds: its quantized arrays (`qw` / `qtable`: q, scale, min) plus its float
    matrix (`w` / `table`). A loaded layer holds one of the two; both are counted so that a float copy kept next
    to a quantized one would show."""
    held = [getattr(layer, name, None) for name in ("qw", "qtable", "w", "table")]
    return sum(int(a.nbytes) for a in held if a is not None)


class Replicated:
    """A tensor every rank holds whole (norm weights, biases of row-parallel layers, position tables)."""

    def __init__(self, ops, name: str, dtype=np.float32):
        self.ops, self.name, self.dtype = ops, name, dtype
        self.value = None

    def load(self, ckpt):
        self.value = self.ops.asarray(ckpt.read(self.name).astype(self.dtype, copy=False))
        return self.value


class ColumnParallelLinear:
    """y[:, local outputs] = x @ W[:, local outputs] (+ b). Several parts (q, k, v or gate, up) are fused into one
    matmul: each part is split across tp on its own and the local slices are concatenated in part order."""

    def __init__(self, ops, tp, names: list[str], out_sizes: list[int], bias: bool, dtype: str):
        self.ops, self.tp, self.names, self.out_sizes = ops, tp, names, out_sizes
        self.bias, self.dtype = bias, weight_dtype(dtype)
        self.local_sizes = [n // tp.size for n in out_sizes]
        self.w = self.b = None                                    # w [sum(local_sizes), in]
        self.qw = None                                            # a QuantizedTensor instead of w, when quantized

    def load(self, ckpt):
        rows = [even_shard(n, self.tp.size, self.tp.rank) for n in self.out_sizes]
        parts = [load_matrix(ckpt, f"{name}.weight", rows=r) for name, r in zip(self.names, rows)]
        if all(p is not None for p in parts):
            self.qw = self.ops.prepare_quantized(concat_rows(parts))
        else:                                                     # each part read into its rows of w: no concat copy
            w = np.empty((sum(self.local_sizes), ckpt.shape(f"{self.names[0]}.weight")[1]), self.dtype)
            starts = np.cumsum([0] + self.local_sizes)
            for name, r, a, b in zip(self.names, rows, starts[:-1], starts[1:]):
                read_rows_into(ckpt, f"{name}.weight", r, w[a:b])
            self.w = self.ops.asarray(w)
        if self.bias:
            b = np.concatenate([ckpt.read(f"{name}.bias", r) for name, r in zip(self.names, rows)])
            self.b = self.ops.asarray(b.astype(np.float32, copy=False))

    def __call__(self, x, norm=None, act=None, gated=False):      # x [T, in] -> [T, sum(local_sizes)]
        """act(norm(x) @ W^T + b); gated: act(gate) * up -> [T, local F]. The norm (a model Norm) and act run
        inside the matmul's kernel (Ops.fused_linear) when there is one of them to fuse and w is dense."""
        fused = getattr(self.ops, "fused_linear", None)
        if self.qw is None and fused is not None and (norm is not None or act is not None):
            return fused(x, self.w, self.b, norm=None if norm is None else norm.params, act=act, gated=gated)
        if norm is not None:
            x = norm(x)
        y = self.ops.linear(x, self.w, self.b) if self.qw is None else self.ops.linear_q(x, self.qw, self.b)
        if act is not None:
            y = self.ops.gated_activation(y, act) if gated else self.ops.activation(y, act)
        return y


class RowParallelLinear:
    """y = sum over tp of x[:, local inputs] @ W[local inputs, :], then + b: one all-reduce per call."""

    def __init__(self, ops, tp, name: str, in_size: int, bias: bool, dtype: str):
        self.ops, self.tp, self.name, self.in_size = ops, tp, name, in_size
        self.bias, self.dtype = bias, weight_dtype(dtype)
        self.w = self.b = None                                    # w [out, in_local]
        self.qw = None                                            # a QuantizedTensor [out, in_local] instead

    def load(self, ckpt):
        rows = even_shard(self.in_size, self.tp.size, self.tp.rank)
        self.qw = load_matrix(ckpt, f"{self.name}.weight", cols=rows,        # groups never cross the shard
                              row_max=lambda m: self.tp.all_gather(np.ascontiguousarray(m)).max(axis=0))
        if self.qw is not None:
            self.qw = self.ops.prepare_quantized(self.qw)
        else:
            block = ckpt.read(f"{self.name}.weight", rows)            # stored [in_local, out]
            w = np.empty(block.shape[::-1], self.dtype)               # [out, in_local]: one transposing copy
            w[...] = block.T
            del block
            self.w = self.ops.asarray(w)
        if self.bias:
            self.b = self.ops.asarray(ckpt.read(f"{self.name}.bias").astype(np.float32, copy=False))

    def __call__(self, x, residual=None):                         # x [T, in_local] -> [T, out]
        """x @ W^T + b (+ residual). With tp == 1 the bias and residual add run in the matmul's epilogue
        (Ops.fused_linear, Deep-Fusion region 4); with tp > 1 the all-reduce sits between the matmul and them."""
        fused = getattr(self.ops, "fused_linear", None)
        if residual is not None and self.tp.size == 1 and self.qw is None and fused is not None:
            return fused(x, self.w, self.b, residual=residual)
        local = self.ops.linear(x, self.w) if self.qw is None else self.ops.linear_q(x, self.qw)
        y = reduce_from_tp(local, self.tp)
        if self.b is not None:
            y += self.b
        return y if residual is None else residual + y


class VocabParallelEmbedding:
    """Token embedding split by vocabulary rows; also the (tied or separate) vocab-parallel LM head."""

    def __init__(self, ops, tp, name: str, vocab: int, dtype: str):
        self.ops, self.tp, self.name, self.vocab = ops, tp, name, vocab
        self.dtype = weight_dtype(dtype)
        self.start, self.stop, self.rows = vocab_shard(vocab, tp.size, tp.rank)
        self.table = None                                         # [Vs, D], zero rows past `stop`
        self.qtable = None                                        # a QuantizedTensor [Vs, D] instead, when quantized

    def load(self, ckpt):
        qt = load_matrix(ckpt, self.name, rows=slice(self.start, self.stop))
        if qt is not None:
            self.qtable = self.ops.prepare_quantized(pad_rows(qt, self.rows))
            return
        table = np.zeros((self.rows, ckpt.shape(self.name)[1]), self.dtype)     # [Vs, D], the padding rows zero
        read_rows_into(ckpt, self.name, slice(self.start, self.stop), table[:self.stop - self.start])
        self.table = self.ops.asarray(table)

    def embed(self, ids):                                         # ids [T] (host or backend ints) -> [T, D]
        lookup = (self.ops.embedding if self.qtable is None else
                  lambda _, rows: self.ops.embedding_q(self.qtable, rows))
        if self.tp.size == 1:
            return lookup(self.table, ids)
        xp, ids = self.ops.xp, self.ops.asarray(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        out = lookup(self.table, xp.where(mine, local, 0))
        out = xp.where(mine[:, None], out, np.float32(0))          # not a masked write: no host sync (CUDA graphs)
        return reduce_from_tp(out, self.tp)

    def logits(self, x):                                          # x [S, D] -> [S, V] on every tp rank
        local = (self.ops.linear(x, self.table) if self.qtable is None else
                 self.ops.linear_q(x, self.qtable))               # [S, Vs]
        return gather_from_tp(local, self.tp, self.ops.xp)[:, :self.vocab]
