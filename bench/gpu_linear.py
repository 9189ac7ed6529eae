"""python -m bench.gpu_linear: the decode GEMV kernels alone against the copy bandwidth and cuBLAS.

For each projection shape of a preset's layer, each token count T (decode batch), each SBI tiling (`--tiling`,
backend/cupy_sbi.plan: "rows" the default, "cols" the old one, "rows:WxRxU" a forced block shape) and each fused
input norm (`--norm`: none is CupyOps.linear's path), the median time of one SBI call (cupy_sbi.fused_linear: the
kernel CupyOps.linear / fused_linear launch, plus its split reduction if any; x float32 [T, in], W [out, in]
float16) and, once per shape and T, of one float16 cuBLAS product through torch (F.linear), each timed as REPS
calls captured in one CUDA graph (so that Python's launch cost is out of the numbers) over enough copies of the
weight to spill the L2. Reported per row: the tiling, norm, grid and block, us per call, weight bytes / time in GB/s
and as a fraction of the device-to-device copy measured in the same run, the SBI/cuBLAS time ratio, and the
kernel's largest relative error against float32 norm(x) @ W^T. A diagnostic for docs/gpu.md's decode numbers
(where the step's time goes), not a benchmark of record; needs a CUDA GPU (on the CPU stand-in the times mean
nothing).

    python -m bench.gpu_linear --preset gpt2-1.5b --tokens 1,4,16 --tiling rows,cols --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hpcinfer.arch import tensor_shapes
from hpcinfer.backend import cupy_sbi
from hpcinfer.backend.cupy_ops import CupyOps
from hpcinfer.backend.interface import NormParams
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.bench.common import median
from .gpu import Timer

REPS = 20                 # calls per captured graph
L2_SPILL_BYTES = 256 << 20  # weight copies rotated per graph: at least this many bytes (H200 L2: 60 MB)


def layer_shapes(arch) -> list[tuple[int, int]]:
    """The distinct [out, in] matrix shapes of layer 0, in first-seen order."""
    seen = []
    for name, shape in tensor_shapes(arch).items():
        if name.startswith("layers.0.") and len(shape) == 2 and tuple(shape) not in seen:
            seen.append(tuple(shape))
    return seen


def graph_ms(cp, calls) -> float:
    """Median ms of one call of `calls` (a list of REPS thunks) replayed as one captured CUDA graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for call in calls:
            call()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = Timer(cp).repeat(lambda: graph.launch(stream), 7, warmup=0)   # events on `stream`
    return median(times) / len(calls)


def torch_graph_ms(torch, calls) -> float:
    """The same for torch thunks, through torch.cuda.CUDAGraph (cuBLAS may be captured there)."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for call in calls[:3]:
            call()                                     # warm-up: cuBLAS handles and workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return median(times)


def copy_GBps(cp, nbytes: int) -> float:
    src = cp.arange(nbytes // 4, dtype=np.float32)
    dst = cp.empty_like(src)
    ms = graph_ms(cp, [lambda: cp.copyto(dst, src)] * 4)
    return 2 * src.nbytes / (ms / 1e3) / 1e9


def norm_params(cp, kind: str | None, n_in: int, rng) -> NormParams | None:
    """Random float32 norm parameters of `kind` ("rmsnorm", "layernorm" with a bias) on the device, or None."""
    if kind is None:
        return None
    weight = cp.asarray((1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(n_in).astype(np.float32)) if kind == "layernorm" else None
    return NormParams(kind, weight, bias, 1e-5)


def normalized(cp, x, norm: NormParams | None):
    """The float32 reference of the fused input norm (NumpyOps.rms_norm / layer_norm in cupy)."""
    if norm is None:
        return x
    mean = x.mean(axis=-1, keepdims=True) if norm.kind == "layernorm" else 0.0
    h = x - mean
    h = h / cp.sqrt((h * h).mean(axis=-1, keepdims=True) + norm.eps) * norm.weight
    return h if norm.bias is None else h + norm.bias


def measure(cp, torch, ops, out: int, n_in: int, tokens: int, copy: float, spill: int, tiling: str = "rows",
            norm_kind: str | None = None) -> dict:
    """One row: the SBI kernel (`tiling`, fused `norm_kind`) on W [out, n_in] float16 and x [tokens, n_in]; with
    `torch`, the cuBLAS time of the same product too."""
    wbytes = out * n_in * 2
    copies = max(2, -(-spill // wbytes))
    rng = np.random.default_rng(out * 7 + n_in + tokens)
    host = rng.standard_normal((out, n_in), dtype=np.float32).astype(np.float16)
    ws = [cp.asarray(host) for _ in range(copies)]
    x = cp.asarray(rng.standard_normal((tokens, n_in), dtype=np.float32))
    norm = norm_params(cp, norm_kind, n_in, rng)
    launch = cupy_sbi.plan(tokens, n_in, out, np.float16, cp.cuda.Device().attributes["MultiProcessorCount"],
                           norm=norm_kind, norm_bias=norm_kind == "layernorm", tiling=tiling)
    sbi = lambda w: cupy_sbi.fused_linear(ops, x, w, norm=norm, tiling=tiling)      # noqa: E731
    got = sbi(ws[0])
    if got is None:
        raise RuntimeError(f"the SBI kernel declined [{tokens}, {n_in}] x [{out}, {n_in}] (tiling {tiling})")
    reference = normalized(cp, x, norm) @ ws[0].astype(np.float32).T
    err = float(cp.abs(got - reference).max() / cp.abs(reference).max())
    ours = graph_ms(cp, [lambda w=ws[i % copies]: sbi(w) for i in range(REPS)])
    row = {"out": out, "in": n_in, "T": tokens, "tiling": tiling, "norm": norm_kind or "none",
           "grid": list(launch.grid), "block": list(launch.block), "weight_MB": wbytes / 1e6, "max_rel_err": err,
           "sbi_us": ours * 1e3, "sbi_GBps": wbytes / (ours / 1e3) / 1e9}
    row["sbi_of_copy"] = row["sbi_GBps"] / copy
    if torch is not None:
        tws = [torch.as_tensor(w, device="cuda") for w in ws]
        tx = torch.as_tensor(x, device="cuda").half()
        theirs = torch_graph_ms(torch, [lambda w=tws[i % copies]: torch.nn.functional.linear(tx, w)
                                        for i in range(REPS)])
        row.update(cublas_us=theirs * 1e3, cublas_GBps=wbytes / (theirs / 1e3) / 1e9, sbi_over_cublas=ours / theirs)
        del tws
    del ws
    cp.get_default_memory_pool().free_all_blocks()
    return row


def table(rows: list[dict], copy: float) -> str:
    """The rows as a markdown table; every row's SBI/cuBLAS against the cuBLAS time of its shape and T."""
    cublas = {(r["out"], r["in"], r["T"]): r["cublas_us"] for r in rows if "cublas_us" in r}
    lines = [f"copy {copy:.0f} GB/s",
             "| out x in | T | tiling | norm | grid | block | SBI us | SBI GB/s | of copy | cuBLAS us | SBI/cuBLAS "
             "| err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['out']}x{r['in']} | {r['T']} | {r.get('tiling', '')} | {r.get('norm', '')} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} |")
            continue
        theirs = cublas.get((r["out"], r["in"], r["T"]), float("nan"))
        lines.append(f"{head} {tuple(r['grid'])} | {tuple(r['block'])} | {r['sbi_us']:.1f} | {r['sbi_GBps']:.0f} | "
                     f"{r['sbi_of_copy']:.2f} | {theirs:.1f} | {r['sbi_us'] / theirs:.2f} | {r['max_rel_err']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-1.5b", choices=sorted(PRESETS))
    p.add_argument("--tokens", default="1,4,16", help="comma-separated token counts T")
    p.add_argument("--tiling", default="rows",
                   help="comma-separated SBI tilings: rows (the default), cols (the old one), rows:WxRxU")
    p.add_argument("--norm", default="none", help="comma-separated fused input norms: none, rmsnorm, layernorm")
    p.add_argument("--out", default="bench/results", help="folder for gpu-linear.json")
    p.add_argument("--copy-mb", type=int, default=1024, help="bytes of the copy measured (MiB)")
    p.add_argument("--spill-mb", type=int, default=L2_SPILL_BYTES >> 20, help="weight copies per graph (MiB)")
    args = p.parse_args(argv)
    import cupy as cp
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    tilings = args.tiling.split(",")
    norms = [None if n == "none" else n for n in args.norm.split(",")]
    for tiling in tilings:
        try:
            cupy_sbi.tile(tiling, 1)                        # an unknown tiling fails here, before any GPU work
        except ValueError as exc:
            p.error(f"--tiling: {exc}")
    if any(n not in (None, "rmsnorm", "layernorm") for n in norms):
        p.error(f"--norm: none, rmsnorm or layernorm, got {args.norm!r}")
    ops = CupyOps(device=0)
    copy = copy_GBps(cp, args.copy_mb << 20)
    rows = []
    for out, n_in in layer_shapes(PRESETS[args.preset]):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for i, (norm, tiling) in enumerate((n, t) for n in norms for t in tilings):
                try:                                        # cuBLAS once per shape and T
                    rows.append(measure(cp, torch if i == 0 else None, ops, out, n_in, tokens, copy,
                                        args.spill_mb << 20, tiling, norm))
                except Exception as exc:  # noqa: BLE001 - one failing shape is reported, the others still run
                    rows.append({"out": out, "in": n_in, "T": tokens, "tiling": tiling, "norm": norm or "none",
                                 "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"preset": args.preset, "copy_GBps": copy, "reps_per_graph": REPS, "tilings": tilings,
              "norms": args.norm.split(","), "rows": rows, "emulated": bool(getattr(cp, "_emulated", False))}
    (Path(args.out) / "gpu-linear.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows, copy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
