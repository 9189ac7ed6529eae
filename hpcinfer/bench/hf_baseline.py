"""The Hugging Face transformers baseline: the same weights (the GGUF file or Hugging Face folder an hpcinfer
checkpoint was converted from) in float32, greedy generation in a manual loop so that prefill and every decode
step are timed the way hpcinfer times them (docs/bench-scripts.md, docs/bench.md). Needs torch and transformers (the
`test` extra).

Where it runs follows hpcinfer's cells (pick_device): on the CPU against the NumPy backend; against the cupy
backend on the GPU when torch has CUDA, else on the CPU, and the results and the report say so, so that a ratio
is never silently GPU against CPU."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # before anything imports huggingface_hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")              # transformers' GGUF dequantization progress bar


def pick_device(backend: str, torch) -> tuple[str, str]:
    """(torch device, note) of the baseline against hpcinfer cells on `backend` (numpy / cupy). The note is ""
    when both run on the same kind of device, else what the ratios then compare."""
    if backend != "cupy":
        return "cpu", ""
    if torch.cuda.is_available():
        return "cuda", ""
    return "cpu", ("torch has no CUDA here: the transformers baseline ran on the CPU against hpcinfer on the GPU "
                   "(cupy), so its ratios compare a GPU with a CPU")


def device_name(device: str, torch) -> str:
    """The results' `device` of the baseline: "cpu", or "cuda:0 (GPU name)"."""
    if device == "cpu":
        return "cpu"
    index = torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


class Transformers:
    """AutoModelForCausalLM from `source`: a .gguf file (dequantized to float32 by transformers) or a Hugging Face
    model folder, on `device` ("cpu" or "cuda")."""

    name = "transformers"

    def __init__(self, source: str, device: str = "cpu"):
        _offline()
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        path = Path(source)
        where = (str(path.parent), {"gguf_file": path.name}) if path.suffix == ".gguf" else (str(path), {})
        t0 = time.perf_counter()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(where[0], dtype=torch.float32, **where[1])
        except TypeError:                                  # transformers < 4.56 spells it torch_dtype
            self.model = AutoModelForCausalLM.from_pretrained(where[0], torch_dtype=torch.float32, **where[1])
        self.model.to(device).eval()
        self.device = device
        self.load_s = time.perf_counter() - t0
        # What transformers' own generate() does: compute the LM head only at the last prompt position.
        self.logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)

    def generate(self, prompts: list, new_tokens: int):
        """(prefill_s, [decode step s], generated ids per prompt): one forward over the [B, L] prompts with
        use_cache=True, then single-token forwards with past_key_values in a manual loop; greedy argmax after
        each."""
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # [B, L], equal lengths: no padding
        extra = {"logits_to_keep": 1} if self.logits_to_keep else {}
        steps, generated = [], []
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True, **extra)
            token = out.logits[:, -1].argmax(-1)                          # [B]
            self._sync()
            prefill_s = time.perf_counter() - t0
            past = out.past_key_values
            generated.append(token)
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter()
                out = self.model(input_ids=token[:, None], past_key_values=past, use_cache=True)
                token = out.logits[:, -1].argmax(-1)                      # [B]
                past = out.past_key_values
                self._sync()
                steps.append(time.perf_counter() - t0)
                generated.append(token)
        return prefill_s, steps, torch.stack(generated, dim=1).tolist()

    def _sync(self) -> None:
        """Wait for the GPU's queued work before reading the clock (a no-op on the CPU)."""
        if self.device != "cpu":
            self.torch.cuda.synchronize()
