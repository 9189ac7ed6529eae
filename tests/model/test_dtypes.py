"""Half-precision storage: weights held in float16 / bfloat16 (not upcast copies), compute in float32, logits
close to the float32 run; and checkpoints converted to those dtypes load and agree the same way."""

import numpy as np
import pytest

from hf_models import save_tiny_model
from hpcinfer.api import load_model, prompt_logits
from hpcinfer.checkpoint.hf import convert_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    return root, save_tiny_model("llama_mha", root / "hf")


@pytest.mark.parametrize("dtype, tolerance", [("float16", 2e-2), ("bfloat16", 1.5e-1)])
@pytest.mark.parametrize("stored", ["float32", "same"])
def test_half_precision_weights_stay_half_and_track_float32(folder, dtype, tolerance, stored):
    root, hf = folder
    reference_path = str(root / "f32.h5")
    convert_hf(str(hf), reference_path)
    path = reference_path
    if stored == "same":
        path = str(root / f"{dtype}.h5")
        convert_hf(str(hf), path, dtype=dtype)
    model = load_model(path, dtype=dtype)
    assert model.blocks[0].mlp.up.w.dtype.name == dtype and model.embed.table.dtype.name == dtype
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    ours = prompt_logits(model, prompts)
    assert ours.dtype == np.float32
    reference = prompt_logits(load_model(reference_path), prompts)
    scale = np.abs(reference).max()
    assert 0 < np.abs(ours - reference).max() < tolerance * scale
