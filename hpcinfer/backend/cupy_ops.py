"""CuPy Ops: every operation of NumpyOps (the spec) on the GPU, with the same signatures and float32 compute.

Storage: float32, float16 or bfloat16; every op accumulates in float32 and returns float32, as the spec does.
CuPy has no bfloat16 dtype, so a bfloat16 array lives on the device as uint16 holding its bits (the upper half of
a float32) and is widened by a 16-bit shift; `asarray` takes ml_dtypes bfloat16 host arrays, `to_host` gives them
back. On the device, uint16 always means bfloat16 bits.

This module imports without cupy: cupy is imported when a CupyOps is built. Each op launches its cuda_src/ kernel
(through hpcinfer/kernels/loader.py) when the kernel file exists and `kernels=True`, after checking layout, dtype and
the kernel's preconditions; otherwise (and with `kernels=False`) it runs as plain CuPy array code, which stays as
the fallback and as a second reference: tests/test_cupy_ops.py holds both paths to NumpyOps. "TODO kernel" marks
the ops with no kernel wired yet.

Routing tables (`route`) stay on the device (backend/cupy_moe.py); only the [E] per-expert counts come to the host.
`permute`, `unpermute` and `scatter_add_rows` accept host or device index arrays.

Shape legend: T=tokens (all sequences of a step, packed), D=hidden, H=query heads, Hkv=KV heads, hd=head dim,
S=sequences in the step, L=cached positions read, N=cache slots, Lmax=cache length, E=experts, K=top-k, R=rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ..errors import ConfigError
from . import cupy_moe, cupy_quant, cupy_sbi, moe_ops
from .ops import StepLayout

F32 = np.float32
BF16_BITS = np.dtype(np.uint16)          # device dtype of bfloat16 storage


def _import_cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def gpu_available() -> bool:
    """cupy is installed and sees at least one usable CUDA device (False without cupy, driver or GPU)."""
    cupy = _import_cupy()
    if cupy is None:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU here", never a crash
        return False


def _is_bf16(dtype) -> bool:
    return dtype is not None and np.dtype(dtype).name == "bfloat16"


def _c_type(dtype) -> str | None:
    """The kernels' T_STORAGE for a device dtype (uint16 holds bfloat16 bits); None for any other dtype."""
    return {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16"}.get(np.dtype(dtype).name)


@cache
def _kernel_file_exists(name: str) -> bool:
    from ..kernels.loader import CUDA_SRC

    return (CUDA_SRC / f"{name}.cu").is_file()


_i32, _i64, _f32c = np.int32, np.int64, np.float32       # kernel argument types
_ACT_CODES = {"gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}     # common.cuh ACT_*


@dataclass(frozen=True)
class DeviceStep(StepLayout):
    """A decode step whose slots and starts also live in device buffers, with a fixed number of cached positions
    read (`kv_len`, a bucket >= every sequence's length). `attention` then reads no host metadata, so the step can
    be captured in a CUDA graph and replayed with new values written into the same buffers (DecodeGraph)."""

    slots_d: object = None       # [S] int64 device
    starts_d: object = None      # [S] int64 device
    kv_len: int = 0

    @property
    def positions(self):
        """[S] int64 device: one new token per sequence, at its start (the model's rotary and learned-position
        lookups then gather on the device from the graph's own buffer)."""
        return self.starts_d


class CupyOps:
    """The Ops of one GPU. `device`: index among the visible CUDA devices (taken modulo their count, so the
    node-local rank works with one GPU per rank and with CUDA_VISIBLE_DEVICES narrowing the view); None leaves
    the current device alone and touches no GPU (make_ops uses that to check a config)."""

    name = "cupy"

    def __init__(self, device: int | None = None, kernels: bool = True):
        cupy = _import_cupy()
        if cupy is None:
            raise ConfigError("[runtime] backend = \"cupy\" needs cupy: pip install -e '.[gpu]' (cupy-cuda12x, or "
                              "cupy-cuda13x on CUDA 13 machines); see docs/gpu.md")
        if not gpu_available():
            raise ConfigError("[runtime] backend = \"cupy\" needs a CUDA GPU, and cupy sees none here "
                              "(cupy.is_available() is False: no GPU, no driver, or CUDA_VISIBLE_DEVICES is empty); "
                              "use backend = \"numpy\" or \"auto\"")
        self.xp = cupy
        self.device_id = None
        if device is not None:
            self.device_id = int(device) % cupy.cuda.runtime.getDeviceCount()
            cupy.cuda.Device(self.device_id).use()
        self.k = _elementwise_kernels(cupy)
        self.kernels = kernels               # launch cuda_src/ kernels where they exist (False: plain CuPy only)
        self._sm_count = None

    # ---- memory ----------------------------------------------------------------------------------------------
    def asarray(self, array, dtype=None):
        """Host or device array -> contiguous device array (bfloat16 as uint16 bits)."""
        cp = self.xp
        if isinstance(array, cp.ndarray):
            if dtype is None:
                return cp.ascontiguousarray(array)
            if _is_bf16(dtype):
                return cp.ascontiguousarray(array) if array.dtype == BF16_BITS else self.k.to_bf16(array.astype(F32))
            return cp.ascontiguousarray(self._f32(array) if array.dtype == BF16_BITS else array, dtype=dtype)
        host = np.asarray(array)
        if dtype is not None:
            host = host.astype(dtype, copy=False)
        if _is_bf16(host.dtype):
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
        return self.xp.zeros(shape, dtype=BF16_BITS if _is_bf16(dtype) else dtype)

    def _f32(self, a):
        """Any stored float (float32, float16, bfloat16 bits) -> float32 (no copy when already float32)."""
        if a.dtype == BF16_BITS:
            return self.k.bf16_to_f32(a)
        return a if a.dtype == F32 else a.astype(F32)

    # ---- dense math --------------------------------------------------------------------------------------------
    def linear(self, x, w, bias=None):
        """x [T, in] @ w[out, in].T (+ bias [out]) -> [T, out] float32. Kernel: sbi_gemv.cu for T <= cupy_sbi.SBI_MAX_TOKENS,
        reading w [out, in] as stored (backend/cupy_sbi.py says why not a re-laid copy); else cuBLAS, with
        half-precision weights widened per call, as NumpyOps does."""
        y = cupy_sbi.fused_linear(self, x, w, bias)
        if y is not None:
            return y
        y = self.xp.matmul(self._f32(x), self._f32(w).T)
        if bias is not None:
            y += bias
        return y

    def fused_linear(self, x, w, bias=None, norm=None, act=None, gated=False, residual=None):
        """act(norm(x) @ w.T + bias) (+ residual), the Deep-Fusion regions 1, 3 and 4 (NumpyOps.fused_linear).
        Kernel: fused_norm_gemv.cu / sbi_gemv.cu for T <= cupy_sbi.SBI_MAX_TOKENS; else the ops in sequence."""
        y = cupy_sbi.fused_linear(self, x, w, bias, norm, act, gated, residual)
        return y if y is not None else cupy_sbi.unfused_linear(self, x, w, bias, norm, act, gated, residual)

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

    # ---- attention over the KV cache -----------------------------------------------------------------------
    def attention(self, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0):
        """Append k, v to the cache, then causal attention of q over each sequence's cached positions.
        q [T, H, hd]; k, v [T, Hkv, hd]; cache_k, cache_v [N, Hkv, Lmax, hd] float32 -> out [T, H*hd].
        Kernels: decode_attention.cu (the append fused), kv_append.cu + prefill_attention.cu. A QuantizedKV cache
        and top-k (0 < topk < 1, decode) go to backend/cupy_kv.py."""
        cp = self.xp
        if topk or not isinstance(cache_k, cp.ndarray):          # a QuantizedKV cache, or top-k: cupy_kv.py
            from . import cupy_kv

            return cupy_kv.attention(self, q, k, v, cache_k, cache_v, step, scale, topk)
        if step.num_tokens == 0:
            return cp.zeros((0, q.shape[1] * q.shape[2]), dtype=F32)
        self._check_cache(cache_k, cache_v)
        if int((step.starts + step.counts).max()) > cache_k.shape[2]:
            raise ValueError(f"attention: positions up to {int((step.starts + step.counts).max())} do not fit a "
                             f"cache of {cache_k.shape[2]}")
        heads, kv_heads, hd = q.shape[1], cache_k.shape[1], q.shape[2]
        kernel_shapes = (q.dtype == k.dtype == v.dtype == F32 and heads % kv_heads == 0 and hd <= 128)
        if step.is_decode:
            slots, starts, L = self._decode_indices(step, cache_k.shape[2])
            fn = self._kernel("decode_attention", "decode_attention", NWARPS=4, MAX_HEAD_DIM=128, MAX_GROUP=8)
            if fn is not None and kernel_shapes and heads // kv_heads <= 8:
                (q, ldq), (k, ldk), (v, ldv) = self._rows(q), self._rows(k), self._rows(v)
                S = q.shape[0]
                out = cp.empty((S, heads * hd), dtype=F32)
                fn((kv_heads, S), (32, 4), (q, k, v, cache_k, cache_v, slots, starts, out, _i32(heads),
                                            _i32(kv_heads), _i32(hd), _i32(cache_k.shape[2]), _i64(ldq), _i64(ldk),
                                            _i64(ldv), _i64(heads * hd), _f32c(scale)))
                return out
            self.k.kv_append(cp.ascontiguousarray(k, dtype=F32), cp.ascontiguousarray(v, dtype=F32), slots, starts,
                             cache_k.shape[1], cache_k.shape[2], cache_k.shape[3], cache_k, cache_v, size=k.size)
            return self._decode_attention(q, cache_k, cache_v, slots, starts, L, step, scale)
        append = self._kernel("kv_append", "kv_append", BLOCK=128)
        attend = self._kernel("prefill_attention", "prefill_attention", NWARPS=4, ROWS_PER_WARP=4,
                              MAX_HEAD_DIM=128, KT=32)
        if append is not None and attend is not None and kernel_shapes and heads // kv_heads <= 16:
            return self._prefill_kernels(append, attend, q, k, v, cache_k, cache_v, step, scale)
        out = cp.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
        for s in range(step.num_seqs):
            a, b = step.token_range(s)
            slot, start = int(step.slots[s]), int(step.starts[s])
            cache_k[slot, :, start:start + b - a] = k[a:b].transpose(1, 0, 2)
            cache_v[slot, :, start:start + b - a] = v[a:b].transpose(1, 0, 2)
            out[a:b] = self._causal_attention(q[a:b], cache_k[slot], cache_v[slot], start, scale)
        return out

    def _prefill_kernels(self, append, attend, q, k, v, cache_k, cache_v, step: StepLayout, scale: float):
        """kv_append then prefill_attention over packed sequences (offsets [S+1] on the device)."""
        cp = self.xp
        heads, kv_heads, hd, lmax = q.shape[1], cache_k.shape[1], q.shape[2], cache_k.shape[2]
        S, most = step.num_seqs, int(step.counts.max())
        slots, starts = cp.asarray(step.slots, dtype=np.int64), cp.asarray(step.starts, dtype=np.int64)
        offsets = cp.asarray(step.offsets, dtype=np.int64)                              # [S + 1]
        (q, ldq), (k, ldk), (v, ldv) = self._rows(q), self._rows(k), self._rows(v)
        append((most, S), (128,), (k, v, cache_k, cache_v, slots, starts, offsets, _i32(kv_heads), _i32(hd),
                                   _i32(lmax), _i64(ldk), _i64(ldv)))
        out = cp.empty((q.shape[0], heads * hd), dtype=F32)
        per_block = 16 // (heads // kv_heads)                                           # (NWARPS * ROWS_PER_WARP) / g
        attend((kv_heads, -(-most // per_block), S), (32, 4),
               (q, cache_k, cache_v, slots, starts, offsets, out, _i32(heads), _i32(kv_heads), _i32(hd), _i32(lmax),
                _i64(ldq), _i64(heads * hd), _f32c(scale)))
        return out

    @staticmethod
    def _check_cache(cache_k, cache_v):
        for array in (cache_k, cache_v):
            if array.dtype != F32 or not array.flags.c_contiguous:
                raise ValueError(f"attention: the KV cache must be contiguous float32, got {array.dtype} "
                                 f"(contiguous: {array.flags.c_contiguous})")

    def _decode_indices(self, step: StepLayout, lmax: int):
        """(slots [S], starts [S] as device int64, positions read L): a DeviceStep's own buffers and bucket, or
        the host layout's uploaded with L = the longest sequence."""
        if isinstance(step, DeviceStep) and step.slots_d is not None:
            return step.slots_d, step.starts_d, min(int(step.kv_len), lmax)
        cp = self.xp
        return (cp.asarray(step.slots, dtype=np.int64), cp.asarray(step.starts, dtype=np.int64),
                int(step.starts.max()) + 1)

    def _decode_attention(self, q, cache_k, cache_v, slots, starts, L: int, step: StepLayout, scale: float):
        """One new token per sequence, batched: q [S, H, hd] -> [S, H*hd]. Reads no host value when `step` is a
        DeviceStep (graph-capturable)."""
        cp = self.xp
        S, heads, hd = q.shape
        kv_heads = cache_k.shape[1]
        first = int(step.slots[0]) if not isinstance(step, DeviceStep) else -1
        if first >= 0 and np.array_equal(step.slots, np.arange(first, first + S)):   # a view, no copy
            keys, values = cache_k[first:first + S, :, :L], cache_v[first:first + S, :, :L]
        else:
            keys, values = cache_k[slots, :, :L], cache_v[slots, :, :L]              # [S, Hkv, L, hd]
        qg = (q * F32(scale)).reshape(S, kv_heads, heads // kv_heads, hd)             # [S, Hkv, g, hd]
        scores = cp.matmul(qg, keys.transpose(0, 1, 3, 2))                            # [S, Hkv, g, L]
        visible = cp.arange(L)[None, :] < (starts + 1)[:, None]                      # [S, L]
        scores += cp.where(visible, F32(0), F32(-np.inf))[:, None, None, :]
        out = cp.matmul(_softmax(cp, scores), values)                                 # [S, Hkv, g, hd]
        return out.reshape(S, heads * hd)

    def _causal_attention(self, q, k_seq, v_seq, start: int, scale: float):
        """One sequence: q [n, H, hd] at positions start..start+n-1; k_seq, v_seq [Hkv, Lmax, hd] -> [n, H*hd]."""
        cp = self.xp
        n, heads, hd = q.shape
        kv_heads = k_seq.shape[0]
        group, length = heads // kv_heads, start + n
        qg = (q * F32(scale)).transpose(1, 0, 2).reshape(kv_heads, group * n, hd)    # [Hkv, g*n, hd]
        scores = cp.matmul(qg, k_seq[:, :length].transpose(0, 2, 1)).reshape(kv_heads, group, n, length)
        if n > 1:
            future = cp.arange(length)[None, :] > (start + cp.arange(n))[:, None]   # [n, L]
            scores += cp.where(future, F32(-np.inf), F32(0))
        probs = _softmax(cp, scores).reshape(kv_heads, group * n, length)
        out = cp.matmul(probs, v_seq[:, :length])                                     # [Hkv, g*n, hd]
        return out.reshape(heads, n, hd).transpose(1, 0, 2).reshape(n, heads * hd)

    # ---- encoder attention (no KV cache) ----------------------------------------------------------------------
    def bidirectional_attention(self, q, k, v, step: StepLayout, scale: float):
        """As NumpyOps.bidirectional_attention. q [T, H, hd], k, v [T, Hkv, hd] -> [T, H*hd]. Kernels: kv_append
        packs each sequence's K and V into a scratch cache [S, Hkv, L, hd], then prefill_attention.cu with
        CAUSAL=0 (tiled online softmax, no [S, H, L, L] scores); CuPy array code where the kernels do not fit."""
        cp = self.xp
        T, heads, hd = q.shape
        append = self._kernel("kv_append", "kv_append", BLOCK=128)
        attend = self._kernel("prefill_attention", "prefill_attention", NWARPS=4, ROWS_PER_WARP=4,
                              MAX_HEAD_DIM=128, KT=32, CAUSAL=0)
        kv_heads = k.shape[1]
        if (T and append is not None and attend is not None and q.dtype == k.dtype == v.dtype == F32 and
                heads % kv_heads == 0 and heads // kv_heads <= 16 and hd <= 128):
            S, L = step.num_seqs, int(step.counts.max())
            packed = StepLayout.build(np.arange(S), np.zeros(S), step.counts)        # slot s, from position 0
            cache_k, cache_v = (cp.empty((S, kv_heads, L, hd), dtype=F32) for _ in range(2))
            return self._prefill_kernels(append, attend, q, k, v, cache_k, cache_v, packed, scale)
        lengths = step.counts
        S, L = len(lengths), int(lengths.max()) if len(lengths) else 0
        if T == 0:
            return cp.zeros((0, heads * hd), dtype=F32)
        ragged = bool(np.any(lengths != L))
        if ragged:
            index = cp.asarray(np.minimum(step.offsets[:-1, None] + np.arange(L)[None, :], T - 1))   # [S, L]
            valid = cp.asarray(np.arange(L)[None, :] < lengths[:, None])
            q, k, v = q[index], k[index], v[index]                                 # [S, L, H, hd]
        q, k, v = (a.reshape(S, L, heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))   # [S, H, L, hd]
        scores = cp.matmul(q * F32(scale), k.transpose(0, 1, 3, 2))                # [S, H, L, L]
        if ragged:
            scores += cp.where(valid, F32(0), F32(-np.inf))[:, None, None, :]
        out = cp.matmul(_softmax(cp, scores), v).transpose(0, 2, 1, 3).reshape(S, L, heads * hd)
        return out[valid] if ragged else out.reshape(T, heads * hd)

    # ---- mixture of experts --------------------------------------------------------------------------------
    def softmax(self, x):
        return _softmax(self.xp, self.xp.array(x, dtype=F32))

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
        """The RawKernel of cuda_src/{name}.cu, or None when kernels are off or that file does not exist (a compile
        error is raised, not hidden)."""
        if not self.kernels or not _kernel_file_exists(name):
            return None
        from ..kernels.loader import kernel

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


def _softmax(cp, scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    cp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


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


# ------------------------------------------------------------------------------------------------- CUDA graphs

def kv_bucket(length: int, smallest: int = 64) -> int:
    """Positions a captured decode step reads: the next power of two >= length (at least `smallest`), so a
    generation of n tokens needs about log2(n) graphs per batch size."""
    bucket = smallest
    while bucket < length:
        bucket *= 2
    return bucket


@dataclass
class _Captured:
    graph: object
    inputs: dict                 # name -> static device buffer the graph reads
    slots: object                # [S] int64 static device buffer
    starts: object               # [S] int64 static device buffer
    output: object               # static device buffer the graph writes


class DecodeGraph:
    """Capture a decode step once per (batch size, KV-length bucket) with CUDA stream capture; replay it after
    copying the new inputs into the captured (static) buffers.

    `step_fn(inputs, step)` must compute the step from device arrays only: `inputs` (name -> device array, same
    shapes and dtypes at every call of one key) and `step` (a DeviceStep: its device slots/starts and kv_len are
    what attention reads; its host fields hold the capture-time values and must not steer the computation).
    Constraints (checked by CUDA at capture, where possible):
    - no host <-> device copy, no host sync (`int(x)`, boolean masks, `.get()`, `cupy.asarray(numpy)`) inside:
      the model reads the step's positions from `DeviceStep.positions` (device; rotary and learned positions
      gather on the device), the token ids from `inputs`, and takes no last-token gather in a decode step
      (generate/graphs.py drives it; tests/test_cuda_graphs.py checks it on the CPU fake of cupy);
    - the step must be idempotent for equal inputs: the first call runs it eagerly (a warm-up that compiles
      kernels and lets cuBLAS allocate), then captures, then replays, so the KV append happens twice at the same
      position with the same values;
    - collectives inside are allowed only over NCCL (they are captured on the capture stream; every rank of the
      communicator must replay the same graphs in the same order, which holds when all tp ranks step together);
      MPI calls (comm = "mpi") cannot be captured;
    - memory allocated during capture comes from a pool private to this object and stays reserved while it
      lives; the returned output is a static buffer, overwritten by the next replay of the same key.
    """

    def __init__(self, ops: CupyOps, smallest_bucket: int = 64):
        cp = ops.xp
        self.ops, self.smallest_bucket = ops, smallest_bucket
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.captured: dict[tuple, _Captured] = {}

    def key(self, starts) -> tuple[int, int]:
        starts = np.asarray(starts)
        return len(starts), kv_bucket(int(starts.max()) + 1, self.smallest_bucket)

    def __call__(self, step_fn, inputs: dict, slots, starts):
        """Run the decode step for sequences `slots` (host [S]) at positions `starts` (host [S]) with `inputs`;
        returns the step's output (a static device buffer; copy it to keep it past the next replay)."""
        cp = self.ops.xp
        key = self.key(starts)
        entry = self.captured.get(key)
        if entry is None:
            entry = self._capture(key, step_fn, inputs, slots, starts)
        for name, value in inputs.items():
            if isinstance(value, cp.ndarray):
                cp.copyto(entry.inputs[name], value)
            else:
                entry.inputs[name].set(np.ascontiguousarray(value, dtype=entry.inputs[name].dtype))
        entry.slots.set(np.asarray(slots, dtype=np.int64))
        entry.starts.set(np.asarray(starts, dtype=np.int64))
        entry.graph.launch(stream=cp.cuda.get_current_stream())
        return entry.output

    def _capture(self, key, step_fn, inputs, slots, starts) -> _Captured:
        cp = self.ops.xp
        S, kv_len = key
        static = {name: cp.array(value, copy=True) for name, value in inputs.items()}     # host or device
        slots_d = cp.asarray(np.asarray(slots, dtype=np.int64))
        starts_d = cp.asarray(np.asarray(starts, dtype=np.int64))
        step = DeviceStep(np.asarray(slots, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                          np.ones(S, dtype=np.int64), slots_d, starts_d, kv_len)
        step_fn(static, step)                                        # warm-up, eager
        cp.cuda.get_current_stream().synchronize()
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                output = step_fn(static, step)
            except Exception as exc:
                try:
                    self.stream.end_capture()
                except Exception:  # noqa: BLE001 - the capture is already broken; report the first error
                    pass
                raise RuntimeError(f"decode step for batch {S}, KV bucket {kv_len} cannot be captured in a CUDA "
                                   f"graph: {exc}") from exc
            graph = self.stream.end_capture()
        entry = _Captured(graph, static, slots_d, starts_d, output)
        self.captured[key] = entry
        return entry
