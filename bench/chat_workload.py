"""Chat workloads and the systems run on them, for the benchmarks of real jobs (bench/batching.py, issue 21;
scripts/chat_cpu.py, issue 23).

A workload is a kept JSONL file of chat prompts (`make_prompts`: a question and an excerpt of the standard
library's pydoc_data/topics.py, excerpt lengths drawn log-uniformly over a word range, SmolLM2's chat template
applied by `hpcinfer run`, "chat": true). On it, in one sitting:
  - `hpcinfer_run`: `hpcinfer run` of the whole set on dp ranks (numpy backend, greedy, EOS stops) -> its metrics;
  - `run_transformers`: transformers' batched `generate` on the same token ids (static batches, left padded);
  - `run_vllm`: the CPU build of vLLM in its own Python (bench/README.md says how to install it; vllm_peer.py runs
    there), on an HF folder exported from the same GGUF weights (`export_hf`).
Every system's generated ids are kept, so the report can say for how many prompts they agree.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.generate.prompts import load_prompts
from hpcinfer.generate.tokenizer import TextTokenizer
from hpcinfer.bench.hf_baseline import Transformers
from hpcinfer.bench.suites.cells import run_job, toml_text

CHECKPOINT = Path("models/smollm2.h5")
GGUF = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")          # what the checkpoint was converted from
QUESTIONS = ("In two or three sentences, what does this part of the Python documentation say?",
             "Summarize the following text for a beginner.",
             "What are the main points of this passage?",
             "Explain the key idea of this text in plain words.",
             "Write a short question a student could answer after reading this.")
VLLM_PEER = Path(__file__).with_name("vllm_peer.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")      # Debian's libtcmalloc-minimal4


def make_prompts(count: int, seed: int, words: tuple[int, int], prefix: str = "chat") -> list[dict]:
    """`count` chat prompts: a question and an excerpt of pydoc_data/topics.py of words[0] to words[1] words,
    log-uniform, from topics taken in a seeded order."""
    import pydoc_data.topics as topics          # (the workload's text: read only when a workload is written)

    rng = np.random.default_rng(seed)
    texts = [topics.topics[k].split() for k in sorted(topics.topics)]
    order = rng.permutation(len(texts))
    prompts = []
    for i in range(count):
        text = texts[order[i % len(texts)]]
        n = int(round(math.exp(rng.uniform(math.log(words[0]), math.log(words[1])))))
        start = int(rng.integers(0, max(1, len(text) - n)))
        excerpt = " ".join(text[start:start + n])
        prompts.append({"id": f"{prefix}{i:03d}", "text": f"{QUESTIONS[i % len(QUESTIONS)]}\n\n{excerpt}",
                        "chat": True})
    return prompts


def hpcinfer_run(prompts: Path, out: Path, dp: int, batch: int, max_new: int, schedule: dict,
                 timeout_s: float, model: dict | None = None) -> dict:
    """`hpcinfer run` of the whole prompt set on dp ranks (the cores shared out as BLAS threads): its metrics,
    with the wall time and the generated ids per prompt (input order). model: the [model] section (default:
    SmolLM2's checkpoint, float32)."""
    config = out.with_suffix(".toml")
    threads = max(1, (os.cpu_count() or 1) // dp)
    config.write_text(toml_text({
        "model": model or {"checkpoint": str(CHECKPOINT.resolve()), "dtype": "float32"},
        "generate": {"prompts": str(prompts.resolve()), "output": str(out), "metrics": f"{out}.metrics.json",
                     "max_new_tokens": max_new, "batch_size": batch, "temperature": 0.0},
        "schedule": schedule, "runtime": {"backend": "numpy", "threads": threads}}))
    python = sys.executable
    argv = [python, "-m", "hpcinfer", "run", str(config)]
    if dp > 1:
        argv = [str(Path(python).parent / "mpiexec"), "-n", str(dp)] + argv
    t0 = time.perf_counter()
    code, output = run_job(argv, timeout_s, out.with_suffix(".log"))
    if code != 0:
        raise SystemExit(f"bench: {' '.join(argv)} failed:\n{output[-3000:]}")
    metrics = json.loads(Path(f"{out}.metrics.json").read_text())
    metrics["wall_s"] = time.perf_counter() - t0
    metrics["outputs"] = [json.loads(line)["output_tokens"] for line in out.read_text().splitlines()]
    return metrics


def prompt_ids(prompts: Path) -> tuple[list, list]:
    """The token ids `hpcinfer run` feeds for each prompt (chat template applied), and the EOS ids."""
    with open_checkpoint(str(CHECKPOINT)) as ckpt:
        tokenizer = TextTokenizer.from_checkpoint(ckpt)
        arch = ckpt.arch
    return [p.tokens for p in load_prompts(str(prompts), arch, tokenizer)], list(arch.eos_token_ids)


def up_to_eos(row: list, eos: list) -> list:
    """A generated row cut after its first EOS (the EOS kept, as hpcinfer's output keeps it)."""
    return row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))]


def run_transformers(ids: list, eos: list, batch: int, max_new: int, threads: int) -> dict:
    """transformers' batched greedy `generate` on the same token ids and weights (the GGUF, float32), batches of
    `batch` in input order, left padded; generated tokens counted up to and including EOS."""
    hf = Transformers(str(GGUF))
    torch = hf.torch
    torch.set_num_threads(threads)
    outputs, t0 = [], time.perf_counter()
    with torch.inference_mode():
        for a in range(0, len(ids), batch):
            group = ids[a:a + batch]
            width = max(len(x) for x in group)
            tokens = torch.tensor([[eos[0]] * (width - len(x)) + x for x in group])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in group])
            out = hf.model.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0])
            outputs += [up_to_eos(row, eos) for row in out[:, width:].tolist()]
    seconds = time.perf_counter() - t0
    generated = sum(len(row) for row in outputs)
    return {"tokens_per_s": generated / seconds, "generated_tokens": generated, "generate_s": seconds,
            "torch": torch.__version__, "outputs": outputs}


def export_hf(folder: Path) -> Path:
    """The GGUF's weights (dequantized to float32 by transformers, as run_transformers runs them) and tokenizer as
    a Hugging Face folder, for peers that read that format (vLLM); kept once written."""
    if (folder / "config.json").exists():
        return folder
    from safetensors.torch import save_file     # (transformers and torch are bench-only dependencies)
    from transformers import AutoTokenizer

    hf = Transformers(str(GGUF))
    config = hf.model.config
    tied = getattr(config, "tie_word_embeddings", False)
    weights = {name: tensor.contiguous() for name, tensor in hf.model.state_dict().items()
               if not (tied and name == "lm_head.weight")}       # (a tied head is the embedding: stored once)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)            # (save_pretrained of the model refuses one loaded from a GGUF)
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("quantization_config", None)    # the weights are float32 now, not the GGUF's blocks
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name).save_pretrained(folder)
    return folder


def run_vllm(python: str, model: Path, ids: list, eos: list, max_new: int, max_num_seqs: int, threads: int,
             workdir: Path, timeout_s: float) -> dict:
    """vLLM's offline `LLM.generate` (greedy, float32, EOS stops, at most max_num_seqs sequences at once) in its own
    Python `python` (Debian's tcmalloc and its venv's libiomp5 preloaded where present, as vLLM's CPU docs ask), on
    the same token ids: tokens/s over the generate call, and the generated ids."""
    request = workdir / f"vllm-{max_num_seqs}.json"
    request.write_text(json.dumps({"model": str(model), "ids": ids, "eos": eos, "max_new": max_new,
                                   "max_num_seqs": max_num_seqs, "threads": threads}))
    answer = request.with_suffix(".out.json")
    preload = [p for p in (TCMALLOC, Path(python).parent.parent / "lib" / "libiomp5.so") if p.exists()]
    env = {"LD_PRELOAD": ":".join(map(str, preload))} if preload else {}   # as vLLM's CPU docs ask
    code, output = run_job([python, str(VLLM_PEER), str(request), str(answer)], timeout_s,
                           request.with_suffix(".log"), env)
    if code != 0:
        raise SystemExit(f"bench: vLLM peer failed:\n{output[-3000:]}")
    result = json.loads(answer.read_text())
    result["outputs"] = [up_to_eos(row, eos) for row in result["outputs"]]
    result["generated_tokens"] = sum(len(row) for row in result["outputs"])
    result["tokens_per_s"] = result["generated_tokens"] / result["generate_s"]
    return result


def agreement(reference: list, outputs: list) -> int:
    """Prompts whose generated ids are identical in both."""
    return sum(1 for a, b in zip(reference, outputs) if list(a) == list(b))


def vllm_python(asked: str | None) -> str | None:
    """The Python that has vLLM: --vllm-python, else .venv-vllm/bin/python when it exists, else None (skipped)."""
    if asked:
        return asked
    default = Path(".venv-vllm/bin/python")
    return str(default) if default.exists() else None


def subprocess_ok(python: str, code: str) -> bool:
    """Whether `python -c code` runs (e.g. imports vllm)."""
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
