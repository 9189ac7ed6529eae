"""The Ops seam: the interface every backend implements (NumPy, the spec: numpy_ops.py; CuPy: cupy_ops.py), what the
model hands it, and the helpers the implementations share. The bottom of backend/: it imports nothing of hpcinfer,
and make_ops (backend/ops.py), above the implementations, picks one.

`StepLayout` describes how the tokens of one forward step are packed: the model always sees x [T, D] with the
tokens of all sequences of the step concatenated, prefill and decode alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class StepLayout:
    """Host-side description of one step. S = sequences in the step, T = tokens in the step."""

    slots: np.ndarray    # [S] KV-cache slot of each sequence (a paged step: unused)
    starts: np.ndarray   # [S] positions already cached for each sequence (= position of its first new token)
    counts: np.ndarray   # [S] new tokens of each sequence; sum(counts) == T
    tables: np.ndarray | None = None   # paged KV cache: [S, B] int32 block tables (-1 padded), else None
    block_size: int = 0                # paged KV cache: positions per block

    @classmethod
    def build(cls, slots, starts, counts) -> "StepLayout":
        return cls(np.asarray(slots, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                   np.asarray(counts, dtype=np.int64))

    @classmethod
    def paged(cls, tables, block_size: int, starts, counts) -> "StepLayout":
        """A step over a paged KV cache (generate/paged_cache.py): sequence s's position p is row p % block_size
        of block tables[s, p // block_size] of every layer's pool."""
        return cls(np.arange(len(starts), dtype=np.int64), np.asarray(starts, dtype=np.int64),
                   np.asarray(counts, dtype=np.int64), np.asarray(tables, dtype=np.int32), int(block_size))

    @property
    def is_paged(self) -> bool:
        return self.tables is not None

    def flat_slots(self) -> np.ndarray:
        """Paged steps: [T] the pool row (block * block_size + offset) of every new token."""
        rows = np.repeat(np.arange(self.num_seqs), self.counts)                       # [T] sequence of each token
        positions = self.positions
        blocks = self.tables[rows, positions // self.block_size].astype(np.int64)
        if np.any(blocks < 0):
            raise RuntimeError("paged step: a new token's position lies past its sequence's blocks")
        return blocks * self.block_size + positions % self.block_size

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the batched decode fast path applies)."""
        return bool(np.all(self.counts == 1))

    @property
    def offsets(self) -> np.ndarray:
        """[S+1] start of each sequence's tokens in the packed token axis."""
        return np.concatenate([[0], np.cumsum(self.counts)])

    def token_range(self, s: int) -> tuple[int, int]:
        offsets = self.offsets
        return int(offsets[s]), int(offsets[s + 1])

    @property
    def positions(self) -> np.ndarray:
        """[T] absolute position of every token."""
        return np.concatenate([np.arange(a, a + n) for a, n in zip(self.starts, self.counts)] or
                              [np.zeros(0, dtype=np.int64)])

    @property
    def last_token_index(self) -> np.ndarray:
        """[S] index in the packed token axis of each sequence's last new token."""
        return np.cumsum(self.counts) - 1


@dataclass(frozen=True)
class NormParams:
    """A normalization for Ops.fused_linear to apply to its input: rms_norm or layer_norm with these values."""

    kind: str                 # "rmsnorm" | "layernorm"
    weight: object            # [in] float32
    bias: object = None       # [in] float32 (layernorm only; None = no bias)
    eps: float = 1e-5


class Ops(Protocol):
    """What the model may ask of a backend. Arrays are the backend's own (numpy.ndarray, cupy.ndarray)."""

    name: str

    def use_device(self) -> None: ...                      # bind this rank's device on the calling thread
    def asarray(self, array, dtype=None): ...
    def to_host(self, array) -> np.ndarray: ...
    def zeros(self, shape, dtype=np.float32): ...
    def copy_engine(self): ...                              # host <-> device copies (backend/transfer.py)
    def linear(self, x, w, bias=None): ...                 # x [T, in], w [out, in] -> [T, out]
    def expert_linear(self, x, w, bias=None): ...          # linear, for one expert's few routed rows
    def fused_linear(self, x, w, bias=None, norm: NormParams | None = None, act: str | None = None,
                     gated: bool = False, residual=None): ...   # act(norm(x) @ w.T + bias) + residual
    def embedding(self, table, ids): ...
    def prepare_quantized(self, qt): ...                    # QuantizedTensor -> the form linear_q reads
    def linear_q(self, x, qt, bias=None): ...               # x [T, in], qt quantized [out, in] -> [T, out]
    def embedding_q(self, qt, ids): ...
    def layer_norm(self, x, weight, bias, eps: float): ...
    def rms_norm(self, x, weight, eps: float): ...
    def activation(self, x, kind: str): ...
    def gated_activation(self, gate_up, kind: str): ...
    kv_dtype: str                                           # a float KV cache's storage: float32 / float16 / bfloat16
    def rotary(self, x, cos, sin, rotary_dim: int): ...
    def attention(self, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0,
                  rope=None): ...                           # rope (cos, sin, rotary_dim): q, k rotated first
    def bidirectional_attention(self, q, k, v, step: StepLayout, scale: float): ...  # encoder: [T,H,hd] -> [T,H*hd]
    def argmax(self, logits): ...
    def softmax(self, x): ...                                        # over the last axis
    def top_k_gating(self, logits, k: int, normalize: str): ...      # [T, E] -> experts [T, K], weights [T, K]
    def route(self, experts, weights, num_experts: int, capacity): ...   # -> moe_ops.Routing
    def permute(self, x, routing): ...                               # [T, D] -> rows grouped by expert [R, D]
    def gate_dispatch(self, logits, x, k: int, normalize: str, num_experts: int, capacity): ...  # -> routing, rows
    def unpermute(self, rows, routing, tokens: int): ...             # [R, D] -> weighted sum per token [T, D]
    def scatter_add_rows(self, out, index, rows) -> None: ...


BACKENDS = ("auto", "numpy", "cupy")                 # `[runtime] backend`


def unfused_linear(ops, x, w, bias=None, norm=None, act=None, gated=False, residual=None):
    """Ops.fused_linear as the separate ops: norm -> linear -> activation (or gated) -> + residual. NumpyOps's
    fused_linear is this sequence (bit-identical to the calls the model made one by one); CupyOps falls back to it
    where its kernels cannot run."""
    if norm is not None:
        x = (ops.rms_norm(x, norm.weight, norm.eps) if norm.kind == "rmsnorm" else
             ops.layer_norm(x, norm.weight, norm.bias, norm.eps))
    y = ops.linear(x, w, bias)
    if act is not None:
        y = ops.gated_activation(y, act) if gated else ops.activation(y, act)
    if residual is not None:               # a new array, as the model's `x + sublayer(x)` (y may be a transposed view)
        y = residual + y
    return y
