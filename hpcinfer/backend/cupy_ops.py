"""CuPy Ops: every operation of NumpyOps (the spec) on the GPU, with the same signatures and float32 compute.

Storage: float32, float16 or bfloat16; every op accumulates in float32 and returns float32, as the spec does.
CuPy has no bfloat16 dtype, so a bfloat16 array lives on the device as uint16 holding its bits (the upper half of
a float32) and is widened by a 16-bit shift; `asarray` takes ml_dtypes bfloat16 host arrays, `to_host` gives them
back. On the device, uint16 always means bfloat16 bits.

This module imports without cupy: cupy is imported when a CupyOps is built. Each op launches its cuda_src/ kernel
(through hpcinfer/kernels/loader.py) when `kernels=True`, after checking layout, dtype and the kernel's
preconditions (a kernel file that is missing or does not compile is an error naming it, never a silent fallback);
otherwise (and with `kernels=False`) it runs as plain CuPy array code, which stays as the fallback and as a second
reference: tests/backend/test_cupy_ops.py holds both paths to NumpyOps. "TODO kernel" marks the ops with no kernel wired
yet.

This module holds CupyOps itself (memory, dense math, norms, activations, MoE gating, the kernel-launch helpers
`_kernel`, `_rows`, `_grid`) and its elementwise kernels. Longer op bodies live beside it as functions of the ops,
which the methods call: attention over a float KV cache and encoder attention in cupy_attention.py, a quantized
KV cache and top-k decode in cupy_kv.py, quantized weights in cupy_quant.py, SBI-GeMM and the Deep-Fusion
linears in cupy_sbi.py, the tensor-core small-batch GEMM in cupy_tc_gemm.py, MoE routing in cupy_moe.py. CUDA
graphs of decode steps (DeviceStep, DecodeGraph) are in cupy_graphs.py.

Routing tables (`route`) stay on the device (backend/cupy_moe.py); only the [E] per-expert counts come to the host.
`permute`, `unpermute` and `scatter_add_rows` accept host or device index arrays.

Shape legend: T=tokens (all sequences of a step, packed), D=hidden, H=query heads, Hkv=KV heads, hd=head dim,
S=sequences in the step, L=cached positions read, N=cache slots, Lmax=cache length, E=experts, K=top-k, R=rows.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from ..errors import ConfigError
from ..kernels.loader import kernel
from . import cupy_attention, cupy_moe, cupy_paged, cupy_quant, cupy_sbi, cupy_tc_gemm, moe_ops
from .cupy_dtypes import BF16_BITS, KV_DTYPES, c_type as _c_type, is_bf16
from .cupy_transfer import StreamCopies
from .interface import StepLayout, unfused_linear
from .numpy_ops import NumpyOps

F32 = np.float32


def _import_cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def _driver_loads() -> bool:
    """The NVIDIA driver's library loads: without it no CUDA device is usable, and the import of cupy (about 1 s
    of CPU per rank, most of it ml_dtypes) is skipped."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def gpu_available() -> bool:
    """cupy is installed and sees at least one usable CUDA device (False without cupy, driver or GPU)."""
    cupy = _import_cupy() if _driver_loads() else None
    if cupy is None:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU here", never a crash
        return False


_i32, _i64, _f32c = np.int32, np.int64, np.float32       # kernel argument types
_ACT_CODES = {"gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}     # common.cuh ACT_*


class CupyOps:
    """The Ops of one GPU. `device`: index among the visible CUDA devices (taken modulo their count, so the
    node-local rank works with one GPU per rank and with CUDA_VISIBLE_DEVICES narrowing the view); None leaves
    the current device alone and touches no GPU (make_ops uses that to check a config)."""

    name = "cupy"

    def __init__(self, device: int | None = None, kernels: bool = True, host_threads: int | None = None,
                 host_kernels: str = "numpy", kv_dtype: str = "float32"):
        cupy = _import_cupy()
        if cupy is None:
            raise ConfigError("[runtime] backend = \"cupy\" needs cupy: pip install -e '.[gpu]' (cupy-cuda12x, or "
                              "cupy-cuda13x on CUDA 13 machines); see docs/gpu.md")
        if not gpu_available():
            raise ConfigError("[runtime] backend = \"cupy\" needs a CUDA GPU, and cupy sees none here "
                              "(cupy.is_available() is False: no GPU, no driver, or CUDA_VISIBLE_DEVICES is empty); "
                              "use backend = \"numpy\" or \"auto\"")
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"CupyOps: kv_dtype = {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        self.kv_dtype = kv_dtype             # a float KV cache's storage (the stores allocate with ops.zeros)
        self.xp = cupy
        self.device_id = None
        if device is not None:
            self.device_id = int(device) % cupy.cuda.runtime.getDeviceCount()
            cupy.cuda.Device(self.device_id).use()
        self.k = _elementwise_kernels(cupy)
        self.kernels = kernels               # launch the cuda_src/ kernels (False: plain CuPy only)
        self._sm_count = None
        self._link_copies = None             # link_copies()
        self.library_calls = 0               # cuBLAS calls made (matmul): a CUDA graph cannot capture them
        # CPU delegation's attention (cupy_attention.host_attention) on the rank's BLAS threads and CPU kernels
        self.host_ops = NumpyOps(host_threads, host_kernels)

    def use_device(self) -> None:
        """Make this rank's GPU current on the calling host thread (CUDA's current device is per thread: threads
        other than the one that built the ops, e.g. offload prefetch threads, start on device 0)."""
        if self.device_id is not None:
            self.xp.cuda.Device(self.device_id).use()

    def copy_engine(self):
        """Pinned host buffers and a copy stream with events (backend/cupy_transfer.py); build it on the compute
        thread."""
        return StreamCopies(self)

    def link_copies(self):
        """The copy engine of CPU delegation's queries and outputs (cupy_attention.host_attention): one per ops,
        built on first use (on the compute thread), its pinned staging buffers reused step after step."""
        if self._link_copies is None:
            self._link_copies = StreamCopies(self)
        return self._link_copies

    # ---- memory ----------------------------------------------------------------------------------------------
    def asarray(self, array, dtype=None):
        """Host or device array -> contiguous device array (bfloat16 as uint16 bits)."""
        cp = self.xp
        if isinstance(array, cp.ndarray):
            if dtype is None:
                return cp.ascontiguousarray(array)
            if is_bf16(dtype):
                return cp.ascontiguousarray(array) if array.dtype == BF16_BITS else self.k.to_bf16(array.astype(F32))
            return cp.ascontiguousarray(self._f32(array) if array.dtype == BF16_BITS else array, dtype=dtype)
        host = np.asarray(array)
        if dtype is not None:
            host = host.astype(dtype, copy=False)
        if is_bf16(host.dtype):
            host = host.view(np.uint16)
        return cp.asarray(np.ascontiguousarray(host))

    def to_host(self, array) -> np.ndarray:
        if not isinstance(array, self.xp.ndarray):
            return np.asarray(array)
        host = array.get()
        if host.dtype == BF16_BITS:
            import ml_dtypes

            return host.view(ml_dtypes.bfloat16)
        return host

    def zeros(self, shape, dtype=F32):
        return self.xp.zeros(shape, dtype=BF16_BITS if is_bf16(dtype) else dtype)

    def _f32(self, a):
        """Any stored float (float32, float16, bfloat16 bits) -> float32 (no copy when already float32)."""
        if a.dtype == BF16_BITS:
            return self.k.bf16_to_f32(a)
        return a if a.dtype == F32 else a.astype(F32)

    def matmul(self, a, b):
        """cupy.matmul (cuBLAS), counted in `library_calls`: CuPy refuses every cuBLAS call while a stream
        captures (NotImplementedError; cupy/cupy#6290), so DecodeGraph captures only the steps whose eager warm-up
        made none. Every cuBLAS call of this backend goes through here."""
        self.library_calls += 1
        return self.xp.matmul(a, b)

    # ---- dense math --------------------------------------------------------------------------------------------
    def linear(self, x, w, bias=None):
        """x [T, in] @ w[out, in].T (+ bias [out]) -> [T, out] float32, reading w [out, in] as stored
        (backend/cupy_sbi.py says why not a re-laid copy). Kernels: tc_gemm.cu (tensor cores) for 2 .. 64 tokens
        with 16-bit weights, sbi_gemv.cu for 1 token (and float32 weights up to cupy_sbi.SBI_MAX_TOKENS); else
        cuBLAS, with half-precision weights widened per call, as NumpyOps does."""
        y = self._small_batch_linear(x, w, bias)
        if y is not None:
            return y
        y = self.matmul(self._f32(x), self._f32(w).T)
        if bias is not None:
            y += bias
        return y

    def expert_linear(self, x, w, bias=None):
        """linear, for an expert's routed rows (parallel/experts.ExpertStack: a few rows per expert at decode, 2 GEMMs
        per expert per MoE layer): the one place where the expert GEMMs pick their kernel. Today linear's (tc_gemm.cu
        for 2 .. 64 rows with 16-bit weights, sbi_gemv.cu for 1, else cuBLAS); the MoE scenario (gpu/scenarios.py
        moe) times the experts through it."""
        return self.linear(x, w, bias)

    def fused_linear(self, x, w, bias=None, norm=None, act=None, gated=False, residual=None):
        """act(norm(x) @ w.T + bias) (+ residual), the Deep-Fusion regions 1, 3 and 4 (NumpyOps.fused_linear).
        Kernels: tc_gemm.cu for 2 .. 64 tokens with 16-bit weights, fused_norm_gemv.cu / sbi_gemv.cu for 1 token
        (and float32 weights up to cupy_sbi.SBI_MAX_TOKENS); else the ops in sequence."""
        y = self._small_batch_linear(x, w, bias, norm, act, gated, residual)
        return y if y is not None else unfused_linear(self, x, w, bias, norm, act, gated, residual)

    def _small_batch_linear(self, x, w, bias=None, norm=None, act=None, gated=False, residual=None):
        """The small-batch kernels in order of preference (backend/cupy_tc_gemm.py says which takes what), or None
        (cuBLAS, or the ops in sequence)."""
        y = cupy_tc_gemm.fused_linear(self, x, w, bias, norm, act, gated, residual)
        if y is None:
            y = cupy_sbi.fused_linear(self, x, w, bias, norm, act, gated, residual)
        return y

    def prepare_quantized(self, qt):
        """A QuantizedTensor -> its device form (backend/cupy_quant.py: re-laid once for the kernels), for
        linear_q / embedding_q. Layers call this once at load."""
        return cupy_quant.to_device(qt, self.xp)

    def linear_q(self, x, qt, bias=None):
        """x [T, in] @ dequantize(qt)[out, in].T (+ bias) -> [T, out] float32 (NumpyOps.linear_q), qt as given by
        prepare_quantized. Kernels: quant_gemv.cu for T <= 16 (dequantized in registers), else quant_dequant.cu
        tiles + cuBLAS (backend/cupy_quant.py)."""
        return cupy_quant.linear_q(self, x, qt, bias)

    def embedding_q(self, qt, ids):
        """Rows `ids` of a quantized table -> [T, D] float32 (NumpyOps.embedding_q). Kernel: quant_dequant.cu."""
        return cupy_quant.embedding_q(self, qt, ids)

    def embedding(self, table, ids):
        """table [V, D], ids [T] (host or device ints) -> [T, D] float32. Kernel: embedding.cu."""
        cp = self.xp
        ids = cp.ascontiguousarray(cp.asarray(ids, dtype=np.int64))
        storage = _c_type(table.dtype)
        fn = self._kernel("embedding", "embedding", T_STORAGE=storage, T_ACT="float", BLOCK=256) if storage else None
        if fn is None or table.ndim != 2 or ids.ndim != 1:
            return self._f32(table[ids])
        table = cp.ascontiguousarray(table)
        (V, D), T = table.shape, ids.shape[0]
        out = cp.empty((T, D), dtype=F32)
        if T:
            fn((T,), (256,), (table, ids, out, _i32(T), _i32(D), _i64(0), _i64(V), _i64(D)))
        return out

    def layer_norm(self, x, weight, bias, eps: float):
        """Kernel: layer_norm.cu (fused into the next GEMV by fused_linear for a few tokens)."""
        cp = self.xp
        has_bias = bias is not None
        fn = self._kernel("layer_norm", "layer_norm", BLOCK=256, HAS_BIAS=int(has_bias))
        if fn is not None and self._row_op_ok(x, weight, bias):
            x, ldx = self._rows(x)
            y = cp.empty(x.shape, dtype=F32)
            if x.shape[0]:
                fn((x.shape[0],), (256,), (x, weight, bias if has_bias else weight, y, _i32(x.shape[1]), _i64(ldx),
                                           _i64(x.shape[1]), _f32c(eps)))
            return y
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        var = cp.mean(centered * centered, axis=-1, keepdims=True)
        y = centered * (1.0 / cp.sqrt(var + eps)).astype(F32)
        y *= weight
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x, weight, eps: float):
        """Kernel: rms_norm.cu."""
        cp = self.xp
        fn = self._kernel("rms_norm", "rms_norm", BLOCK=256)
        if fn is not None and self._row_op_ok(x, weight):
            x, ldx = self._rows(x)
            y = cp.empty(x.shape, dtype=F32)
            if x.shape[0]:
                fn((x.shape[0],), (256,), (x, weight, y, _i32(x.shape[1]), _i64(ldx), _i64(x.shape[1]),
                                           _f32c(eps)))
            return y
        ms = cp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / cp.sqrt(ms + eps)).astype(F32) * weight

    def activation(self, x, kind: str):
        """Kernel: activation.cu; fallback: CuPy elementwise kernels with the spec's formulas (gelu in float64, as
        NumPy computes it)."""
        fallback = self._activation_kernel(kind)
        fn = self._kernel("activation", "activation", ACT=_ACT_CODES[kind], BLOCK=256)
        if fn is None or x.dtype != F32:
            return fallback(x)
        x = self.xp.ascontiguousarray(x)
        y = self.xp.empty(x.shape, dtype=F32)
        if x.size:
            fn((self._grid(x.size, 256),), (256,), (x, y, _i64(x.size)))
        return y

    def gated_activation(self, gate_up, kind: str):
        """gate_up [T, 2F] (gate half first) -> act(gate) * up  [T, F]. Kernel: activation.cu."""
        f = gate_up.shape[-1] // 2
        fallback = self._gated_kernel(kind)
        fn = self._kernel("activation", "gated_activation", ACT=_ACT_CODES[kind], BLOCK=256)
        if fn is None or gate_up.dtype != F32 or gate_up.ndim != 2:
            return fallback(gate_up[:, :f], gate_up[:, f:])
        gate_up, ld = self._rows(gate_up)
        T = gate_up.shape[0]
        y = self.xp.empty((T, f), dtype=F32)
        if T * f:
            fn((self._grid(T * f, 256),), (256,), (gate_up, y, _i32(T), _i32(f), _i64(ld), _i64(f)))
        return y

    def _activation_kernel(self, kind: str):
        if kind not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {kind!r}")
        return getattr(self.k, f"act_{kind}")

    def _gated_kernel(self, kind: str):
        if kind not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {kind!r}")
        return getattr(self.k, f"gated_{kind}")

    def rotary(self, x, cos, sin, rotary_dim: int):
        """Half-split rotation of the first rotary_dim dims of each head. x [T, heads, hd]; cos, sin [T, rd/2].
        Kernel: rotary.cu."""
        cp = self.xp
        fn = self._kernel("rotary", "rotary", BLOCK=128)
        if fn is not None and x.dtype == F32 and x.ndim == 3 and cos.dtype == F32 and sin.dtype == F32:
            x, ldx = self._rows(x)
            cos, sin = cp.ascontiguousarray(cos), cp.ascontiguousarray(sin)
            T, heads, hd = x.shape
            y = cp.empty(x.shape, dtype=F32)
            if T:
                fn((T,), (128,), (x, cos, sin, y, _i32(heads), _i32(hd), _i32(rotary_dim), _i64(ldx),
                                  _i64(heads * hd)))
            return y
        half = rotary_dim // 2
        part = x[..., :rotary_dim]
        swapped = cp.concatenate([part[..., half:], part[..., :half]], axis=-1)         # [T, heads, rd]
        swapped *= cp.concatenate([-sin, sin], axis=-1)[:, None, :]
        out = cp.empty(x.shape, dtype=F32)
        cp.multiply(part, cp.concatenate([cos, cos], axis=-1)[:, None, :], out=out[..., :rotary_dim])
        out[..., :rotary_dim] += swapped
        out[..., rotary_dim:] = x[..., rotary_dim:]
        return out

    # ---- attention (backend/cupy_attention.py) ----------------------------------------------------------------
    def attention(self, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0,
                  rope=None):
        """Append k, v to the cache, then causal attention of q over each sequence's cached positions.
        q [T, H, hd]; k, v [T, Hkv, hd]; cache_k, cache_v [N, Hkv, Lmax, hd] float32 -> out [T, H*hd].
        rope = (cos [T, rd/2], sin [T, rd/2], rotary_dim): q and k rotated first, as NumpyOps.attention does; the
        decode kernels fuse it (q rotated as it is loaded, k as it is appended), other paths call self.rotary.
        Kernels: decode_attention.cu (the append fused), kv_append.cu + prefill_attention.cu. A QuantizedKV cache
        and top-k (0 < topk < 1, decode) go to backend/cupy_kv.py. A paged step (the continuous schedule's pools
        [blocks, Hkv, block_size, hd]) goes to backend/cupy_paged.py."""
        if step.is_paged:
            return cupy_paged.attention(self, q, k, v, cache_k, cache_v, step, scale, topk, rope)
        return cupy_attention.attention(self, q, k, v, cache_k, cache_v, step, scale, topk, rope)

    def bidirectional_attention(self, q, k, v, step: StepLayout, scale: float):
        """As NumpyOps.bidirectional_attention (encoders, no KV cache). q [T, H, hd], k, v [T, Hkv, hd] ->
        [T, H*hd]. Kernels: kv_append + prefill_attention.cu with CAUSAL=0."""
        return cupy_attention.bidirectional_attention(self, q, k, v, step, scale)

    # the helpers cupy_kv.py and kv_attention.py call on the ops
    _check_cache = staticmethod(cupy_attention.check_cache)

    def _decode_indices(self, step: StepLayout, lmax: int):
        return cupy_attention.decode_indices(self, step, lmax)

    def _causal_attention(self, q, k_seq, v_seq, start: int, scale: float):
        return cupy_attention.causal_attention(self, q, k_seq, v_seq, start, scale)

    # ---- mixture of experts --------------------------------------------------------------------------------
    def softmax(self, x):
        return cupy_attention.softmax(self.xp, self.xp.array(x, dtype=F32))

    def top_k_gating(self, logits, k: int, normalize: str):
        """logits [T, E] -> (experts [T, K] int64, weights [T, K] float32), on the device; same order and ties
        (lower expert first) as moe_ops.top_k_gating. Kernel: moe_gating.cu's moe_topk_gating."""
        cp = self.xp
        if logits.ndim != 2:
            raise ValueError(f"top_k_gating: logits must be [tokens, experts], got shape {logits.shape}")
        tokens, experts = logits.shape
        if not 1 <= k <= experts:
            raise ValueError(f"top_k_gating: top-k = {k} must be between 1 and the number of experts ({experts})")
        if normalize not in moe_ops.NORMALIZE:
            raise ValueError(f"top_k_gating: normalize = {normalize!r}, expected one of {moe_ops.NORMALIZE}")
        fn = self._kernel("moe_gating", "moe_topk_gating", MAX_EXPERTS=256, NWARPS=8)
        if fn is not None and experts <= 256 and logits.dtype == F32:
            logits, ld = self._rows(logits)
            chosen = cp.empty((tokens, k), dtype=np.int64)
            weights = cp.empty((tokens, k), dtype=F32)
            if tokens:
                fn((-(-tokens // 8),), (32, 8), (logits, chosen, weights, _i32(tokens), _i32(experts), _i32(k),
                                                 _i64(ld), _i32(normalize == "topk")))
            return chosen, weights
        probs = self.softmax(logits)                                                  # [T, E]
        remaining = probs.copy()
        rows = cp.arange(tokens)
        chosen = cp.empty((tokens, k), dtype=np.int64)                                # [T, K]
        for choice in range(k):
            chosen[:, choice] = cp.argmax(remaining, axis=1)
            remaining[rows, chosen[:, choice]] = -np.inf
        weights = cp.take_along_axis(probs, chosen, axis=1)                           # [T, K]
        if normalize == "topk":
            weights /= weights.sum(axis=1, keepdims=True)
        return chosen, weights

    def route(self, experts, weights, num_experts: int, capacity):
        """The routing tables, on the device (cupy_moe.DeviceRouting); one copy of the [E] counts to the host.
        Kernel: moe_gating's moe_route."""
        return cupy_moe.route(self, experts, weights, num_experts, capacity)

    def permute(self, x, routing):
        """x [T, D] -> rows [R, D] grouped by expert (a gather). Kernel: moe_permute."""
        return cupy_moe.permute(self, x, routing)

    def gate_dispatch(self, logits, x, k: int, normalize: str, num_experts: int, capacity):
        """top_k_gating + route + permute -> (routing, rows [R, D]); one launch of moe_gate_dispatch (the paper's
        fused gating kernel) for up to cupy_moe.FUSED_MAX_TOKENS tokens, else the three ops."""
        fused = (cupy_moe.gate_dispatch(self, logits, x, k, normalize, num_experts, capacity)
                 if logits.shape[0] <= cupy_moe.FUSED_MAX_TOKENS else None)
        if fused is None:
            return moe_ops.gate_and_dispatch(self, logits, x, k, normalize, num_experts, capacity)
        _, _, routing, rows = fused
        return routing, rows

    def unpermute(self, rows, routing, tokens: int):
        """rows [R, D] -> out [T, D]: per token, the sum over its kept choices (in choice order) of weight * row;
        dropped choices add nothing. A gather per choice, no atomics, as the spec. Kernel: moe_unpermute."""
        cp = self.xp
        if tokens != routing.slot.shape[0]:
            raise ValueError(f"unpermute: tokens = {tokens} but the routing is for {routing.slot.shape[0]} tokens")
        if rows.shape[0] != routing.num_rows:
            raise ValueError(f"unpermute: got {rows.shape[0]} rows for a routing of {routing.num_rows}")
        out = cp.zeros((tokens,) + rows.shape[1:], dtype=np.result_type(rows.dtype, F32))     # [T, D]
        if routing.num_rows == 0:
            return out
        row_of_choice = cp.ascontiguousarray(cp.asarray(routing.row_of_choice, dtype=np.int64))   # [T, K]
        weight_of_row = cp.ascontiguousarray(cp.asarray(routing.weight_of_row, dtype=F32))       # [R]
        fn = self._kernel("moe_gating", "moe_unpermute", MAX_EXPERTS=256, BLOCK=256)
        if fn is not None and rows.dtype == F32 and tokens:
            flat, ld = self._rows(rows.reshape(rows.shape[0], -1))                     # [R, D']
            width = flat.shape[1]
            out = out.reshape(tokens, width)
            fn((tokens,), (256,), (flat, row_of_choice, weight_of_row, out, _i32(tokens),
                                   _i32(row_of_choice.shape[1]), _i32(width), _i64(ld), _i64(width)))
            return out.reshape((tokens,) + rows.shape[1:])
        trailing = (1,) * (rows.ndim - 1)
        for choice in range(row_of_choice.shape[1]):
            row = row_of_choice[:, choice]                                            # [T]
            kept = (row >= 0).reshape(-1, *trailing)
            safe = cp.maximum(row, 0)
            contribution = rows[safe].astype(out.dtype, copy=False) * weight_of_row[safe].reshape(-1, *trailing)
            out += cp.where(kept, contribution, F32(0))
        return out

    def scatter_add_rows(self, out, index, rows) -> None:
        """out[index[i]] += rows[i] (repeated indices add up; atomics, so the order of the sums may vary)."""
        import cupyx

        cupyx.scatter_add(out, self.xp.asarray(index), rows)

    # ---- sampling helpers ----------------------------------------------------------------------------------
    def argmax(self, logits):
        return self.xp.argmax(logits, axis=-1)

    # ---- kernel launch helpers ----------------------------------------------------------------------------
    def _kernel(self, name: str, function: str, **defines):
        """The RawKernel `function` of cuda_src/{name}.cu with `defines`, or None when kernels are off
        (`kernels=False`: the caller runs plain CuPy). With kernels on, a kernel file that is missing or does not
        compile raises (kernels/loader.py: KernelSourceError, KernelCompileError, each naming the file), never a
        silent fallback. Plain CuPy with kernels on is the wrappers' own choice, for shapes, dtypes or alignments
        the kernel does not take."""
        if not self.kernels:
            return None
        return kernel(name, function, {"T_STORAGE": "float", "T_ACT": "float", **defines})

    def _rows(self, a):
        """(a, ld): `a` with its trailing dims contiguous (copied only when they are not) and the distance between
        its rows in elements, as the kernels take them."""
        item, expected = a.itemsize, a.itemsize
        ok = a.strides[0] >= 0 and a.strides[0] % item == 0
        for dim in range(a.ndim - 1, 0, -1):
            ok = ok and (a.shape[dim] == 1 or a.strides[dim] == expected)
            expected *= a.shape[dim]
        if not ok:
            a = self.xp.ascontiguousarray(a)
        row = expected // item
        return a, (a.strides[0] // item if a.shape[0] > 1 else row)

    def _row_op_ok(self, x, *params) -> bool:
        """x [T, D] float32 and each given parameter a contiguous float32 [D] (norm weights and biases)."""
        if x.ndim != 2 or x.dtype != F32:
            return False
        return all(p is None or (p.dtype == F32 and p.shape == (x.shape[1],) and p.flags.c_contiguous) for p in params)

    def _grid(self, work: int, block: int) -> int:
        """Blocks for a grid-stride loop: enough for the work, capped at 32 waves of the device's SMs."""
        if self._sm_count is None:
            self._sm_count = self.xp.cuda.Device().attributes["MultiProcessorCount"]
        return max(1, min(-(-work // block), 32 * self._sm_count))


_ACTIVATIONS = {   # f({x}) in CUDA C; gelu in double, as NumPy evaluates it (x / np.sqrt(2.0) is float64)
    "gelu": "(float)(0.5 * (double){x} * (1.0 + erf((double){x} / 1.4142135623730951)))",
    "gelu_tanh": "0.5f * {x} * (1.0f + tanhf(0.7978845608028654f * ({x} + 0.044715f * {x} * {x} * {x})))",
    "relu": "fmaxf({x}, 0.0f)",
    "silu": "{x} / (1.0f + expf(-{x}))",
}


class _Kernels:
    """Elementwise CuPy kernels (compiled on first use, per device, by CuPy)."""


@cache
def _elementwise_kernels(cp):
    k = _Kernels()
    for kind, formula in _ACTIVATIONS.items():
        setattr(k, f"act_{kind}", cp.ElementwiseKernel("float32 x", "float32 y", f"y = {formula.format(x='x')}",
                                                       f"hpcinfer_act_{kind}"))
        setattr(k, f"gated_{kind}", cp.ElementwiseKernel("float32 g, float32 u", "float32 y",
                                                         f"y = ({formula.format(x='g')}) * u",
                                                         f"hpcinfer_gated_{kind}"))
    k.bf16_to_f32 = cp.ElementwiseKernel("uint16 b", "float32 y",
                                         "y = __uint_as_float(((unsigned int)b) << 16)", "hpcinfer_bf16_to_f32")
    k.to_bf16 = cp.ElementwiseKernel(   # round to nearest even, as ml_dtypes; NaN stays NaN
        "float32 x", "uint16 b",
        "unsigned int u = __float_as_uint(x);"
        "b = isnan(x) ? (unsigned short)0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)",
        "hpcinfer_f32_to_bf16")
    # One decode token per sequence: k, v [S, Hkv, hd] into cache[slots[s], :, starts[s]] ([N, Hkv, Lmax, hd]).
    k.kv_append = cp.ElementwiseKernel(
        "raw float32 k, raw float32 v, raw int64 slots, raw int64 starts, int64 hkv, int64 lmax, int64 hd",
        "raw float32 cache_k, raw float32 cache_v",
        """
        long long s = i / (hkv * hd), h = (i / hd) % hkv, d = i % hd;
        long long dst = ((slots[s] * hkv + h) * lmax + starts[s]) * hd + d;
        cache_k[dst] = k[i];
        cache_v[dst] = v[i];
        """, "hpcinfer_kv_append")
    return k
