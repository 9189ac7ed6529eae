"""Encoder benchmark: hpcinfer against Hugging Face transformers on the same all-MiniLM-L6-v2 weights, in one run,
back to back, in alternating rounds (the method of cpu.py). See docs/bench-scripts.md.

    python -m bench.encoder --checkpoint models/minilm.h5 --folder models/all-MiniLM-L6-v2 --repeats 5
    python -m bench.encoder --backend cupy      # on one GPU: writes encoder-gpu-<date>

Backends: numpy (hpcinfer's NumPy backend against transformers on the CPU, `--threads` each) or cupy (hpcinfer's
CuPy backend on GPU 0 against transformers eager on `cuda`, and against the same transformers model replayed from
a CUDA graph captured per input shape; without a CUDA torch the transformers figures are skipped, with the
reason in the result). hpcinfer's own `[runtime] cuda_graphs` covers decode steps only (config.py refuses it for
[embed] jobs: an encoder has no decode step), so hpcinfer's encoder runs eagerly on the GPU.

Figures: batch 1 at 128 tokens (DeepSpeed Inference's BERT setting; latency in ms) and a batch of 64 real
sentences of mixed lengths (throughput in sentences/s), each ending in mean pooling + L2 normalization as
sentence-transformers does. transformers gets the padded batch with its attention mask (its only way);
hpcinfer packs the batch. Writes bench/results/encoder-<YYYY-MM-DD>.json and .md, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from hpcinfer.embed.api import load_encoder  # noqa: E402
from hpcinfer.embed.inputs import EmbedInput  # noqa: E402
from hpcinfer.embed.job import embed_batch  # noqa: E402
from hpcinfer.bench.common import CpuMeter, git_commit, logger, machine_info, median  # noqa: E402
from .device import device_info, sync_device  # noqa: E402
from .results import write_results  # noqa: E402

SWITCH_PAUSE_S = 0.25
log = logger("bench.encoder")


def corpus_sentences(count: int, min_words: int = 4) -> list[str]:
    """Real English sentences from the standard library's pydoc topics (no download), in a fixed order."""
    import pydoc_data.topics as topics

    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    sentences = [" ".join(s.split()) for s in text.replace("\n", " ").split(". ")]
    return [s + "." for s in sentences if len(s.split()) >= min_words][:count]


class Hpcinfer:
    name = "hpcinfer"

    def __init__(self, checkpoint: str, backend: str = "numpy", dtype: str = "float32"):
        t0 = time.perf_counter()
        self.model, self.tokenizer = load_encoder(checkpoint, dtype=dtype, backend=backend)
        sync_device(self.model.ops)
        self.load_s = time.perf_counter() - t0

    def embed(self, sequences: list) -> np.ndarray:            # token ids -> [S, D] mean-pooled, normalized
        items = [EmbedInput(str(i), s, i) for i, s in enumerate(sequences)]
        out = np.stack(embed_batch(self.model, items, "mean", True))     # on the host: the GPU's work is done
        sync_device(self.model.ops)
        return out


class Transformers:
    name = "transformers"

    def __init__(self, folder: str, device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModel

        t0 = time.perf_counter()
        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).to(self.device).eval()
        self._sync()
        self.load_s = time.perf_counter() - t0
        self.attn_implementation = self.model.config._attn_implementation

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _inputs(self, sequences: list):
        import torch

        L = max(len(s) for s in sequences)
        ids = torch.tensor([s + [0] * (L - len(s)) for s in sequences], device=self.device)
        mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in sequences], device=self.device)
        return ids, mask

    def _forward(self, ids, mask):                            # sentence-transformers' mean pooling + normalize
        import torch

        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def embed(self, sequences: list) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self._forward(*self._inputs(sequences)).float().cpu().numpy()
        self._sync()
        return out


class TransformersGraphs(Transformers):
    """The same transformers model on CUDA, each input shape captured once as a CUDA graph (torch.cuda.graph, after
    warm-up on a side stream) and replayed with the new ids and mask copied into its static inputs."""
    name = "transformers+graphs"

    def __init__(self, eager: Transformers):
        self.model, self.device, self.load_s = eager.model, eager.device, 0.0
        self.attn_implementation = eager.attn_implementation
        self.graphs = {}                                        # lengths -> (ids, mask, out, graph)

    def _capture(self, ids, mask):
        import torch

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):
                self._forward(ids, mask)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            out = self._forward(ids, mask)
        return ids, mask, out, graph

    def embed(self, sequences: list) -> np.ndarray:
        import torch

        key = tuple(len(s) for s in sequences)
        with torch.inference_mode():
            if key not in self.graphs:
                self.graphs[key] = self._capture(*self._inputs(sequences))
            ids, mask, out, graph = self.graphs[key]
            new_ids, new_mask = self._inputs(sequences)
            ids.copy_(new_ids)
            mask.copy_(new_mask)
            graph.replay()
            host = out.float().cpu().numpy()
        self._sync()
        return host


def hf_systems(args) -> tuple[list, dict]:
    """The transformers systems of this backend, and {name: why} for those skipped."""
    import torch

    if args.backend == "numpy":
        return [Transformers(args.folder, "cpu", args.dtype)], {}
    if not torch.cuda.is_available():
        why = f"torch {torch.__version__} has no CUDA device here (torch.cuda.is_available() is False)"
        return [], {"transformers": why, "transformers+graphs": why}
    eager = Transformers(args.folder, "cuda", args.dtype)
    graphs = TransformersGraphs(eager)
    return [eager, graphs], {}


def timed(system, sequences: list, runs: int) -> tuple[list, np.ndarray]:
    time.sleep(SWITCH_PAUSE_S)
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = system.embed(sequences)
        times.append(time.perf_counter() - t0)
    return times, out


def inputs(tokenizer, seq_len: int, batch: int) -> tuple[list, list]:
    """(one sequence of exactly seq_len tokens, `batch` real sentences tokenized with [CLS]/[SEP], <= seq_len)."""
    long_text = " ".join(corpus_sentences(200))
    single = tokenizer.encode(long_text, seq_len)
    assert len(single) == seq_len, len(single)
    return [single], [tokenizer.encode(s, seq_len) for s in corpus_sentences(batch)]


GRAPHS_NA = ("n/a: [runtime] cuda_graphs captures decode steps of [generate] jobs; config.py refuses it for [embed] "
             "jobs (an encoder forward has no decode step, and a packed batch changes shape with every batch)")


def markdown(result: dict) -> str:
    s, med, dev = result["settings"], result["medians"], result["device"]
    hf = [n for n in result["systems"] if n != "hpcinfer"]
    where = (f"hpcinfer's CuPy backend on {dev.get('device_name')} (cupy {dev.get('cupy')}), transformers "
             + (f"on {result['transformers_device']}" if hf else "skipped") if s["backend"] == "cupy" else
             f"NumPy backend, {s['threads']} thread(s) each")
    lines = [f"# Encoder benchmark {result['date']}", "",
             f"all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384), {s['dtype']}, {where}, "
             f"{s['repeats']} alternating rounds after warm-up; medians. transformers attention: "
             f"{result['transformers_attention']}. Machine: {result['machine'].get('cpu_model')}. "
             f"Commit: {result['software']['git_commit']}.", "",
             "| " + " | ".join(["figure", "hpcinfer", *hf, *(f"speedup vs {n}" for n in hf)]) + " |",
             "|---|---:|" + "---:|" * (2 * len(hf))]
    sp = result["speedup_per_system"]
    lines.append(f"| batch 1 × {s['seq_len']} tokens (ms) | {med['hpcinfer']['b1_ms']:.2f} |"
                 + "".join(f" {med[n]['b1_ms']:.2f} |" for n in hf) + "".join(f" {sp[n]['b1']:.2f}× |" for n in hf))
    lines.append(f"| batch {s['batch']} sentences ({s['batch_tokens']} tokens, longest {s['batch_longest']}) "
                 f"(sentences/s) | {med['hpcinfer']['batch_sentences_per_s']:.0f} |"
                 + "".join(f" {med[n]['batch_sentences_per_s']:.0f} |" for n in hf)
                 + "".join(f" {sp[n]['batch']:.2f}× |" for n in hf))
    lines += ["", "speedup = transformers time / hpcinfer time (> 1: hpcinfer is faster); only ratios within one run "
              "count. Both end in mean pooling + L2 normalization; cosine between the systems' embeddings: "
              f"min {result['checks']['cosine_min']:.7f}. Other processes' CPU use per round (CPUs, 0 = quiet): "
              f"{[r['other_cpus'] for r in result['cpu_use_per_round'] if r]}."]
    if s["backend"] == "cupy":
        lines += ["", f"hpcinfer with CUDA graphs: {result['cuda_graphs']['hpcinfer']}."]
    for name, why in result["skipped"].items():
        lines += ["", f"{name} skipped: {why}."]
    if result["warnings"]:
        lines += ["", "**Warning:** " + " ".join(result["warnings"])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.encoder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                   help="hpcinfer's backend; cupy: GPU 0, transformers on cuda (eager and CUDA graphs)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="weights of both systems")
    p.add_argument("--checkpoint", default="models/minilm.h5", help="hpcinfer checkpoint (make minilm)")
    p.add_argument("--folder", default="models/all-MiniLM-L6-v2", help="the Hugging Face folder it came from")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="threads of each system (BLAS / torch)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--b1-runs", type=int, default=5, help="batch-1 runs per round")
    p.add_argument("--batch-runs", type=int, default=2, help="batch runs per round")
    return p.parse_args(argv)


def warm_up(systems: list, single: list, batch: list, skipped: dict) -> list:
    """Run each system on both inputs (graphs capture here); a transformers system that fails is skipped with its
    error (hpcinfer's failures stop the run)."""
    kept = []
    for system in systems:
        try:
            timed(system, single, 2)
            timed(system, batch, 1)
        except Exception as e:  # noqa: BLE001 - e.g. a torch build whose capture of this model fails
            if system.name == "hpcinfer":
                raise
            skipped[system.name] = f"warm-up failed: {type(e).__name__}: {e}"
            log(f"{system.name} skipped: {skipped[system.name]}")
            continue
        kept.append(system)
    return kept


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    for path in (args.checkpoint, Path(args.folder) / "model.safetensors"):
        if not Path(path).is_file():
            raise SystemExit(f"bench.encoder: {path} not found (make minilm)")
    import torch
    import transformers
    from threadpoolctl import threadpool_limits

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    threadpool_limits(limits=args.threads)
    hpc = Hpcinfer(args.checkpoint, args.backend, args.dtype)
    hf, skipped = hf_systems(args)
    single, batch = inputs(hpc.tokenizer, args.seq_len, args.batch)
    attention = hf[0].attn_implementation if hf else None
    log(f"hpcinfer on {hpc.model.ops.name}; {args.threads} thread(s) each; transformers "
        + (f"on {hf[0].device}, attention {attention}" if hf else "skipped") + "; warm-up")
    systems = warm_up([hpc, *hf], single, batch, skipped)
    meter, raw, outputs = CpuMeter(), {s.name: {"b1_s": [], "batch_s": []} for s in systems}, {}
    cpu_use = []
    for r in range(args.repeats):
        for system in systems:                    # hpcinfer, transformers, hpcinfer, ...: drift hits both
            b1, _ = timed(system, single, args.b1_runs)
            bt, outputs[system.name] = timed(system, batch, args.batch_runs)
            raw[system.name]["b1_s"].append(b1)
            raw[system.name]["batch_s"].append(bt)
        cpu_use.append(meter.lap())
        log(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{s.name} {1e3 * median(raw[s.name]['b1_s'][-1]):.2f} ms / "
            f"{1e3 * median(raw[s.name]['batch_s'][-1]):.1f} ms" for s in systems)
            + f" (b1 / b{args.batch}); other processes {(cpu_use[-1] or {}).get('other_cpus')} CPUs")
    flat = {n: {k: [x for run in v for x in run] for k, v in d.items()} for n, d in raw.items()}
    medians = {n: {"b1_ms": 1e3 * median(d["b1_s"]), "batch_ms": 1e3 * median(d["batch_s"]),
                   "batch_sentences_per_s": args.batch / median(d["batch_s"])} for n, d in flat.items()}
    others = [s.name for s in systems if s.name != "hpcinfer"]
    speedup = {n: {"b1": medians[n]["b1_ms"] / medians["hpcinfer"]["b1_ms"],
                   "batch": medians[n]["batch_ms"] / medians["hpcinfer"]["batch_ms"]} for n in others}
    cosine = [float(np.sum(outputs["hpcinfer"] * outputs[n], axis=1).min()) for n in others]
    busy = [u["other_cpus"] for u in cpu_use if u]
    result = {"date": _dt.date.today().isoformat(), "elapsed_s": time.perf_counter() - t_start,
              "settings": {**vars(args), "batch_tokens": sum(map(len, batch)),
                           "batch_longest": max(map(len, batch))},
              "machine": machine_info(), "device": device_info(hpc.model.ops),
              "software": {"git_commit": git_commit(), "numpy": np.__version__, "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "transformers": transformers.__version__},
              "systems": [s.name for s in systems], "skipped": skipped, "hpcinfer_ops": type(hpc.model.ops).__name__,
              "transformers_device": str(hf[0].device) if hf else None, "transformers_attention": attention,
              "cuda_graphs": {"hpcinfer": GRAPHS_NA,
                              "transformers": ("torch.cuda.graph per input shape" if "transformers+graphs" in others
                                               else skipped.get("transformers+graphs", "n/a on the CPU"))},
              "raw_s": raw, "medians": medians, "speedup_per_system": speedup,
              "speedup": speedup.get("transformers"),
              "checks": {"cosine_min": min(cosine) if cosine else None}, "cpu_use_per_round": cpu_use,
              "warnings": ([f"other processes used {max(busy):.1f} CPUs during the measurement: absolute times "
                            f"are inflated; re-run on a quiet machine"] if busy and max(busy) > 0.5 else [])}
    if result["checks"]["cosine_min"] is None:
        result["checks"]["cosine_min"] = float("nan")
    name = "encoder-gpu" if args.backend == "cupy" else "encoder"
    write_results(args.out, name, result, markdown(result), log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
