"""python -m bench.gpu_attention: decode attention alone, against the copy bandwidth (issue 29, item 2).

For each head shape (`--shapes H:Hkv:hd`, default gpt2-1.5b's 25:25:64 and Llama-3.1-8B's 32:8:128), KV dtype
(`--dtypes`, default float16 and float32), cache layout (dense slots and the paged pool of 16-position blocks), batch
(`--batches`, default 1 and 16) and context (`--contexts`, default 128, 1024 and 4096): the median time of one
CupyOps.attention decode step (one launch of decode_attention / paged_decode_attention: append, rotary, attention,
the split and its combine), timed as REPS steps captured in one CUDA graph (no Python in the numbers), and the K/V
bytes it must read (S Hkv L hd itemsize, twice) over that time, in GB/s and as a fraction of a device-to-device copy
measured in the same run. Also the chunk count the policy chose, and the largest error against NumpyOps.attention
on the same inputs over a float32 copy of the cache (the new row is not rounded to the cache's dtype there). Needs a CUDA GPU; on the CPU stand-in (`--quick`) it rehearses the
same calls with tiny sizes and the times mean nothing.

    python -m bench.gpu_attention --out DIR                  # the sweep of docs/gpu.md, a few seconds on an H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hpcinfer.backend import cupy_decode
from hpcinfer.backend.cupy_graphs import DeviceStep, PagedDeviceStep
from hpcinfer.backend.cupy_ops import CupyOps
from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps

REPS = 20                 # decode steps per captured graph
BLOCK_SIZE = 16           # the paged pool's positions per block
SHAPES = "25:25:64,32:8:128"
QUICK = {"shapes": "4:2:64", "contexts": "20,70", "batches": "1,2", "dtypes": "float16", "copy_mb": 1}


def graph_ms(cp, calls) -> float:
    """Median ms of one call of `calls` (thunks) replayed as one captured CUDA graph: CUDA events, or on the CPU
    stand-in (no events) perf_counter around a synchronized replay."""
    events = hasattr(cp.cuda, "get_elapsed_time") and not getattr(cp, "_emulated", False)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for call in calls:
            call()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(7 if events else 1):
            if events:
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end))
            else:
                t0 = time.perf_counter()
                graph.launch(stream)
                stream.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) / len(calls)


def copy_GBps(cp, nbytes: int) -> float:
    """Device-to-device copy bandwidth: read + write bytes over time."""
    src, dst = cp.ones(nbytes // 4, dtype=np.float32), cp.empty(nbytes // 4, dtype=np.float32)
    ms = graph_ms(cp, [lambda: cp.copyto(dst, src)] * 4)
    return 2 * nbytes / ms / 1e6


def step_inputs(rng, batch: int, context: int, heads: int, kv_heads: int, hd: int, dtype, paged: bool):
    """(host q, k, v [S, heads, hd] float32, cos, sin [S, hd/2], caches, host StepLayout): sequence s decodes at
    position context - 1 (reads `context` positions); the cache holds random rows in `dtype`."""
    q, k, v = (rng.standard_normal((batch, n, hd)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    angles = rng.uniform(0, 2 * np.pi, (batch, hd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    starts = [context - 1] * batch
    if paged:
        per = -(-context // BLOCK_SIZE)
        tables = rng.permutation(batch * per).astype(np.int32).reshape(batch, per)    # scattered blocks
        shape = (batch * per, kv_heads, BLOCK_SIZE, hd)
        step = StepLayout.paged(tables, BLOCK_SIZE, starts, [1] * batch)
    else:
        shape = (batch, kv_heads, context, hd)
        step = StepLayout.build(list(range(batch)), starts, [1] * batch)
    caches = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    return (q, k, v), (cos, sin), caches, step


def measure(cp, ops, rng, batch, context, shape, dtype, paged, copy) -> dict:
    heads, kv_heads, hd = shape
    (q, k, v), (cos, sin), caches, step = step_inputs(rng, batch, context, heads, kv_heads, hd, dtype, paged)
    want = NumpyOps().attention(q, k, v, *[c.astype(np.float32) for c in caches], step, 1 / np.sqrt(hd),
                                rope=(cos, sin, hd))       # float32 caches of the same values (the new row unrounded)
    dev = [ops.asarray(a) for a in (q, k, v, cos, sin)]
    cache_k, cache_v = (ops.asarray(c) for c in caches)
    device_step = (PagedDeviceStep if paged else DeviceStep).upload(cp, step, context)
    chosen = []
    splits = cupy_decode.decode_splits
    cupy_decode.decode_splits = lambda *a: chosen.append(splits(*a)) or chosen[-1]
    try:
        call = lambda: ops.attention(*dev[:3], cache_k, cache_v, device_step, 1 / np.sqrt(hd),
                                     rope=(dev[3], dev[4], hd))
        got = ops.to_host(call())
        ms = graph_ms(cp, [call] * REPS)
    finally:
        cupy_decode.decode_splits = splits
    kv_bytes = 2 * batch * kv_heads * context * hd * np.dtype(dtype).itemsize
    return {"layout": "paged" if paged else "dense", "dtype": np.dtype(dtype).name, "heads": heads,
            "kv_heads": kv_heads, "head_dim": hd, "batch": batch, "context": context, "chunks": chosen[0],
            "us": ms * 1e3, "kv_bytes": kv_bytes, "GBps": kv_bytes / ms / 1e6,
            "of_copy": kv_bytes / ms / 1e6 / copy,
            "max_abs_err": float(np.abs(got - want).max())}


def table(rows: list[dict], copy: float) -> str:
    lines = [f"copy {copy:.0f} GB/s",
             "| layout | dtype | H:Hkv:hd | batch | context | chunks | us | K/V MB | GB/s | of copy | max err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['dtype']} | {r['heads']}:{r['kv_heads']}:{r['head_dim']} | {r['batch']} "
                     f"| {r['context']} | {r['chunks']} | {r['us']:.1f} | {r['kv_bytes'] / 1e6:.2f} | "
                     f"{r['GBps']:.0f} | {r['of_copy']:.2f} | {r['max_abs_err']:.1e} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_attention", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="H:Hkv:hd head shapes, comma-separated")
    p.add_argument("--contexts", default="128,1024,4096")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--dtypes", default="float16,float32", help="KV cache dtypes (float16, float32)")
    p.add_argument("--copy-mb", type=int, default=1024, help="bytes of the copy measured (MiB)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU stand-in's rehearsal)")
    p.add_argument("--out", default=None, help="folder for gpu-attention.json and .md")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    bad = [s for s in shapes if len(s) != 3 or not cupy_decode.decode_fits(*s)]
    if bad:
        p.error(f"--shapes {args.shapes!r}: {bad} do not fit the decode kernels (H:Hkv:hd, H a multiple of Hkv, "
                f"H / Hkv <= {cupy_decode.MAX_GROUP}, hd <= {cupy_decode.MAX_HEAD_DIM})")
    dtypes = args.dtypes.split(",")
    if set(dtypes) - {"float16", "float32"}:
        p.error(f"--dtypes {args.dtypes!r}: float16 and float32 only")
    ops = CupyOps(device=0)
    cp = ops.xp
    copy = copy_GBps(cp, args.copy_mb << 20)
    rng = np.random.default_rng(0)
    rows = [measure(cp, ops, rng, batch, context, shape, np.dtype(dtype), paged, copy)
            for shape in shapes for dtype in dtypes for paged in (False, True)
            for batch in _ints(args.batches) for context in _ints(args.contexts)]
    print(table(rows, copy))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu-attention.json").write_text(json.dumps({"copy_GBps": copy, "reps_per_graph": REPS,
                                                            "rows": rows}, indent=1))
        (out / "gpu-attention.md").write_text(table(rows, copy) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
