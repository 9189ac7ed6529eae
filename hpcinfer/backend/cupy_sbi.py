"""SBI-GeMM and the Deep-Fusion regions on the GPU: the launch wrappers of cuda_src/sbi_gemv.cu and
cuda_src/fused_norm_gemv.cu, for CupyOps.linear and CupyOps.fused_linear.

    y[T, ncols] = act(norm(x) @ W^T + bias) (+ residual)      T <= SBI_MAX_TOKENS tokens, float32 compute

`plan` (pure Python, no GPU) picks the module and the launch from the shapes: the token bucket MAX_TOKENS (the
smallest of TOKEN_BUCKETS >= T: five compiled variants per define set instead of sixteen, at the cost of registers
held for up to 2x the tokens), the block shape of the tiling, and SPLITS, the blocks along the input dimension, for
layers whose output columns alone make too few blocks to fill the GPU (see choose_splits).

Tiling (sbi_core.cuh): "rows" (TILING=1, the default) gives each warp RW rows of W and walks the input with its 32
lanes, 16 bytes each: a warp load is 512 contiguous bytes of one row (the old "cols" tiling, lanes across 32
columns, touched 32 rows per load with the row-major weights: 32 sectors, half used), UNROLL x RW loads in flight
per lane, a shuffle sum at the end. Its blocks hold 4 to 6 columns (ROW_TILES), so every projection with
out >= 1600 makes >= 2 blocks per SM of 132 without an input split: one kernel, where the old tiling's 32-column
blocks needed splits and the *_reduce kernel (12% of a gpt2-1.5b decode step, measured on an H200). For T > 1 the
block stages its x rows (normalized, when a norm is fused) in shared memory, so that each x vector is read once per
token and serves the warp's RW rows. "cols" (TILING=0) is kept so that one GPU run of bench/gpu_linear
(`--tiling rows,cols`) compares both on the same shapes; "rows:WxRxU" forces a block shape there, to tune
ROW_TILES.

`fused_linear` checks the arrays (dtypes, layout, alignment) and launches, or answers None when the kernel does not
apply; the caller then runs cuBLAS (linear) or the unfused ops in sequence (fused_linear).

Weight layout: W_ROWMAJOR=1, the kernel reads W [out, in] as loaded (contiguous, in % VEC == 0, 16-byte aligned).
Chosen over the packed SBI layout (kernels/layout.sbi_pack, made by a prepare-weight hook at load) because cuBLAS
reads [out, in] for large batches: the packed layout would need a second copy of every weight (2x weight memory,
the very thing offload and tp exist to save) or cuBLAS on an unpacked view it cannot express, and the offload tiers,
quantized formats and checkpoint readers all keep seeing one plain [out, in] array. The cost: each lane's 16-byte
vector under the old column tiling is half a 32-byte sector at stride `in`; the row tiling reads the row-major
weights fully coalesced, which is what the packed layout was for. Only W_ROWMAJOR=1 is wired, so the layout is not a
[runtime] option (note in docs/gpu.md).

Fused with tp == 1 only for the residual (region 4): with tp > 1 the row-parallel partial sums are all-reduced
between the GEMV and the bias + residual add (parallel/layers.py RowParallelLinear).

Shape legend: T=tokens, in=input features, out=weight rows (2F when gated), ncols=output columns (F when gated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

F32 = np.float32
TOKEN_BUCKETS = (1, 2, 4, 8, 16)      # MAX_TOKENS of the compiled variants
SBI_MAX_TOKENS = TOKEN_BUCKETS[-1]    # above this, cuBLAS (a GEMM reads each weight once for all tokens anyway)
TILINGS = ("rows", "cols")            # TILING=1 (the default) and the old TILING=0, kept to compare on a GPU;
                                      # "rows:WxRxU" forces WARPS x RW x UNROLL (a tuning aid for gpu_linear)
# rows: (WARPS, RW, UNROLL) per token bucket: WARPS * RW output columns per block (<= 6, so that out >= 1600 gives
# >= 2 blocks per SM of 132 without an input split), UNROLL x RW (x2 gated) 512-byte warp loads in flight. RW = 2
# from T = 3 on: each x vector read from shared memory serves 2 (gated 4) rows, and the block's x staging (T * in
# floats from L2) is spread over 6 columns; UNROLL shrinks as the accumulators acc[RW][T] grow.
ROW_TILES = {1: (4, 1, 8), 2: (4, 1, 8), 4: (3, 2, 4), 8: (3, 2, 4), 16: (3, 2, 2)}
XS_FLOATS = 8192                      # rows: shared x staging per block (32 KiB), as sbi_core.cuh's XS_FLOATS
XS_LIMIT = 40 * 1024                  # rows: the most bytes of x tile sbi_core.cuh allows (its static_assert)
WARPS, ROWS, UNROLL = 4, 1, 4         # cols: block (32, WARPS), 32 * ROWS output columns per block
WAVES = 2                             # blocks per SM the input splits aim for, where a split is made
MAX_SPLITS = 16                       # the partial workspace is [SPLITS, T, out] float32
REDUCE_BLOCK = 256                    # threads per block of the *_reduce kernels (their __launch_bounds__)

_STORAGE = {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16"}   # uint16 = bfloat16 bits
_ACT = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}                  # common.cuh ACT_*
_NORM = {"rmsnorm": 1, "layernorm": 2}                                             # sbi_core.cuh NORM_*


def token_bucket(tokens: int) -> int | None:
    """The smallest MAX_TOKENS >= tokens, or None (no tokens, or more than SBI_MAX_TOKENS: cuBLAS)."""
    return next((b for b in TOKEN_BUCKETS if b >= tokens), None) if tokens >= 1 else None


@dataclass(frozen=True)
class Tile:
    """A block's shape under one tiling: (32, warps) threads over `cols` output columns; a split of the input must
    keep at least `min_vecs` 16-byte vectors (one full batch of loads per warp)."""

    warps: int                # WARPS
    cols: int                 # output columns per block: WARPS * RW (rows), 32 * ROWS (cols)
    unroll: int               # UNROLL
    rows_per_warp: int        # rows: RW; cols: 0 (ROWS columns per lane instead)
    min_vecs: int             # rows: 32 lanes x UNROLL; cols: WARPS x UNROLL


def tile(tiling: str, bucket: int) -> Tile:
    """The block shape of `tiling` for token bucket `bucket`: "rows" (ROW_TILES), "cols", or "rows:WxRxU" (WARPS,
    RW, UNROLL given, e.g. "rows:8x2x2"). Raises ValueError for anything else."""
    if tiling == "cols":
        return Tile(WARPS, 32 * ROWS, UNROLL, 0, WARPS * UNROLL)
    if tiling == "rows":
        warps, rw, unroll = ROW_TILES[bucket]
    else:
        match = re.fullmatch(r"rows:(\d+)x(\d+)x(\d+)", tiling)
        warps, rw, unroll = map(int, match.groups()) if match else (0, 0, 0)
        if not (1 <= warps <= 32 and rw >= 1 and unroll >= 1):
            raise ValueError(f"tiling must be 'rows', 'cols' or 'rows:WxRxU' (1 <= W <= 32), got {tiling!r}")
    return Tile(warps, warps * rw, unroll, rw, 32 * unroll)


def choose_splits(ncols: int, n_in: int, vec: int, sm_count: int, tiling: str = "rows", bucket: int = 1) -> int:
    """Blocks along the input dimension (grid.y; > 1 costs the *_reduce kernel and a [SPLITS, T, out] workspace).

    rows: split only when the output columns give fewer blocks than SMs (a small model, a tp shard): some SMs would
    idle. Then aim for WAVES blocks per SM. With 4 to 6 columns per block every projection of a model with
    D >= 1600 fills 132 SMs alone, so the common case is one kernel.
    cols (the old tiling, 32 columns per block): split whenever the columns give fewer than WAVES blocks per SM.
    Either way every split keeps at least one full batch of loads per warp (Tile.min_vecs vectors)."""
    shape = tile(tiling, bucket)
    col_blocks = -(-ncols // shape.cols)
    if tiling != "cols" and col_blocks >= sm_count:
        return 1
    wanted = -(-WAVES * sm_count // col_blocks)
    most = max(1, -(-n_in // vec) // shape.min_vecs)
    return max(1, min(wanted, most, MAX_SPLITS))


def x_tile(n_in: int, vec: int, bucket: int, unroll: int) -> int:
    """rows: x elements per token staged in shared memory at a time (X_TILE): all of the row when it fits in
    XS_FLOATS / bucket floats (one staging, norm statistics from shared memory), else the most whole batches that
    fit; a whole number of batches (32 * UNROLL * VEC elements) either way."""
    unit = 32 * unroll * vec
    return min(max(unit, XS_FLOATS // bucket // unit * unit), -(-n_in // unit) * unit)


@dataclass(frozen=True)
class Launch:
    """One SBI launch: the module (file and function name), its #defines and both grids."""

    name: str                  # "sbi_gemv" | "fused_norm_gemv" (file and kernel); the reduction is name + "_reduce"
    defines: dict
    grid: tuple                # (ceil(ncols / columns per block), SPLITS)
    block: tuple               # (32, warps)
    splits: int
    reduce_grid: tuple         # (ceil(T ncols / REDUCE_BLOCK),): only launched when splits > 1


def plan(tokens: int, n_in: int, out: int, weight_dtype, sm_count: int, *, norm: str | None = None,
         norm_bias: bool = False, act: str | None = None, gated: bool = False, has_bias: bool = False,
         has_residual: bool = False, x_vec: bool = True, tiling: str = "rows") -> Launch | None:
    """The launch for x [tokens, n_in] (float32) and W [out, n_in] of `weight_dtype` (float32, float16 or uint16
    bfloat16 bits), or None where the kernel does not apply: tokens outside 1 .. SBI_MAX_TOKENS, another weight
    dtype, n_in not a whole number of 16-byte vectors (the row-major read), an odd `out` or no activation when
    gated, an unknown activation or norm. `tiling`: "rows" (TILING=1) or "cols" (the old TILING=0)."""
    bucket, storage = token_bucket(tokens), _STORAGE.get(np.dtype(weight_dtype).name)
    if bucket is None or storage is None or act not in _ACT or (norm is not None and norm not in _NORM):
        return None
    vec = 16 // np.dtype(weight_dtype).itemsize
    if n_in < 1 or n_in % vec or out < 1 or (gated and (out % 2 or act is None)):
        return None
    ncols = out // 2 if gated else out
    shape = tile(tiling, bucket)                        # raises ValueError for an unknown tiling
    splits = choose_splits(ncols, n_in, vec, sm_count, tiling, bucket)
    defines = {"T_STORAGE": storage, "T_ACT": "float", "MAX_TOKENS": bucket, "TILING": int(tiling != "cols"),
               "WARPS": shape.warps, "UNROLL": shape.unroll}
    if tiling != "cols":
        tile_x = x_tile(n_in, vec, bucket, shape.unroll)
        if bucket * tile_x * 4 > XS_LIMIT:
            raise ValueError(f"tiling {tiling!r}: one batch of x for {bucket} tokens exceeds {XS_LIMIT} bytes of "
                             "shared memory (lower UNROLL)")
        defines.update(RW=shape.rows_per_warp, X_TILE=tile_x)
    else:
        defines.update(ROWS=ROWS)
    defines.update({"ACT": _ACT[act], "HAS_BIAS": int(has_bias), "HAS_RESIDUAL": int(has_residual),
                    "GATED": int(gated), "X_VEC": int(x_vec), "W_ROWMAJOR": 1})
    if norm is not None:
        defines.update(NORM=_NORM[norm], NORM_BIAS=int(norm_bias))
    return Launch("fused_norm_gemv" if norm is not None else "sbi_gemv", defines,
                  (-(-ncols // shape.cols), splits), (32, shape.warps), splits,
                  (-(-tokens * ncols // REDUCE_BLOCK),))


def _address(a) -> int:
    """Device address of a cupy array (the host address of a NumPy one: the emulator tests run these wrappers)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def _vector_ok(a, n: int) -> bool:
    """A float32 contiguous [n] parameter (bias, norm weight)."""
    return a.dtype == F32 and a.shape == (n,) and a.flags.c_contiguous


def fused_linear(ops, x, w, bias=None, norm=None, act=None, gated=False, residual=None, *, tiling="rows"):
    """act(norm(x) @ w.T + bias) (+ residual) -> [T, ncols] float32 through one SBI kernel (two with SPLITS > 1),
    or None when the kernel does not apply (kernels off, T > SBI_MAX_TOKENS, a layout or dtype it does not take).
    `ops`: the CupyOps; norm: a backend.ops.NormParams or None; tiling: see plan (bench/gpu_linear
    compares both)."""
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
                  has_residual=residual is not None, x_vec=x_vec, tiling=tiling)
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
