"""Every family against Hugging Face transformers on the same (tiny, random) weights: last-position logits of a
packed batch of mixed-length prompts, and greedy generations, single rank."""

from pathlib import Path

import numpy as np
import pytest

from converted_models import converted_tiny_model
from hf_models import VARIANTS, hf_greedy, hf_reference_logits
from hpcinfer.api import generate, load_model, prompt_logits

LENGTHS = (5, 17, 1, 30)
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request, tmp_path_factory):
    return converted_tiny_model(request.param, tmp_path_factory.mktemp(request.param), LENGTHS)


def test_last_position_logits_match_transformers(tiny):
    folder, model, prompts = tiny
    ours = prompt_logits(model, prompts)
    ref = hf_reference_logits(folder, prompts)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4


def test_greedy_generation_matches_transformers(tiny):
    folder, model, prompts = tiny
    ours = generate(model, prompts, NEW_TOKENS)
    assert ours == [hf_greedy(folder, p, NEW_TOKENS) for p in prompts]


def test_batched_generation_equals_each_prompt_alone(tiny):
    _, model, prompts = tiny
    batched = generate(model, prompts, NEW_TOKENS)
    assert batched == [generate(model, [p], NEW_TOKENS)[0] for p in prompts]
    assert len({tuple(t) for t in batched}) > 1          # the prompts do lead to different continuations


def test_both_cpu_kernel_settings_match_transformers(tiny):
    """The fixture's model runs the default cpu_kernels (numba where it imports); the NumPy reference, and numba
    asked for by name, match transformers as well, and generate the same greedy tokens (backend/cpu_kernels)."""
    folder, model, prompts = tiny
    ref = hf_reference_logits(folder, prompts)
    models = {kind: load_model(str(Path(folder).parent / "model.h5"), cpu_kernels=kind) for kind in ("numpy", "numba")}
    for kind, m in models.items():
        assert m.ops.cpu_kernels == kind
        assert np.abs(prompt_logits(m, prompts) - ref).max() < 1e-4, kind
    assert generate(models["numpy"], prompts[:2], 4) == generate(models["numba"], prompts[:2], 4)
