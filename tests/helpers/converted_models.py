"""hf_models' tiny Hugging Face models converted and loaded, with random prompts: what the parity suites compare.

A helper module for tests (not a test file); importing it needs no torch, calling it does.
"""

from __future__ import annotations

import numpy as np

from hf_models import save_tiny_model
from hpcinfer.api import load_model
from hpcinfer.checkpoint.hf import convert_hf


def converted_tiny_model(family: str, root, lengths, seed: int = 42):
    """`family` saved under root/hf, converted to root/model.h5 and loaded; random prompts of these lengths over its
    vocabulary. Returns (Hugging Face folder, model, prompts)."""
    folder = save_tiny_model(family, root / "hf")
    convert_hf(str(folder), str(root / "model.h5"))
    model = load_model(str(root / "model.h5"))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model.arch.vocab_size, n).tolist() for n in lengths]
    return folder, model, prompts
