"""NumpyOps.attention with `[runtime] cpu_kernels = "numba"`: the compiled kernels of cpu_kernels/attention.py
over whatever KV store the step uses, read in place (docs/cpu-attention.md).

Every store is handed to the kernels as a pool read through block tables:
  - the dense cache [N, Hkv, Lmax, hd] (static schedule, NumPy's slot store): one block of Lmax positions per
    sequence, the table of sequence s is [its slot];
  - the paged pool [NB, Hkv, bs, hd] (continuous schedule): the step's own tables;
  - either as float32 or quant.kv.QuantizedKV (int8 / int4 rows and their float16 scale and min).
The kernels attend the cached positions through the table and the step's new rows as given (float32, as the NumPy
paths do for a quantized store), then the new rows are stored: appended as NumpyOps does (quantized by the store
when it is a QuantizedKV). No gather, no dequantized copy, no dense scratch.

Decode tokens of a step with 0 < topk < 1 (one new token: the static schedule's decode steps and a continuous
step's decode rows) take the top-k kernel; every other sequence the causal one (as backend/kv_attention.py and
paged_attention.dense_parts split them). A split cache (FlexGen's CPU delegation over rows) goes through
kv_attention.split_attention, whose host part comes back here.

Shape legend: T=tokens, S=sequences, H=query heads, Hkv=KV heads, hd=head dim.
"""

from __future__ import annotations

import numpy as np

from ..quant.kv import kv_rows
from . import cpu_kernels, kv_attention, paged_attention
from .interface import StepLayout

if cpu_kernels.NUMBA_ERROR is None:       # the numpy setting never needs numba (cpu_kernels.resolve checks the rest)
    import numba
    from .cpu_kernels import attention as kernels
else:
    numba = kernels = None

F32 = np.float32


def attention(ops, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0):
    """As NumpyOps.attention: q [T, H, hd]; k, v [T, Hkv, hd]; caches dense [N, Hkv, Lmax, hd] or paged
    [NB, Hkv, bs, hd], float32 or QuantizedKV -> [T, H*hd]; k, v end up stored in the caches."""
    if isinstance(cache_k, kv_attention.SplitRows):
        return kv_attention.split_attention(ops, q, k, v, cache_k, cache_v, step, scale, topk, ops.attention)
    q, k, v = (np.ascontiguousarray(a, dtype=F32) for a in (q, k, v))
    kv_heads = k.shape[1]
    plan = paged_attention.step_memo(ops, step, ("compiled", kv_heads, 0 < topk < 1),
                                     lambda: Plan(step, kv_heads, topk, cache_k.shape[2]))
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
    k_rows = kv_rows(cache_k)
    k_pool, v_pool, group = k_rows.kernel_arrays(), kv_rows(cache_v).kernel_arrays(), k_rows.group
    threads = kernel_threads(ops.threads)
    numba.set_num_threads(threads)
    if len(plan.causal):
        kernels.causal_attention(q, k, v, k_pool, v_pool, group, plan.tables, plan.starts, plan.counts, plan.offsets,
                                 plan.causal, F32(scale), out, threads)
    if len(plan.top_k):
        kernels.top_k_attention(q, k, v, k_pool, v_pool, group, plan.tables, plan.starts, plan.offsets,
                                plan.top_k, plan.keep, F32(scale), out, threads)
    store(ops, k, v, cache_k, cache_v, step)
    return out


class Plan:
    """What the kernels read of a step, made once per step (every layer gets the same StepLayout): the tables as
    int32 [S, B], starts, counts, offsets as int64, and the work items of each kernel."""

    def __init__(self, step: StepLayout, kv_heads: int, topk: float, cached: int):
        self.starts, self.counts = step.starts.astype(np.int64), step.counts.astype(np.int64)
        self.offsets = step.offsets.astype(np.int64)
        if step.is_paged:
            self.tables = np.ascontiguousarray(step.tables, dtype=np.int32)
        else:                                               # the dense cache: one block per slot, of Lmax positions
            ends = self.starts + self.counts
            if len(ends) and int(ends.max()) > cached:
                raise ValueError(f"attention: positions up to {int(ends.max())} do not fit a KV cache of {cached}")
            self.tables = step.slots.astype(np.int32)[:, None].copy()
        sparse = (self.counts == 1) if 0 < topk < 1 else np.zeros(len(self.counts), dtype=bool)
        self.causal = _items(self.starts, self.counts, ~sparse, kv_heads)
        self.top_k = _items(self.starts, self.counts, sparse, kv_heads)
        self.keep = kv_attention.keep_counts(self.starts + 1, topk) if sparse.any() else self.counts


def _items(starts, counts, chosen, kv_heads: int) -> np.ndarray:
    """The work items of the chosen sequences, numbered as in the step."""
    rows = np.flatnonzero(chosen)
    items = kernels.make_items(starts[rows], counts[rows], kv_heads)
    items[:, 0] = rows[items[:, 0]]
    return items


def store(ops, k, v, cache_k, cache_v, step: StepLayout) -> None:
    """The step's new rows into the store (quantized there when it is quantized), after the kernels read it."""
    if step.is_paged:
        paged_attention.paged_append(cache_k, cache_v, paged_attention.step_memo(ops, step, "slots", step.flat_slots),
                                     k, v)
    else:
        ops._append_kv(k, v, cache_k, cache_v, step)


def kernel_threads(threads: int) -> int:
    """The rank's threads ([runtime] threads), as many as Numba's pool has (NUMBA_NUM_THREADS, the cores)."""
    return max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))
