"""python -m bench.gpu_gemm: the small-batch GEMM sweep of issue 29 (item 6) - the SBI GEMV, the
tensor-core GEMM (cuda_src/tc_gemm.cu) and torch's cuBLAS on the model's matrix shapes, against the copy bandwidth.

For each [out, in] shape (gpt2-1.5b's layer and a Llama-3.1-8B layer: qkv, o, gate+up, down; `--shapes` picks) and
each T of `--tokens` (default 1, 2, 4, 8, 16, 32, 64): the median time of one call of
  gemv    cupy_sbi.fused_linear (what CupyOps.linear runs at T = 1; it declines above 16 tokens: "-")
  tc      cupy_tc_gemm.fused_linear (what CupyOps.linear runs at 2 .. 64 tokens; declines at T = 1: "-")
  cublas  torch.nn.functional.linear in float16 (x rounded to float16), when a CUDA torch is there
each as REPS calls captured in one CUDA graph over weight copies that spill the L2 (gpu_linear's timing), with x
float32 [T, in] and W float16 [out, in]. Per row: us, weight GB/s and its fraction of the device-to-device copy
measured in the same run, tc/cuBLAS, and the tc kernel's largest error relative to float32 x @ W^T. Captured
cuBLASLt through ctypes is not built (torch's cuBLAS, captured by torch's own graph, stands in for it).

    python -m bench.gpu_gemm --out DIR [--tokens 1,2,4,8,16,32,64] [--shapes gpt2,llama8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from hpcinfer.backend import cupy_sbi, cupy_tc_gemm
from hpcinfer.backend.cupy_ops import CupyOps
from hpcinfer.checkpoint.presets import PRESETS
from .gpu_linear import L2_SPILL_BYTES, REPS, copy_GBps, graph_ms, layer_shapes, torch_graph_ms

TOKENS = (1, 2, 4, 8, 16, 32, 64)
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]     # [out, in]: qkv, o, gate+up, down


def shape_sets(names: list[str]) -> dict[str, list[tuple[int, int]]]:
    """{name: [(out, in), ...]}: "gpt2" (gpt2-1.5b's layer 0), "llama8b", or any preset's name."""
    sets = {}
    for name in names:
        if name == "gpt2":
            sets[name] = layer_shapes(PRESETS["gpt2-1.5b"])
        elif name == "llama8b":
            sets[name] = LLAMA_8B
        elif name in PRESETS:
            sets[name] = layer_shapes(PRESETS[name])
        else:
            raise ValueError(f"--shapes: gpt2, llama8b or a preset ({', '.join(sorted(PRESETS))}), got {name!r}")
    return sets


def measure(cp, torch, ops, out: int, n_in: int, tokens: int, copy: float, spill: int) -> dict:
    """One row: each path on W [out, n_in] float16 and x [tokens, n_in] float32."""
    wbytes = out * n_in * 2
    copies = max(2, -(-spill // wbytes))
    rng = np.random.default_rng(out + 3 * n_in + tokens)
    host = (rng.standard_normal((out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)
    ws = [cp.asarray(host) for _ in range(copies)]
    x = cp.asarray(rng.standard_normal((tokens, n_in), dtype=np.float32))
    row = {"out": out, "in": n_in, "T": tokens, "weight_MB": wbytes / 1e6}
    paths = {"gemv": lambda w: cupy_sbi.fused_linear(ops, x, w),
             "tc": lambda w: cupy_tc_gemm.fused_linear(ops, x, w)}
    reference = x @ ws[0].astype(np.float32).T
    for name, call in paths.items():
        got = call(ws[0])
        if got is None:
            continue                                   # the path declines this T
        row[f"{name}_err"] = float(cp.abs(got - reference).max() / cp.abs(reference).max())
        ms = graph_ms(cp, [lambda w=ws[i % copies]: call(w) for i in range(REPS)])
        row.update({f"{name}_us": ms * 1e3, f"{name}_of_copy": wbytes / (ms / 1e3) / 1e9 / copy})
    if torch is not None:
        tws = [torch.as_tensor(w, device="cuda") for w in ws]
        tx = torch.as_tensor(x, device="cuda").half()
        ms = torch_graph_ms(torch, [lambda w=tws[i % copies]: torch.nn.functional.linear(tx, w) for i in range(REPS)])
        row.update(cublas_us=ms * 1e3, cublas_of_copy=wbytes / (ms / 1e3) / 1e9 / copy)
        del tws
    if "tc_us" in row and "cublas_us" in row:
        row["tc_over_cublas"] = row["tc_us"] / row["cublas_us"]
    del ws
    cp.get_default_memory_pool().free_all_blocks()
    return row


def table(rows: list[dict], copy: float) -> str:
    cell = lambda r, k, f: format(r[k], f) if k in r else "-"                 # noqa: E731
    lines = [f"copy {copy:.0f} GB/s; of copy = weight bytes / time / copy bandwidth",
             "| set | out x in | T | GEMV us | of copy | TC us | of copy | cuBLAS us | of copy | TC/cuBLAS | TC err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['set']} | {r['out']}x{r['in']} | {r['T']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} |")
            continue
        lines.append(f"{head} {cell(r, 'gemv_us', '.1f')} | {cell(r, 'gemv_of_copy', '.2f')} | "
                     f"{cell(r, 'tc_us', '.1f')} | {cell(r, 'tc_of_copy', '.2f')} | {cell(r, 'cublas_us', '.1f')} | "
                     f"{cell(r, 'cublas_of_copy', '.2f')} | {cell(r, 'tc_over_cublas', '.2f')} | "
                     f"{cell(r, 'tc_err', '.1e')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_gemm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts T")
    p.add_argument("--shapes", default="gpt2,llama8b", help="comma-separated: gpt2, llama8b, or preset names")
    p.add_argument("--out", default="bench/results", help="folder for gpu-gemm.json")
    p.add_argument("--copy-mb", type=int, default=1024, help="bytes of the copy measured (MiB)")
    p.add_argument("--spill-mb", type=int, default=L2_SPILL_BYTES >> 20, help="weight copies per graph (MiB)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds; rows past it are skipped (0: no limit)")
    args = p.parse_args(argv)
    try:
        sets = shape_sets(args.shapes.split(","))
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    import cupy as cp
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    start, ops = time.monotonic(), CupyOps(device=0)
    copy = copy_GBps(cp, args.copy_mb << 20)
    rows = []
    for set_name, shapes in sets.items():
        for out, n_in in shapes:
            for t in tokens:
                if args.budget and time.monotonic() - start > args.budget:
                    rows.append({"set": set_name, "out": out, "in": n_in, "T": t, "error": "skipped: budget"})
                    continue
                try:
                    rows.append({"set": set_name, **measure(cp, torch, ops, out, n_in, t, copy,
                                                            args.spill_mb << 20)})
                except Exception as exc:  # noqa: BLE001 - one failing row is reported, the others still run
                    rows.append({"set": set_name, "out": out, "in": n_in, "T": t,
                                 "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"copy_GBps": copy, "reps_per_graph": REPS, "tokens": tokens, "rows": rows,
              "cublaslt_ctypes": "not built", "emulated": bool(getattr(cp, "_emulated", False))}
    (Path(args.out) / "gpu-gemm.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows, copy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
