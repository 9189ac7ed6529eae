"""Encoder benchmark: hpcinfer (NumPy backend) against Hugging Face transformers on the same all-MiniLM-L6-v2
weights, in one run, back to back, in alternating rounds (the method of bench/cpu.py). See bench/README.md.

    python -m bench.encoder --checkpoint models/minilm.h5 --folder models/all-MiniLM-L6-v2 --repeats 5

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

from hpcinfer.bench.common import CpuMeter, git_commit, logger, machine_info, median, write_results  # noqa: E402

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

    def __init__(self, checkpoint: str):
        from hpcinfer.embed.api import load_encoder

        t0 = time.perf_counter()
        self.model, self.tokenizer = load_encoder(checkpoint)
        self.load_s = time.perf_counter() - t0

    def embed(self, sequences: list) -> np.ndarray:            # token ids -> [S, D] mean-pooled, normalized
        from hpcinfer.embed.inputs import EmbedInput
        from hpcinfer.embed.job import embed_batch

        items = [EmbedInput(str(i), s, i) for i, s in enumerate(sequences)]
        return np.stack(embed_batch(self.model, items, "mean", True))


class Transformers:
    name = "transformers"

    def __init__(self, folder: str):
        import torch
        from transformers import AutoModel

        t0 = time.perf_counter()
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t0
        self.attn_implementation = self.model.config._attn_implementation

    def embed(self, sequences: list) -> np.ndarray:            # sentence-transformers' mean pooling + normalize
        import torch

        L = max(len(s) for s in sequences)
        ids = torch.tensor([s + [0] * (L - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in sequences])
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


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


def markdown(result: dict) -> str:
    s, med = result["settings"], result["medians"]
    lines = [f"# Encoder benchmark {result['date']}", "",
             f"all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384), float32, {s['threads']} thread(s) each, "
             f"{s['repeats']} alternating rounds after warm-up; medians. transformers attention: "
             f"{result['transformers_attention']}. Machine: {result['machine'].get('cpu_model')}. "
             f"Commit: {result['software']['git_commit']}.", "",
             "| figure | hpcinfer | transformers | speedup |", "|---|---:|---:|---:|",
             f"| batch 1 × {s['seq_len']} tokens (ms) | {med['hpcinfer']['b1_ms']:.1f} | "
             f"{med['transformers']['b1_ms']:.1f} | {result['speedup']['b1']:.2f}× |",
             f"| batch {s['batch']} sentences ({s['batch_tokens']} tokens, longest {s['batch_longest']}) "
             f"(sentences/s) | {med['hpcinfer']['batch_sentences_per_s']:.0f} | "
             f"{med['transformers']['batch_sentences_per_s']:.0f} | {result['speedup']['batch']:.2f}× |", "",
             "speedup = transformers time / hpcinfer time (> 1: hpcinfer is faster); only ratios within one run "
             "count. Both end in mean pooling + L2 normalization; cosine between the two systems' embeddings: "
             f"min {result['checks']['cosine_min']:.7f}. Other processes' CPU use per round (CPUs, 0 = quiet): "
             f"{[r['other_cpus'] for r in result['cpu_use_per_round'] if r]}."]
    if result["warnings"]:
        lines += ["", "**Warning:** " + " ".join(result["warnings"])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.encoder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    hpc, hf = Hpcinfer(args.checkpoint), Transformers(args.folder)
    single, batch = inputs(hpc.tokenizer, args.seq_len, args.batch)
    systems = [hpc, hf]
    log(f"{args.threads} thread(s) each; transformers attention {hf.attn_implementation}; warm-up")
    for system in systems:
        timed(system, single, 2)
        timed(system, batch, 1)
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
            f"{s.name} {1e3 * median(raw[s.name]['b1_s'][-1]):.1f} ms / "
            f"{1e3 * median(raw[s.name]['batch_s'][-1]):.0f} ms" for s in systems)
            + f" (b1 / b{args.batch}); other processes {(cpu_use[-1] or {}).get('other_cpus')} CPUs")
    flat = {n: {k: [x for run in v for x in run] for k, v in d.items()} for n, d in raw.items()}
    medians = {n: {"b1_ms": 1e3 * median(d["b1_s"]), "batch_ms": 1e3 * median(d["batch_s"]),
                   "batch_sentences_per_s": args.batch / median(d["batch_s"])} for n, d in flat.items()}
    cosine = np.sum(outputs["hpcinfer"] * outputs["transformers"], axis=1)
    busy = [u["other_cpus"] for u in cpu_use if u]
    result = {"date": _dt.date.today().isoformat(), "elapsed_s": time.perf_counter() - t_start,
              "settings": {**vars(args), "batch_tokens": sum(map(len, batch)),
                           "batch_longest": max(map(len, batch))},
              "machine": machine_info(), "software": {"git_commit": git_commit(), "numpy": np.__version__,
                                                      "torch": torch.__version__,
                                                      "transformers": transformers.__version__},
              "transformers_attention": hf.attn_implementation, "raw_s": raw, "medians": medians,
              "speedup": {"b1": medians["transformers"]["b1_ms"] / medians["hpcinfer"]["b1_ms"],
                          "batch": medians["transformers"]["batch_ms"] / medians["hpcinfer"]["batch_ms"]},
              "checks": {"cosine_min": float(cosine.min())}, "cpu_use_per_round": cpu_use,
              "warnings": ([f"other processes used {max(busy):.1f} CPUs during the measurement: absolute times "
                            f"are inflated; re-run on a quiet machine"] if busy and max(busy) > 0.5 else [])}
    write_results(args.out, "encoder", result, markdown(result), log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
