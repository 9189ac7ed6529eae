"""CPU benchmark: hpcinfer (NumPy backend) against Hugging Face transformers on the same SmolLM2 weights, plus the
machine's memory read bandwidth, all in one run, back to back, in alternating rounds. See docs/bench-scripts.md.

    python -m bench.cpu --checkpoint models/smollm2.h5 --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out bench/results --repeats 5

Writes bench/results/cpu-<YYYY-MM-DD>.json (machine, versions, every raw timing, medians, ratios) and
bench/results/cpu-<YYYY-MM-DD>.md (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # before anything imports huggingface_hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")              # transformers' GGUF dequantization progress bar

import numpy as np  # noqa: E402

from hpcinfer.api import generate, load_model  # noqa: E402
from hpcinfer.checkpoint.format import open_checkpoint  # noqa: E402
from hpcinfer.generate.engine import StepTimes  # noqa: E402
from hpcinfer.generate.tokenizer import TextTokenizer  # noqa: E402
from hpcinfer.metrics import matmul_params, stored_matmul_params  # noqa: E402
from hpcinfer.bench.common import (CpuMeter, agreement, busy_warning, git_commit, loadavg, logger,  # noqa: E402
                                   machine_info, make_prompts, median, usable_cores)
from hpcinfer.bench.hf_baseline import Transformers  # noqa: E402
from .results import write_results  # noqa: E402

SWITCH_PAUSE_S = 0.25      # idle gap before each measured block: lets the other library's spinning threads sleep
log = logger("bench.cpu")


def flat(rounds: list) -> list:
    return [x for r in rounds for x in r]


# ---- memory read bandwidth -------------------------------------------------------------------------------------

class Bandwidth:
    """Memory read bandwidth from read-only passes over one ~`nbytes` float32 matrix A [R, C] (every page written
    first), on the configured threads. Three kernels, each reading every byte of A once and writing almost nothing:
      gemv_t: NumPy A @ x  (x [C]): BLAS sgemv, dot products along A's rows;
      gemv_n: NumPy x @ A  (x [R]): BLAS sgemv, axpy along A's rows;
      torch_sum: torch.sum(A) over the same memory (torch's OpenMP threads).
    Their speeds differ by ~10% on one machine; the reference bandwidth is the best median of the three."""

    COLS = 8192
    KERNELS = ("gemv_t", "gemv_n", "torch_sum")

    def __init__(self, nbytes: int):
        import torch

        rows = max(1, nbytes // (4 * self.COLS))
        self.a = np.empty((rows, self.COLS), dtype=np.float32)
        self.a.fill(1.0)                     # touch every page (np.zeros would leave them mapped to the zero page)
        self.x_cols = np.ones(self.COLS, dtype=np.float32)
        self.x_rows = np.ones(rows, dtype=np.float32)
        self.a_torch = torch.from_numpy(self.a)   # shares the memory
        self.nbytes, self.shape = self.a.nbytes, self.a.shape
        self.calls = {"gemv_t": lambda: np.dot(self.a, self.x_cols), "gemv_n": lambda: np.dot(self.x_rows, self.a),
                      "torch_sum": lambda: self.a_torch.sum()}

    def run(self, reps: int) -> dict:
        times = {k: [] for k in self.KERNELS}
        for _ in range(reps):
            for kernel in self.KERNELS:
                t0 = time.perf_counter()
                self.calls[kernel]()
                times[kernel].append(time.perf_counter() - t0)
        return times

    def release(self) -> None:
        self.a = self.a_torch = self.calls = None


# ---- hpcinfer --------------------------------------------------------------------------------------------------

class Hpcinfer:
    name = "hpcinfer"

    def __init__(self, checkpoint: str):
        t0 = time.perf_counter()
        self.model = load_model(checkpoint)
        self.load_s = time.perf_counter() - t0
        with open_checkpoint(checkpoint) as ckpt:
            self.tokenizer = TextTokenizer.from_checkpoint(ckpt)
        if self.tokenizer is None:
            raise SystemExit(f"bench.cpu: {checkpoint} holds no tokenizer")

    def generate(self, prompts: list, new_tokens: int):
        """(prefill_s, [decode step s], generated ids per prompt) on the default path (api.generate: continuous
        batching, every prompt running): the prompt steps (chunks of [schedule] max_batch_tokens, 512 by default),
        then batched decode steps."""
        times = StepTimes()
        tokens = generate(self.model, prompts, new_tokens, times=times)
        return times.prefill_s, list(times.decode_s), tokens


# ---- one round -------------------------------------------------------------------------------------------------

def measure(system, prompts: list, args) -> tuple[dict, dict]:
    """The three figures for one system, once: prefill of prompt 0 (extra prefill-only runs plus the one that
    starts the batch-1 generation), batch-1 decode steps, batch-`len(prompts)` prefill and decode steps."""
    time.sleep(SWITCH_PAUSE_S)
    prefill = []
    for _ in range(args.prefill_runs):
        p, _, _ = system.generate(prompts[:1], 1)
        prefill.append(p)
    p, dec1, tok1 = system.generate(prompts[:1], args.new_tokens)
    prefill.append(p)
    pb, decb, tokb = system.generate(prompts, args.batch_new_tokens)
    timings = {"prefill_s": prefill, "decode_b1_s": dec1, "prefill_batch_s": [pb], "decode_batch_s": decb}
    return timings, {"b1": tok1, "batch": tokb}


# ---- report ----------------------------------------------------------------------------------------------------

FIGURES = [
    ("prefill_s", "prefill, 1 × {L} tokens (ms)"),
    ("decode_b1_s", "decode, batch 1 (ms / token)"),
    ("decode_batch_s", "decode, batch {B} (ms / step)"),
    ("prefill_batch_s", "prefill, {B} × {L} tokens (ms)"),
]


def markdown(result: dict) -> str:
    s = result["settings"]
    med, ratio, der = result["medians_ms"], result["speedup"], result["derived"]
    lines = [f"# CPU benchmark {result['date']}", "",
             f"SmolLM2-135M-Instruct, float32 weights, {s['threads']} thread(s) each, "
             f"{s['repeats']} alternating rounds after warm-up; medians. Machine: {result['machine']['cpu_model']}, "
             f"{result['machine']['cpus_usable']} usable CPU(s). Commit: {result['software']['git_commit']}.", "",
             "| figure | hpcinfer | transformers | speedup |", "|---|---:|---:|---:|"]
    for key, label in FIGURES:
        lines.append(f"| {label.format(L=s['prompt_len'], B=s['batch'])} | {med['hpcinfer'][key]:.1f} | "
                     f"{med['transformers'][key]:.1f} | {ratio[key]:.2f}× |")
    bw = result["bandwidth"]
    lines += ["",
              f"Memory read bandwidth: **{bw['GBps_median']:.1f} GB/s** (best median of read-only passes over a "
              f"{bw['bytes'] / 1e9:.2f} GB float32 matrix on {s['threads']} threads: "
              + ", ".join(f"{k} {v:.1f}" for k, v in bw["GBps_by_kernel"].items())
              + f" GB/s; {len(bw['times_s']) * len(bw['times_s'][0]['gemv_t'])} passes each).",
              f"Batch-1 decode streams {der['weight_bytes_per_token'] / 1e6:.0f} MB of float32 matmul weights per "
              f"token: hpcinfer **{der['hpcinfer_decode_GBps']:.1f} GB/s = "
              f"{100 * der['hpcinfer_fraction_of_bandwidth']:.0f}%** of the measured bandwidth "
              f"(transformers {der['transformers_decode_GBps']:.1f} GB/s = "
              f"{100 * der['transformers_fraction_of_bandwidth']:.0f}%).",
              "",
              "speedup = transformers time / hpcinfer time (> 1: hpcinfer is faster). Only ratios within one run "
              "count: this machine's speed drifts by 2× between runs, so never compare absolute times across "
              "files.",
              f"Greedy tokens agree (common prefix, min over sequences): batch 1 "
              f"{result['checks']['b1']['min']}/{result['checks']['b1']['length']}, batch {s['batch']} "
              f"{result['checks']['batch']['min']}/{result['checks']['batch']['length']}. "
              f"Other processes' CPU use per round (CPUs, 0 = quiet): "
              f"{[r['other_cpus'] for r in result['machine']['cpu_use_per_round'] if r]}."]
    return "\n".join(lines) + "\n"


# ---- main ------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    cores = usable_cores()
    p = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default="models/smollm2.h5", help="hpcinfer float32 checkpoint")
    p.add_argument("--gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf",
                   help="the GGUF the checkpoint was converted from (loaded by transformers as float32)")
    p.add_argument("--out", default="bench/results", help="folder for cpu-<date>.json and .md")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds (each: bandwidth, hpcinfer, "
                                                          "transformers)")
    p.add_argument("--threads", type=int, default=cores, help="threads of each system (BLAS / torch)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated at batch 1 (decode steps = n-1)")
    p.add_argument("--batch-new-tokens", type=int, default=16, help="tokens generated at batch --batch")
    p.add_argument("--prefill-runs", type=int, default=2,
                   help="extra prefill-only runs per round (plus the batch-1 generation's own prefill)")
    p.add_argument("--bandwidth-bytes", type=float, default=2**30, help="bytes of the bandwidth matrix")
    p.add_argument("--bandwidth-reps", type=int, default=4, help="passes of each read kernel per round")
    p.add_argument("--no-warmup", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2 or args.batch_new_tokens < 2 or args.batch < 1:
        p.error("--repeats >= 1, --batch >= 1, --new-tokens and --batch-new-tokens >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    started = _dt.datetime.now().astimezone()
    load_start = loadavg()
    for path in (args.checkpoint, args.gguf):
        if not Path(path).is_file():
            raise SystemExit(f"bench.cpu: {path} not found (make model; python -m hpcinfer convert {args.gguf} "
                             f"{args.checkpoint} --dtype float32)")

    import torch
    import transformers
    from threadpoolctl import threadpool_info, threadpool_limits

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    threadpool_limits(limits=args.threads)          # NumPy's OpenBLAS (and torch's OpenMP, to the same count)

    log(f"{args.threads} thread(s) per system; loading hpcinfer from {args.checkpoint}")
    hpc = Hpcinfer(args.checkpoint)
    log(f"hpcinfer loaded in {hpc.load_s:.1f} s; loading transformers from {args.gguf}")
    hf = Transformers(args.gguf)
    log(f"transformers loaded in {hf.load_s:.1f} s (attention: {hf.attn_implementation}, "
        f"logits_to_keep: {hf.logits_to_keep})")
    prompts = make_prompts(hpc.tokenizer, args.batch, args.prompt_len)
    bw = Bandwidth(int(args.bandwidth_bytes))
    systems = [hpc, hf]

    if not args.no_warmup:
        log("warm-up")
        bw.run(2)
        warm = argparse.Namespace(**{**vars(args), "prefill_runs": 0, "new_tokens": 4, "batch_new_tokens": 3})
        for system in systems:
            measure(system, prompts, warm)

    meter = CpuMeter()
    raw = {"cpu_use": [], "bandwidth": [], **{s.name: {k: [] for k, _ in FIGURES} for s in systems}}
    tokens = {}
    for r in range(args.repeats):
        time.sleep(SWITCH_PAUSE_S)
        raw["bandwidth"].append(bw.run(args.bandwidth_reps))
        for system in systems:                      # hpcinfer, transformers, hpcinfer, ...: drift hits both
            timings, tokens[system.name] = measure(system, prompts, args)
            for key, values in timings.items():
                raw[system.name][key].append(values)
        raw["cpu_use"].append(meter.lap())
        log(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{s.name} {1e3 * median(raw[s.name]['decode_b1_s'][-1]):.1f}/"
            f"{1e3 * median(raw[s.name]['decode_batch_s'][-1]):.1f} ms" for s in systems)
            + f" (decode b1/b{args.batch}); other processes: {(raw['cpu_use'][-1] or {}).get('other_cpus')} CPUs; "
            f"{time.perf_counter() - t_start:.0f} s elapsed")
    bw.release()

    medians = {s.name: {k: 1e3 * median(flat(raw[s.name][k])) for k, _ in FIGURES} for s in systems}
    speedup = {k: medians["transformers"][k] / medians["hpcinfer"][k] for k, _ in FIGURES}
    speedup_per_round = {k: [median(t) / median(h) for h, t in zip(raw["hpcinfer"][k], raw["transformers"][k])]
                         for k, _ in FIGURES}
    bw_median_s = {k: median(x for r in raw["bandwidth"] for x in r[k]) for k in Bandwidth.KERNELS}
    bw_gbps_by_kernel = {k: bw.nbytes / t / 1e9 for k, t in bw_median_s.items()}
    bw_best = max(bw_gbps_by_kernel, key=bw_gbps_by_kernel.get)
    bw_gbps = bw_gbps_by_kernel[bw_best]
    weight_bytes = stored_matmul_params(hpc.model.arch) * 4           # every stored matmul weight is read
    hpc_gbps = weight_bytes / (medians["hpcinfer"]["decode_b1_s"] / 1e3) / 1e9
    hf_gbps = weight_bytes / (medians["transformers"]["decode_b1_s"] / 1e3) / 1e9
    arch = hpc.model.arch

    result = {
        "schema": "hpcinfer-bench-cpu/1",
        "date": started.date().isoformat(),
        "timestamp": started.isoformat(timespec="seconds"),
        "elapsed_s": None,
        "machine": {**machine_info(), "loadavg_start": load_start, "loadavg_end": None,
                    "cpu_use_per_round": raw["cpu_use"],
                    "_cpu_use": "per measured round: own_cpus = this process's CPU use, other_cpus = every other "
                                "process's (0 = a quiet machine), steal_cpus = taken by the hypervisor; in CPUs"},
        "software": {"numpy": np.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "git_commit": git_commit(),
                     "blas": [{k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                                     "threading_layer", "prefix")} for i in threadpool_info()]},
        "settings": {"threads": args.threads, "repeats": args.repeats, "prompt_len": args.prompt_len,
                     "batch": args.batch, "new_tokens_b1": args.new_tokens,
                     "new_tokens_batch": args.batch_new_tokens, "prefill_runs_per_round": args.prefill_runs + 1,
                     "warmup": not args.no_warmup, "order": "per round: bandwidth, hpcinfer, transformers",
                     "prompts": "consecutive 128-token slices of pydoc_data/topics.py, tokenized by the checkpoint's "
                                "tokenizer without special tokens".replace("128", str(args.prompt_len)),
                     "transformers_attn_implementation": hf.attn_implementation,
                     "transformers_logits_to_keep_1_in_prefill": hf.logits_to_keep},
        "model": {"checkpoint": args.checkpoint, "gguf": args.gguf, "family": arch.family,
                  "layers": arch.num_layers, "parameters": arch.param_count(), "matmul_params": matmul_params(arch),
                  "hpcinfer_load_s": hpc.load_s, "transformers_load_s": hf.load_s},
        "bandwidth": {"method": f"read-only passes over A float32 {list(bw.shape)} C-contiguous ({bw.nbytes} "
                                f"bytes, every page written first) on {args.threads} thread(s): gemv_t = NumPy A @ x, "
                                f"gemv_n = NumPy x @ A (BLAS sgemv), torch_sum = torch.sum(A); GB/s = bytes of A / "
                                f"median time; the reference is the best kernel's median",
                      "bytes": bw.nbytes, "times_s": raw["bandwidth"], "median_s": bw_median_s,
                      "GBps_by_kernel": bw_gbps_by_kernel, "best_kernel": bw_best, "GBps_median": bw_gbps},
        "raw_s": {"hpcinfer": raw["hpcinfer"], "transformers": raw["transformers"],
                  "_layout": "per figure: one list per round; decode lists hold every decode step of that round"},
        "medians_ms": medians,
        "speedup": speedup,
        "speedup_per_round": speedup_per_round,
        "derived": {"weight_bytes_per_token": weight_bytes,
                    "hpcinfer_decode_GBps": hpc_gbps, "hpcinfer_fraction_of_bandwidth": hpc_gbps / bw_gbps,
                    "transformers_decode_GBps": hf_gbps, "transformers_fraction_of_bandwidth": hf_gbps / bw_gbps,
                    "hpcinfer_prefill_tokens_per_s": args.prompt_len / (medians["hpcinfer"]["prefill_s"] / 1e3),
                    "hpcinfer_batch_decode_tokens_per_s":
                        args.batch / (medians["hpcinfer"]["decode_batch_s"] / 1e3)},
        "checks": {"b1": agreement(tokens["hpcinfer"]["b1"], tokens["transformers"]["b1"]),
                   "batch": agreement(tokens["hpcinfer"]["batch"], tokens["transformers"]["batch"])},
    }
    result["machine"]["loadavg_end"] = loadavg()
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)

    busy = [r["other_cpus"] for r in raw["cpu_use"] if r]
    result["warnings"] = busy_warning(busy, f"a measured round (per round: {busy})")
    write_results(args.out, "cpu", result, markdown(result), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
