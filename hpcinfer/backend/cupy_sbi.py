"""SBI-GeMM and the Deep-Fusion regions on the GPU: the launch wrappers of cuda_src/sbi_gemv.cu and
cuda_src/fused_norm_gemv.cu, for CupyOps.linear and CupyOps.fused_linear.

    y[T, ncols] = act(norm(x) @ W^T + bias) (+ residual)      T <= SBI_MAX_TOKENS tokens, float32 compute

`plan` (pure Python, no GPU) picks the module and the launch from the shapes: the token bucket MAX_TOKENS (the
smallest of TOKEN_BUCKETS >= T: five compiled variants per define set instead of sixteen, at the cost of registers
held for up to 2x the tokens), and SPLITS, the blocks along the input dimension, for layers whose output columns
alone make too few blocks to fill the GPU (see choose_splits). `fused_linear` checks the arrays (dtypes, layout,
alignment) and launches, or answers None when the kernel does not apply; the caller then runs cuBLAS (linear) or
the unfused ops in sequence (fused_linear).

Weight layout: W_ROWMAJOR=1, the kernel reads W [out, in] as loaded (contiguous, in % VEC == 0, 16-byte aligned).
Chosen over the packed SBI layout (kernels/layout.sbi_pack, made by a prepare-weight hook at load) because cuBLAS
reads [out, in] for large batches: the packed layout would need a second copy of every weight (2x weight memory,
the very thing offload and tp exist to save) or cuBLAS on an unpacked view it cannot express, and the offload tiers,
quantized formats and checkpoint readers all keep seeing one plain [out, in] array. The cost: each lane's 16-byte
vector is half a 32-byte sector at stride `in`, and the rest of the line is read by the block's next warps (L1 hits
if the lines stay resident; sbi_core.cuh). Whether packed streams measurably faster is for the GPU benchmark to
say; only W_ROWMAJOR=1 is wired, so the layout is not a [runtime] option (note in docs/gpu.md).

Fused with tp == 1 only for the residual (region 4): with tp > 1 the row-parallel partial sums are all-reduced
between the GEMV and the bias + residual add (parallel/layers.py RowParallelLinear).

Shape legend: T=tokens, in=input features, out=weight rows (2F when gated), ncols=output columns (F when gated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32
TOKEN_BUCKETS = (1, 2, 4, 8, 16)      # MAX_TOKENS of the compiled variants
SBI_MAX_TOKENS = TOKEN_BUCKETS[-1]    # above this, cuBLAS (a GEMM reads each weight once for all tokens anyway)
WARPS, ROWS, UNROLL = 4, 1, 4         # block (32, WARPS), 32 * ROWS output columns per block; to tune on a GPU
WAVES = 2                             # aim for at least WAVES blocks per SM before splitting the input dimension
MAX_SPLITS = 16                       # the partial workspace is [SPLITS, T, out] float32
REDUCE_BLOCK = 256                    # threads per block of the *_reduce kernels (their __launch_bounds__)

_STORAGE = {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16"}   # uint16 = bfloat16 bits
_ACT = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}                  # common.cuh ACT_*
_NORM = {"rmsnorm": 1, "layernorm": 2}                                             # sbi_core.cuh NORM_*


def token_bucket(tokens: int) -> int | None:
    """The smallest MAX_TOKENS >= tokens, or None (no tokens, or more than SBI_MAX_TOKENS: cuBLAS)."""
    return next((b for b in TOKEN_BUCKETS if b >= tokens), None) if tokens >= 1 else None


def choose_splits(ncols: int, n_in: int, vec: int, sm_count: int) -> int:
    """Blocks along the input dimension. The output columns give ceil(ncols / (32 ROWS)) blocks; when that is
    fewer than WAVES x SMs (a small model, or the out = D projections), split the input dimension so the grid
    fills the GPU, while every split keeps at least one full unrolled pass per warp (WARPS x UNROLL vectors)."""
    col_blocks = -(-ncols // (32 * ROWS))
    wanted = -(-WAVES * sm_count // col_blocks)
    most = max(1, -(-n_in // vec) // (WARPS * UNROLL))
    return max(1, min(wanted, most, MAX_SPLITS))


@dataclass(frozen=True)
class Launch:
    """One SBI launch: the module (file and function name), its #defines and both grids."""

    name: str                  # "sbi_gemv" | "fused_norm_gemv" (file and kernel); the reduction is name + "_reduce"
    defines: dict
    grid: tuple                # (ceil(ncols / (32 ROWS)), SPLITS)
    block: tuple               # (32, WARPS)
    splits: int
    reduce_grid: tuple         # (ceil(T ncols / REDUCE_BLOCK),): only launched when splits > 1


def plan(tokens: int, n_in: int, out: int, weight_dtype, sm_count: int, *, norm: str | None = None,
         norm_bias: bool = False, act: str | None = None, gated: bool = False, has_bias: bool = False,
         has_residual: bool = False, x_vec: bool = True) -> Launch | None:
    """The launch for x [tokens, n_in] (float32) and W [out, n_in] of `weight_dtype` (float32, float16 or uint16
    bfloat16 bits), or None where the kernel does not apply: tokens outside 1 .. SBI_MAX_TOKENS, another weight
    dtype, n_in not a whole number of 16-byte vectors (the row-major read), an odd `out` or no activation when
    gated, an unknown activation or norm."""
    bucket, storage = token_bucket(tokens), _STORAGE.get(np.dtype(weight_dtype).name)
    if bucket is None or storage is None or act not in _ACT or (norm is not None and norm not in _NORM):
        return None
    vec = 16 // np.dtype(weight_dtype).itemsize
    if n_in < 1 or n_in % vec or out < 1 or (gated and (out % 2 or act is None)):
        return None
    ncols = out // 2 if gated else out
    splits = choose_splits(ncols, n_in, vec, sm_count)
    defines = {"T_STORAGE": storage, "T_ACT": "float", "MAX_TOKENS": bucket, "WARPS": WARPS, "ROWS": ROWS,
               "UNROLL": UNROLL, "ACT": _ACT[act], "HAS_BIAS": int(has_bias), "HAS_RESIDUAL": int(has_residual),
               "GATED": int(gated), "X_VEC": int(x_vec), "W_ROWMAJOR": 1}
    if norm is not None:
        defines.update(NORM=_NORM[norm], NORM_BIAS=int(norm_bias))
    return Launch("fused_norm_gemv" if norm is not None else "sbi_gemv", defines,
                  (-(-ncols // (32 * ROWS)), splits), (32, WARPS), splits,
                  (-(-tokens * ncols // REDUCE_BLOCK),))


def _address(a) -> int:
    """Device address of a cupy array (the host address of a NumPy one: the emulator tests run these wrappers)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def _vector_ok(a, n: int) -> bool:
    """A float32 contiguous [n] parameter (bias, norm weight)."""
    return a.dtype == F32 and a.shape == (n,) and a.flags.c_contiguous


def fused_linear(ops, x, w, bias=None, norm=None, act=None, gated=False, residual=None):
    """act(norm(x) @ w.T + bias) (+ residual) -> [T, ncols] float32 through one SBI kernel (two with SPLITS > 1),
    or None when the kernel does not apply (kernels off, T > SBI_MAX_TOKENS, a layout or dtype it does not take).
    `ops`: the CupyOps; norm: a backend.ops.NormParams or None."""
    if not ops.kernels or x.ndim != 2 or x.dtype != F32 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        return None
    (T, n_in), out = x.shape, w.shape[0]
    ncols = out // 2 if gated else out
    if not w.flags.c_contiguous or _address(w) % 16:
        return None
    if bias is not None and not _vector_ok(bias, out):
        return None
    if norm is not None and not (_vector_ok(norm.weight, n_in) and
                                 (norm.bias is None or _vector_ok(norm.bias, n_in))):
        return None
    if residual is not None and (residual.dtype != F32 or residual.shape != (T, ncols)):
        return None
    if ops._sm_count is None:
        ops._sm_count = ops.xp.cuda.Device().attributes["MultiProcessorCount"]
    x, ldx = ops._rows(x)
    x_vec = _address(x) % 16 == 0 and (ldx * x.itemsize) % 16 == 0     # X_VEC=1 reads x in 16-byte vectors
    norm_bias = norm is not None and norm.kind == "layernorm" and norm.bias is not None
    launch = plan(T, n_in, out, w.dtype, ops._sm_count, norm=None if norm is None else norm.kind,
                  norm_bias=norm_bias, act=act, gated=gated, has_bias=bias is not None,
                  has_residual=residual is not None, x_vec=x_vec)
    fn = None if launch is None else ops._kernel(launch.name, launch.name, **launch.defines)
    if fn is None:
        return None
    cp = ops.xp
    y = cp.empty((T, ncols), dtype=F32)
    residual, ldr = ops._rows(residual) if residual is not None else (y, ncols)
    bias = y if bias is None else bias                  # unused pointers: any device array
    partial = cp.empty((launch.splits, T, out), dtype=F32) if launch.splits > 1 else y
    shape = (np.int32(T), np.int32(n_in), np.int32(out), np.int64(ldx), np.int64(ldr), np.int64(ncols))
    if norm is None:
        fn(launch.grid, launch.block, (x, w, bias, residual, y, partial, *shape))
    else:
        beta = norm.bias if norm_bias else norm.weight
        fn(launch.grid, launch.block, (x, norm.weight, beta, np.float32(norm.eps), w, bias, residual, y, partial,
                                       *shape))
    if launch.splits > 1:
        reduce = ops._kernel(launch.name, launch.name + "_reduce", **launch.defines)
        reduce(launch.reduce_grid, (REDUCE_BLOCK,), (partial, bias, residual, y, np.int32(T), np.int32(out),
                                                     np.int32(launch.splits), np.int64(ldr), np.int64(ncols)))
    return y
