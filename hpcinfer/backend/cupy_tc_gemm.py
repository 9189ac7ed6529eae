"""The tensor-core small-batch GEMM on the GPU: the launch wrappers of cuda_src/tc_gemm.cu (float16 / bfloat16
weights) and cuda_src/tc_quant_gemm.cu (int8 / int4 weights), for every linear of 2 .. TC_MAX_TOKENS tokens (decode
steps and chunked-prefill steps alike):

    y[T, ncols] = act(norm(x) @ W^T + bias) (+ residual)      2 <= T <= 64, float32 accumulation

Routing (CupyOps.linear / fused_linear / linear_q): T = 1 stays on the SBI GEMV (sbi_gemv.cu / quant_gemv.cu: one
token uses one column of an mma's eight, and the GEMV already streams the weights at one warp load of 512 bytes per
row); 2 .. 64 tokens with 16-bit or quantized weights come here; float32 weights keep the GEMV up to 16 tokens
(tensor cores take no float32 operand without rounding it to TF32, which NumPy's float32 products do not do);
larger steps keep cuBLAS. The kernel calls no library, so a captured decode step of up to 64 tokens needs no cuBLAS.

`plan` (pure Python) picks the module and the launch: the token bucket (MAX_TOKENS 8, 16, 32, 64: an n-tile of 8
tokens is the mma's N), the warps and stages (the weight stages in flight and the staged x tile share the 48 KiB of
static shared memory), and SPLITS, the split-K factor, for layers whose output columns alone give fewer blocks than
WAVES per SM. Splits cost a [SPLITS, T, out] float32 workspace and the *_reduce kernel; their sum is in split order,
so a step's bits do not depend on scheduling. A fused norm is computed in every block from all of x (the SBI
design); above NORM_FUSE_MAX_TOKENS tokens that re-read costs more than the norm kernel, so the norm runs first
and the GEMM takes the normalized x (the epilogue stays fused).

Preconditions the wrappers check (else they answer None and the caller takes the next path): kernels on, x
float32 [T, in], W contiguous and 16-byte aligned with in % 16 == 0, float32 contiguous bias / norm parameters.

Shape legend: T=tokens, in=input features, out=weight rows (2F when gated), ncols=output columns (F when gated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32
TOKEN_BUCKETS = (8, 16, 32, 64)          # MAX_TOKENS of the compiled variants (n-tiles of 8 tokens)
TC_MIN_TOKENS = 2                        # one token: the SBI GEMV
TC_MAX_TOKENS = TOKEN_BUCKETS[-1]        # above this, cuBLAS
NORM_FUSE_MAX_TOKENS = 16                # a fused norm re-reads T x in of x per block: above, the norm kernel first
KS = 64                                  # input elements per weight stage (tc_core.cuh KS)
SMEM = 48 * 1024                         # static shared memory per block
WAVES = 2                                # blocks per SM the split-K aims for
MIN_STAGES_PER_SPLIT = 4                 # each split streams at least this many 64-element stages
MAX_SPLITS = 16
REDUCE_BLOCK = 256
# (WARPS, MT, STAGES wanted) per token bucket: 16 output columns per m-tile; weights in flight per warp are
# (STAGES - 1) x MT x 2 KiB. To be tuned on a GPU (bench/scripts/gpu_gemm_sweep.py).
TILES = {8: (4, 1, 4), 16: (4, 1, 4), 32: (4, 1, 3), 64: (4, 1, 3)}

_STORAGE = {"float16": "__half", "uint16": "__nv_bfloat16"}     # uint16 = bfloat16 bits on the device
_ACT = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}
_NORM = {"rmsnorm": 1, "layernorm": 2}


def token_bucket(tokens: int) -> int | None:
    """The smallest MAX_TOKENS >= tokens, or None outside TC_MIN_TOKENS .. TC_MAX_TOKENS."""
    if not TC_MIN_TOKENS <= tokens <= TC_MAX_TOKENS:
        return None
    return next(b for b in TOKEN_BUCKETS if b >= tokens)


@dataclass(frozen=True)
class Launch:
    """One tc_gemm launch: file and kernel name, #defines, grids."""

    name: str
    defines: dict
    grid: tuple                # (ceil(ncols / (16 WARPS MT)), SPLITS)
    block: tuple               # (32, WARPS)
    splits: int
    reduce_grid: tuple         # (ceil(T ncols / REDUCE_BLOCK),): launched only when splits > 1


def shared_bytes(bucket: int, warps: int, nrt: int, stages: int, xk: int, xsplit: bool = True) -> int:
    """tc_core.cuh / tc_gemm.cu static shared memory: the warps' weight stages, the x tile, the norm statistics."""
    return warps * stages * nrt * 16 * KS * 2 + bucket * xk * 2 * (2 if xsplit else 1) + 2 * bucket * 4


def fit_shared(bucket: int, warps: int, nrt: int, want_stages: int, n_in: int) -> tuple[int, int] | None:
    """(STAGES, XK) within SMEM: up to 2/3 of it for the weight stages (at least 2), the rest for the x tile (a
    whole number of 64-element stages, at most the input rounded up); None when not even one stage of x fits."""
    stage_bytes = warps * nrt * 16 * KS * 2
    stages = max(2, min(want_stages, (SMEM * 2 // 3) // stage_bytes))
    spare = SMEM - shared_bytes(bucket, warps, nrt, stages, 0)
    xk = min(spare // (bucket * 4) // KS * KS, -(-n_in // KS) * KS)
    return (stages, xk) if xk >= KS else None


def choose_splits(col_blocks: int, n_in: int, sm_count: int) -> int:
    """Split-K factor: 1 when the column blocks fill WAVES per SM, else enough splits for that, each keeping at least
    MIN_STAGES_PER_SPLIT stages of 64 input elements."""
    if col_blocks >= WAVES * sm_count:
        return 1
    stages = -(-n_in // KS)
    wanted = -(-WAVES * sm_count // col_blocks)
    return max(1, min(wanted, stages // MIN_STAGES_PER_SPLIT, MAX_SPLITS))


def plan(tokens: int, n_in: int, out: int, storage: str, sm_count: int, *, name: str = "tc_gemm",
         norm: str | None = None, norm_bias: bool = False, act: str | None = None, gated: bool = False,
         has_bias: bool = False, has_residual: bool = False, extra: dict | None = None,
         tile: tuple | None = None, splits: int | None = None) -> Launch | None:
    """The launch for x [tokens, n_in] and a weight of `out` rows whose mma type is `storage` ("__half" or
    "__nv_bfloat16"), or None where the kernel does not apply (tokens outside 2 .. 64, n_in % 16, an odd `out` or
    no activation when gated, an unknown activation or norm). `extra`: the weight format's defines
    (tc_quant_gemm); `tile` (WARPS, MT, STAGES) and `splits` override the choice (a tuning aid for the sweep)."""
    bucket = token_bucket(tokens)
    if bucket is None or act not in _ACT or (norm is not None and norm not in _NORM):
        return None
    if n_in < 16 or n_in % 16 or out < 1 or (gated and (out % 2 or act is None)):
        return None
    warps, mt, want_stages = tile or TILES[bucket]
    fit = None
    while fit is None and warps >= 1:        # gated tiles hold twice the rows: fewer warps where they do not fit
        fit = fit_shared(bucket, warps, mt * (2 if gated else 1), want_stages, n_in)
        warps = warps if fit else warps // 2
    if fit is None:
        return None
    stages, xk = fit
    ncols = out // 2 if gated else out
    col_blocks = -(-ncols // (16 * warps * mt))
    splits = splits or choose_splits(col_blocks, n_in, sm_count)
    defines = {"T_STORAGE": storage, "T_ACT": "float", "MAX_TOKENS": bucket, "WARPS": warps, "MT": mt,
               "STAGES": stages, "XK": xk, "ACT": _ACT[act], "HAS_BIAS": int(has_bias),
               "HAS_RESIDUAL": int(has_residual), "GATED": int(gated), **(extra or {})}
    if norm is not None:
        defines.update(NORM=_NORM[norm], NORM_BIAS=int(norm_bias))
    return Launch(name, defines, (col_blocks, splits), (32, warps), splits, (-(-tokens * ncols // REDUCE_BLOCK),))


def _address(a) -> int:
    """Device address of a cupy array (the host address of a NumPy one, for the emulator tests)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def _vector_ok(a, n: int) -> bool:
    return a.dtype == F32 and a.shape == (n,) and a.flags.c_contiguous


def _sm_count(ops) -> int:
    if ops._sm_count is None:
        ops._sm_count = ops.xp.cuda.Device().attributes["MultiProcessorCount"]
    return ops._sm_count


def _params_ok(ops, x, n_in, out, ncols, bias, norm, residual) -> bool:
    """x float32 [T, n_in]; bias, norm parameters and residual as the kernels read them."""
    if not ops.kernels or x.ndim != 2 or x.dtype != F32 or x.shape[1] != n_in:
        return False
    if bias is not None and not _vector_ok(bias, out):
        return False
    if norm is not None and not (_vector_ok(norm.weight, n_in) and (norm.bias is None or _vector_ok(norm.bias, n_in))):
        return False
    return residual is None or (residual.dtype == F32 and residual.shape == (x.shape[0], ncols))


def fused_linear(ops, x, w, bias=None, norm=None, act=None, gated=False, residual=None, *, tile=None, splits=None):
    """act(norm(x) @ w.T + bias) (+ residual) -> [T, ncols] float32 through tc_gemm (+ tc_gemm_reduce), or None
    when it does not apply (T outside 2 .. 64, float32 weights, a layout it does not take). `ops`: the CupyOps;
    `tile`, `splits`: see plan."""
    storage = _STORAGE.get(np.dtype(w.dtype).name)
    if storage is None or w.ndim != 2 or not w.flags.c_contiguous or _address(w) % 16:
        return None
    out, n_in = w.shape
    ncols = out // 2 if gated else out
    if token_bucket(x.shape[0]) is None or not _params_ok(ops, x, n_in, out, ncols, bias, norm, residual):
        return None
    if plan(x.shape[0], n_in, out, storage, _sm_count(ops), act=act, gated=gated) is None:
        return None                                  # decided before any norm kernel runs
    if norm is not None and x.shape[0] > NORM_FUSE_MAX_TOKENS:
        x = ops.rms_norm(x, norm.weight, norm.eps) if norm.kind == "rmsnorm" else \
            ops.layer_norm(x, norm.weight, norm.bias, norm.eps)
        norm = None
    return launch(ops, x, w, storage, (out, n_in), bias, norm, act, gated, residual, tile=tile, splits=splits)


def launch(ops, x, w, storage, shape, bias, norm, act, gated, residual, *, name="tc_gemm", extra=None,
           weight_args=None, tile=None, splits=None):
    """Plan and launch tc_gemm (or tc_quant_gemm: `name`, its format `extra` defines and `weight_args`, the
    arrays in the kernel's weight slots) -> y [T, ncols] float32, or None when plan declines."""
    (out, n_in), T = shape, x.shape[0]
    norm_bias = norm is not None and norm.kind == "layernorm" and norm.bias is not None
    plan_ = plan(T, n_in, out, storage, _sm_count(ops), name=name, norm=None if norm is None else norm.kind,
                 norm_bias=norm_bias, act=act, gated=gated, has_bias=bias is not None,
                 has_residual=residual is not None, extra=extra, tile=tile, splits=splits)
    fn = None if plan_ is None else ops._kernel(name, name, **plan_.defines)
    if fn is None:
        return None
    cp = ops.xp
    ncols = out // 2 if gated else out
    x, ldx = ops._rows(x)
    y = cp.empty((T, ncols), dtype=F32)
    residual, ldr = ops._rows(residual) if residual is not None else (y, ncols)
    bias = y if bias is None else bias                       # unused pointers: any device array
    gamma = y if norm is None else norm.weight
    beta = norm.bias if norm_bias else gamma
    eps = 0.0 if norm is None else norm.eps
    partial = cp.empty((plan_.splits, T, out), dtype=F32) if plan_.splits > 1 else y
    weights = (w,) if weight_args is None else weight_args
    fn(plan_.grid, plan_.block, (x, gamma, beta, np.float32(eps), *weights, bias, residual, y, partial,
                                 np.int32(T), np.int32(n_in), np.int32(out), np.int64(ldx), np.int64(ldr),
                                 np.int64(ncols)))
    if plan_.splits > 1:
        reduce = ops._kernel(name, name + "_reduce", **plan_.defines)
        reduce(plan_.reduce_grid, (REDUCE_BLOCK,), (partial, bias, residual, y, np.int32(T), np.int32(out),
                                                    np.int32(plan_.splits), np.int64(ldr), np.int64(ncols)))
    return y
