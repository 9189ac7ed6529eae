"""NumPy Ops: the reference implementation of every numeric operation the model uses.

Compute is float32. Weights may be stored in float16/bfloat16 and are upcast per call (a transient copy of one
layer's weight, never a persistent full-precision one). Every later backend is tested against this one.

Shape legend: T=tokens (all sequences of a step, packed), D=hidden, H=query heads, Hkv=KV heads, hd=head dim,
S=sequences in the step, L=cached positions, N=cache slots.
"""

from __future__ import annotations

import functools

import numpy as np

from ..quant.formats import dequantize, slice_rows, take_rows
from . import compiled_attention, cpu_kernels, kv_attention, moe_ops, paged_attention
from .numpy_decode import DecodeAttention, usable_cores
from .interface import StepLayout, unfused_linear
from .transfer import HostCopies

if cpu_kernels.NUMBA_ERROR is None:                  # else cpu_kernels.resolve never lets "numba" through
    from .cpu_kernels import compiled, gemm, gemm_quant

F32 = np.float32
SMALL_BATCH = 32          # tokens up to which linear() multiplies weight-first
SCORE_BLOCK = 1 << 16    # floats of one KV head's block of causal attention scores (256 KiB)
COMPILED_PREFILL_MAX = 256  # new tokens of a sequence up to which a step's attention runs compiled: at 16 x 128 the
                          # kernels took 819 ms against NumPy's 906, at 8 x 414 3,366 against 2,555 (1 thread, shared
                          # EPYC, docs/cpu-attention.md): between the two until a quiet machine measures the crossover
QUANT_TILE = 4096         # output rows dequantized per step by linear_q (a 4096 x 4096 float32 tile is 64 MiB)


class NumpyOps:
    name = "numpy"
    xp = np
    continuous_kv = "slots"   # the continuous schedule keeps rows in dense slots (generate/slot_cache.py): a paged
                              # pool's rows would be gathered with np.take at every step

    def __init__(self, threads: int | None = None, cpu_kernels: str = "numpy"):
        """threads: the rank's BLAS threads (runtime._set_threads), which decode attention splits its sequences
        over (backend/numpy_decode.py); default the usable cores, as OpenBLAS's own default. cpu_kernels: "numba" (the
        compiled kernels of backend/cpu_kernels where they exist) or "numpy" (NumPy/BLAS only, the reference)."""
        self.cpu_kernels = cpu_kernels
        self.threads = usable_cores() if threads is None else max(1, int(threads))
        self.decode_attention = DecodeAttention(self.threads)
        # the kernels run on the same `threads` as BLAS, never at once with it; their cold start, once per process
        self.kernel_warm_up = compiled.warm_up() if cpu_kernels == "numba" else None

    # ---- memory ----------------------------------------------------------------------------------------------
    def asarray(self, array, dtype=None):
        """Host array -> backend array (copy-free when possible)."""
        return np.ascontiguousarray(array, dtype=dtype)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def zeros(self, shape, dtype=F32):
        return np.zeros(shape, dtype=dtype)

    def use_device(self) -> None:
        """Nothing to bind on the CPU (CupyOps makes its GPU current on the calling thread)."""

    def copy_engine(self):
        """Copies made at once on the calling thread (backend/transfer.py)."""
        return HostCopies()

    # ---- dense math --------------------------------------------------------------------------------------------
    def linear(self, x, w, bias=None):
        """x [T, in] @ w[out, in].T (+ bias [out]) -> [T, out]. For a few tokens, `(w @ x.T).T` lets OpenBLAS
        stream the row-major weight once (20-25% faster at 4-16 tokens than `x @ w.T`, bench/results/).
        cpu_kernels = "numba": the compiled GEMM (cpu_kernels/gemm.py) up to its measured crossover in tokens."""
        if self.cpu_kernels == "numba" and gemm.takes(x, w):
            return gemm.fused_gemm(x, w, bias, threads=self.decode_attention.threads)
        if w.dtype != F32:
            w = w.astype(F32)
        y = (w @ x.T).T if x.shape[0] <= SMALL_BATCH else x @ w.T
        if bias is not None:
            y += bias
        return y

    def expert_linear(self, x, w, bias=None):
        """linear, for an expert's routed rows (parallel/experts.ExpertStack): the same here."""
        return self.linear(x, w, bias)

    def fused_linear(self, x, w, bias=None, norm=None, act=None, gated=False, residual=None):
        """act(norm(x) @ w.T + bias) (+ residual): the Deep-Fusion regions as one call (backend/ops.py NormParams;
        gated: act(gate) * up of a [T, 2F] gate/up product, as gated_activation). Here the unfused sequence of the
        ops the model used to call one by one, so results are bit-identical to them; CupyOps runs it as one
        kernel (cuda_src/fused_norm_gemv.cu, sbi_gemv.cu) for a few tokens. The residual is added in place into
        the product (a new array of ours) when that is C-contiguous; a sum either way round is the same float.
        cpu_kernels = "numba": one compiled kernel (cpu_kernels/gemm.py) up to its crossover in tokens."""
        if self.cpu_kernels == "numba" and gemm.takes(x, w, act):
            return gemm.fused_gemm(x, w, bias, norm, act, gated, residual, self.decode_attention.threads)
        y = unfused_linear(self, x, w, bias, norm, act, gated)
        if residual is None:
            return y
        if y.flags.c_contiguous and y.shape == residual.shape and y.dtype == residual.dtype:
            y += residual
            return y
        return residual + y                                  # y a transposed view (<= SMALL_BATCH tokens)

    def prepare_quantized(self, qt):
        """A QuantizedTensor as linear_q / embedding_q take it: on the host, itself (CupyOps re-lays it); with
        cpu_kernels = "numba", its arrays C-contiguous (once, at load: a transposed read of a row-parallel weight
        may not be), as the compiled kernel reads them."""
        return gemm_quant.contiguous(qt) if self.cpu_kernels == "numba" else qt

    def linear_q(self, x, qt, bias=None):
        """x [T, in] @ dequantize(qt)[out, in].T (+ bias) -> [T, out] for a QuantizedTensor (quant/formats.py).
        The weight is dequantized QUANT_TILE output rows at a time into one reused float32 buffer per tile shape,
        each tile multiplied right away: never a float copy of the whole weight, none kept between calls.
        cpu_kernels = "numba": dequantized in registers instead (cpu_kernels/gemm_quant.py), up to its crossover."""
        if self.cpu_kernels == "numba" and gemm_quant.takes(x, qt, gemm.max_tokens(*qt.shape, quantized=True)):
            return gemm_quant.linear_q(x, qt, bias, self.decode_attention.threads)
        rows, cols = qt.shape
        y = np.empty((x.shape[0], rows), dtype=F32)
        for start in range(0, rows, QUANT_TILE):
            stop = min(start + QUANT_TILE, rows)
            w = dequantize(slice_rows(qt, slice(start, stop)), out=self._buffer((stop - start, cols), F32),
                           scratch=self._buffer((stop - start, cols), np.uint8) if qt.bits == 4 else None)
            y[:, start:stop] = (w @ x.T).T if x.shape[0] <= SMALL_BATCH else x @ w.T
        if bias is not None:
            y += bias
        return y

    def embedding_q(self, qt, ids):
        """Gather rows of a quantized table [V, D], dequantizing only those rows -> [T, D] float32."""
        return take_rows(qt, np.asarray(ids))

    def _buffer(self, shape, dtype):
        """A scratch array reused by every call with this shape and dtype (dequantized weight tiles)."""
        cache = self.__dict__.setdefault("_scratch", {})
        key = (shape, np.dtype(dtype).str)
        if key not in cache:
            cache[key] = np.empty(shape, dtype=dtype)
        return cache[key]

    def embedding(self, table, ids):
        """table [V, D], ids [T] -> [T, D] float32."""
        return table[ids].astype(F32, copy=False)

    # The norms and activations below write into arrays they allocated themselves (never into x): each NumPy
    # temporary is a fresh [T, D] block, so fewer of them means less memory traffic (and, without glibc's malloc
    # settings of docs/embed.md, fewer page faults). The float operations and their order are the original
    # expressions' (in comments), so results are bit-identical to them.
    def layer_norm(self, x, weight, bias, eps: float):
        mean = x.mean(axis=-1, keepdims=True)                # [T, 1]
        centered = x - mean                                  # [T, D], ours from here on
        square = centered * centered
        var = np.mean(square, axis=-1, keepdims=True)
        y = np.multiply(centered, (1.0 / np.sqrt(var + eps)).astype(F32), out=square)   # centered * rstd
        y *= weight
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x, weight, eps: float):                # x * rstd * weight
        y = x * x
        ms = np.mean(y, axis=-1, keepdims=True)
        np.multiply(x, (1.0 / np.sqrt(ms + eps)).astype(F32), out=y)
        y *= weight
        return y

    def activation(self, x, kind: str):
        if kind == "gelu":                                   # 0.5 x (1 + erf(x / sqrt 2))
            return _gelu(x)
        if kind == "gelu_tanh":
            return _gelu_tanh(x)
        if kind == "relu":
            return np.maximum(x, F32(0))
        if kind == "silu":                                   # x / (1 + exp(-x))
            y = np.negative(x)
            np.exp(y, out=y)
            y += F32(1)
            return np.divide(x, y, out=y)
        raise ValueError(f"unknown activation {kind!r}")

    def gated_activation(self, gate_up, kind: str):
        """gate_up [T, 2F] (gate half first) -> act(gate) * up  [T, F]."""
        f = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :f], gate_up[:, f:]
        if kind != "silu":
            out = self.activation(gate, kind)                # a new array: act(gate) * up in place
            out *= up
            return out
        out = np.negative(gate)                              # silu(g) * u = g / (1 + exp(-g)) * u, in place
        np.exp(out, out=out)
        out += F32(1)
        np.divide(gate, out, out=out)
        out *= up
        return out

    def rotary(self, x, cos, sin, rotary_dim: int):
        """Rotate the first rotary_dim dims of each head, half-split ("rotate_half") convention: with x1, x2 the
        halves, [x1 cos - x2 sin, x2 cos + x1 sin]. x [T, heads, hd]; cos, sin [T, rotary_dim/2] -> [T, heads, hd].
        Written into the output in place with one temporary (no concatenated copies: 2.9x faster at 2,048 tokens)."""
        half = rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty(x.shape, dtype=F32)
        tmp = np.multiply(x2, s)
        np.multiply(x1, c, out=out[..., :half])
        out[..., :half] -= tmp
        np.multiply(x1, s, out=tmp)
        np.multiply(x2, c, out=out[..., half:rotary_dim])
        out[..., half:rotary_dim] += tmp
        out[..., rotary_dim:] = x[..., rotary_dim:]
        return out

    # ---- attention over the KV cache -----------------------------------------------------------------------
    kv_dtype = "float32"                                     # a float KV cache's storage: float32 on the CPU

    def attention(self, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float = 0.0,
                  rope=None):
        """Append k, v to the cache, then causal attention of q over each sequence's cached positions.

        q [T, H, hd]; k, v [T, Hkv, hd]; cache_k, cache_v [N, Hkv, Lmax, hd] -> out [T, H*hd].
        rope = (cos [T, rd/2], sin [T, rd/2], rotary_dim): q and k are rotated first (self.rotary; the CuPy decode
        kernels fuse it into their q load and k append), None: q and k as given.
        A quantized cache (quant.kv.QuantizedKV) or top-k decode (0 < topk < 1): backend/kv_attention.py.
        cpu_kernels = "numba": the compiled kernels over any of these stores (backend/compiled_attention.py), for
        decode and for prompt chunks up to COMPILED_PREFILL_MAX tokens (longer ones: BLAS's GEMMs are faster).
        """
        if rope is not None:
            q, k = self.rotary(q, *rope), self.rotary(k, *rope)
        if step.num_tokens == 0:                             # a replica with no tokens in a lockstep step
            return np.zeros((0, q.shape[1] * q.shape[2]), dtype=F32)
        if self.cpu_kernels == "numba" and (step.is_decode or int(step.counts.max()) <= COMPILED_PREFILL_MAX):
            return compiled_attention.attention(self, q, k, v, cache_k, cache_v, step, scale, topk)
        if step.is_paged:                                    # the continuous schedule's paged KV pool
            return paged_attention.attention(self, q, k, v, cache_k, cache_v, step, scale, topk)
        if 0 < topk < 1 and not step.is_decode and np.any(step.counts == 1):
            return self._mixed_top_k(q, k, v, cache_k, cache_v, step, scale, topk)
        if not isinstance(cache_k, np.ndarray) or (0 < topk < 1 and step.is_decode):
            return kv_attention.attention(self, q, k, v, cache_k, cache_v, step, scale, topk)
        self._append_kv(k, v, cache_k, cache_v, step)
        if step.is_decode:
            return self._decode_attention(q, cache_k, cache_v, step, scale)
        out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
        for s in range(step.num_seqs):
            a, b = step.token_range(s)
            out[a:b] = self._causal_attention(q[a:b], cache_k[step.slots[s]], cache_v[step.slots[s]],
                                              int(step.starts[s]), scale)
        return out

    def _mixed_top_k(self, q, k, v, cache_k, cache_v, step: StepLayout, scale: float, topk: float):
        """A continuous step with top-k that mixes one-token entries (decode tokens: top-k, as the static schedule's
        decode steps) with prompt chunks (dense, as its prompt steps): each part attends as a step of its own."""
        out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
        for rows in paged_attention.dense_parts(step, topk):        # the split the paged path makes too
            tokens = np.concatenate([np.arange(*step.token_range(int(s))) for s in rows])     # [T'] of the step's T
            part = StepLayout.build(step.slots[rows], step.starts[rows], step.counts[rows])
            out[tokens] = self.attention(q[tokens], k[tokens], v[tokens], cache_k, cache_v, part, scale, topk)
        return out

    @staticmethod
    def _append_kv(k, v, cache_k, cache_v, step: StepLayout):
        if step.is_decode:
            cache_k[step.slots, :, step.starts] = k          # k [S, Hkv, hd] into [N, Hkv, Lmax, hd]
            cache_v[step.slots, :, step.starts] = v
            return
        for s in range(step.num_seqs):
            a, b = step.token_range(s)
            start = int(step.starts[s])
            cache_k[step.slots[s], :, start:start + b - a] = k[a:b].transpose(1, 0, 2)
            cache_v[step.slots[s], :, start:start + b - a] = v[a:b].transpose(1, 0, 2)

    @staticmethod
    def _causal_attention(q, k_seq, v_seq, start: int, scale: float):
        """One sequence: q [n, H, hd] at positions start..start+n-1; k_seq, v_seq [Hkv, >= start + n, hd] ->
        [n, H*hd]. In blocks of query rows (flash-attention's tiling without its running softmax: a block's
        scores span all the keys it sees): block [a, b) attends positions 0 .. start + b - 1 only, so the scores
        never materialize at [n, L], a block's stay in cache, the future beyond a block is never computed, and only
        its own last b - a key columns need the causal mask. The g query heads of a KV head are rows of one GEMM."""
        n, heads, hd = q.shape
        kv_heads = k_seq.shape[0]
        group = heads // kv_heads
        qg = (q * F32(scale)).reshape(n, kv_heads, group, hd).transpose(1, 0, 2, 3).copy()   # [Hkv, n, g, hd]
        out = np.empty((kv_heads, n, group, hd), dtype=F32)
        rows = _query_block(group, start + n)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            length = start + b
            scores = qg[:, a:b].reshape(kv_heads, (b - a) * group, hd) @ k_seq[:, :length].transpose(0, 2, 1)
            if b - a > 1:                                       # [Hkv, (b-a) g, L]: the block's own columns
                scores[:, :, start + a:] += _block_mask(b - a, group)
            probs = _softmax(scores)
            out[:, a:b] = (probs @ v_seq[:, :length]).reshape(kv_heads, b - a, group, hd)
        return out.transpose(1, 0, 2, 3).reshape(n, heads * hd)

    def _decode_attention(self, q, cache_k, cache_v, step: StepLayout, scale: float):
        """One new token per sequence, batched: q [S, H, hd] -> [S, H*hd]."""
        S = q.shape[0]
        lengths = step.starts + 1                                                  # [S]
        L = int(lengths.max())
        first, last = int(step.slots[0]), int(step.slots[-1])
        if np.array_equal(step.slots, np.arange(first, first + S)):               # a view, no copy
            keys, values = cache_k[first:first + S, :, :L], cache_v[first:first + S, :, :L]
        elif np.all(np.diff(step.slots) > 0) and last - first + 1 <= 2 * S:       # ascending, a few slots idle
            return self._decode_over_span(q, cache_k, cache_v, step.slots, lengths, L, scale)
        else:
            keys, values = cache_k[step.slots, :, :L], cache_v[step.slots, :, :L]  # [S, Hkv, L, hd]
        return self._decode_over(q, keys, values, lengths, scale)

    def _decode_over_span(self, q, cache_k, cache_v, slots, lengths, L: int, scale: float):
        """Ascending slots with gaps (the continuous schedule's running sequences in their slots, some slots
        idle): attend over the view of slots first..last, the idle ones with a zero query over their first
        position, and keep the step's rows. No copy of the cached rows (a fancy-indexed [S, Hkv, L, hd] copy
        a layer), and each row's arithmetic is the one it has alone (adding 0 to its scores is exact)."""
        first, rows = int(slots[0]), slots - int(slots[0])
        span = int(slots[-1]) - first + 1
        q_span = np.zeros((span, *q.shape[1:]), dtype=F32)
        q_span[rows] = q
        lengths_span = np.ones(span, dtype=lengths.dtype)
        lengths_span[rows] = lengths
        keys, values = cache_k[first:first + span, :, :L], cache_v[first:first + span, :, :L]
        return self._decode_over(q_span, keys, values, lengths_span, scale)[rows]

    def _decode_over(self, q, keys, values, lengths, scale: float):
        """q [S, H, hd] over keys, values [S, Hkv, L, hd] of which sequence s reads its first lengths[s] positions
        -> [S, H*hd] (the dense cache's rows, or a paged pool's gathered ones: backend/paged_attention.py), the
        sequences split over the rank's threads (backend/numpy_decode.py)."""
        return self.decode_attention(q, keys, values, lengths, scale)

    # ---- encoder attention (no KV cache) ----------------------------------------------------------------------
    def bidirectional_attention(self, q, k, v, step: StepLayout, scale: float):
        """Each token attends to every token of its own sequence (an encoder, no cache, no causal mask).

        q, k, v [T, H, hd] with the sequences of `step` packed -> out [T, H*hd]. The sequences are laid out padded
        [S, H, Lmax, hd] for one batched matmul; padded keys are masked out (a length-bucketed batch pads little)."""
        T, heads, hd = q.shape
        lengths = step.counts
        S, L = len(lengths), int(lengths.max()) if len(lengths) else 0
        if T == 0:
            return np.zeros((0, heads * hd), dtype=F32)
        ragged = bool(np.any(lengths != L))
        if ragged:                                            # [S, L] token index of each padded slot
            index = np.minimum(step.offsets[:-1, None] + np.arange(L)[None, :], T - 1)
            valid = np.arange(L)[None, :] < lengths[:, None]                         # [S, L]
            q, k, v = q[index], k[index], v[index]                                 # [S, L, H, hd]
        # contiguous 3-d copies, keys already transposed: a 4-d or transposed operand makes matmul 5-10x slower
        q, v = (np.ascontiguousarray(a.reshape(S, L, heads, hd).transpose(0, 2, 1, 3)).reshape(S * heads, L, hd)
                for a in (q, v))                                                   # [S*H, L, hd]
        kt = np.ascontiguousarray(k.reshape(S, L, heads, hd).transpose(0, 2, 3, 1)).reshape(S * heads, hd, L)
        q *= F32(scale)
        scores = (q @ kt).reshape(S, heads, L, L)
        if ragged:
            scores += np.where(valid, F32(0), F32(-np.inf))[:, None, None, :]
        probs = _softmax(scores).reshape(S * heads, L, L)
        out = (probs @ v).reshape(S, heads, L, hd).transpose(0, 2, 1, 3)            # [S, L, H, hd]
        out = out.reshape(S, L, heads * hd)
        return out[valid] if ragged else out.reshape(T, heads * hd)

    # ---- mixture of experts (the gating and dispatch reference: backend/moe_ops.py) -----------------------
    def softmax(self, x):
        return _softmax(np.array(x, dtype=F32))

    def top_k_gating(self, logits, k: int, normalize: str):
        return moe_ops.top_k_gating(logits, k, normalize)

    def route(self, experts, weights, num_experts: int, capacity):
        return moe_ops.route(experts, weights, num_experts, capacity)

    def permute(self, x, routing):
        return moe_ops.permute(x, routing)

    def gate_dispatch(self, logits, x, k: int, normalize: str, num_experts: int, capacity):
        """top_k_gating + route + permute -> (routing, rows [R, D] grouped by expert)."""
        return moe_ops.gate_and_dispatch(self, logits, x, k, normalize, num_experts, capacity)

    def unpermute(self, rows, routing, tokens: int):
        return moe_ops.unpermute(rows, routing, tokens)

    def scatter_add_rows(self, out, index, rows) -> None:
        """out[index[i]] += rows[i] (repeated indices add up)."""
        np.add.at(out, index, rows)

    # ---- sampling helpers ----------------------------------------------------------------------------------
    def argmax(self, logits):
        return np.argmax(logits, axis=-1)


def _query_block(group: int, length: int) -> int:
    """Query positions per block of causal attention: a block's scores of one KV head [rows g, L] about
    SCORE_BLOCK floats (in cache), at least 16 positions. Per KV head, so that the blocks, and with them every
    GEMM's shape, do not depend on how many KV heads this rank holds: tp = 1 and tp = 3 give the same bits."""
    return max(16, SCORE_BLOCK // max(1, group * length))


@functools.lru_cache(maxsize=64)
def _block_mask(n: int, group: int) -> np.ndarray:
    """[n g, n]: the causal mask of a block's n query positions (each repeated for its g heads) over its own n key
    positions: 0 on and below the diagonal, -inf above."""
    future = np.arange(n)[None, :] > np.arange(n)[:, None]
    return np.repeat(np.where(future, F32(-np.inf), F32(0)), group, axis=0)


# Abramowitz & Stegun 7.1.26: |erf error| < 1.5e-7 (6e-7 in float32 arithmetic, measured), in float32 vector ops:
# ~6x faster than scipy.special.erf, whose float32 loop is scalar and single-threaded (it dominated encoder GELUs).
_ERF_P = F32(0.3275911)
_ERF_A = tuple(F32(a) for a in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592))


def _erf(z: np.ndarray) -> np.ndarray:
    """copysign(1 - poly(t) exp(-a^2), z) with a = min(|z|, 4), t = 1 / (1 + p a): three new arrays, the rest in
    place. exp(-a*a) is computed as exp(-(a*a)), the same float32 value (the sign of a product is exact)."""
    a = np.abs(z)
    np.minimum(a, F32(4), out=a)            # erf(4) is 1 in float32; the cap keeps exp(-a^2) out of slow denormals
    t = np.multiply(_ERF_P, a)
    t += F32(1)
    np.divide(F32(1), t, out=t)             # t = 1 / (1 + p a)
    poly = np.multiply(_ERF_A[0], t)
    for coefficient in _ERF_A[1:]:
        poly += coefficient
        poly *= t
    np.multiply(a, a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)                        # exp(-a^2)
    poly *= a
    np.subtract(F32(1), poly, out=poly)
    return np.copysign(poly, z, out=poly)


def _gelu(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + erf(x / sqrt 2)) as (0.5 x) * (1 + erf(...)): four new arrays (the original expression: ~12)."""
    z = np.multiply(x, F32(np.sqrt(0.5)))
    e = _erf(z)
    e += F32(1)
    out = np.multiply(F32(0.5), x, out=z)   # z is no longer needed
    out *= e
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the cube as ((0.044715 x) x) x as before."""
    u = np.multiply(F32(0.044715), x)
    u *= x
    u *= x
    np.add(x, u, out=u)
    np.multiply(F32(np.sqrt(2.0 / np.pi)), u, out=u)
    np.tanh(u, out=u)
    u += 1.0
    out = np.multiply(0.5, x)
    out *= u
    return out


def _softmax(scores):
    """Softmax over the last axis, in place: every caller passes scores it made (softmax() copies its input)."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores
