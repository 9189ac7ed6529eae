"""Run metrics count weights as held: a quantized model reports its quantized bytes (q, scale, min), not the float
size its parameter count implies, and the NumPy dequantize scratch separately."""

from types import SimpleNamespace

import numpy as np
import pytest

from hf_models import save_tiny_model
from hpcinfer.api import generate, load_model
from hpcinfer.arch import tensor_shapes
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.metrics import held_bytes, matmul_params, weight_bytes_per_rank
from hpcinfer.quant import storage

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-quant")
    folder = save_tiny_model("llama", root / "hf")
    convert_hf(folder, str(root / "f32.h5"))
    convert_hf(folder, str(root / "int4.h5"), quantize="int4", group_size=16)
    return root


def checkpoint_tensor_bytes(path) -> int:
    """Bytes of the model's tensors as the checkpoint stores them (a quantized one: its q, scale and min)."""
    with open_checkpoint(str(path)) as ckpt:
        f, total = ckpt.file, 0
        for name in tensor_shapes(ckpt.arch):
            parts = [name] if name in f else [f"{name}.{p}" for p in ("q", "scale", "min") if f"{name}.{p}" in f]
            total += sum(f[p].size * f[p].dtype.itemsize for p in parts)
        return total


def test_float_model_holds_its_parameters_in_float32(llama):
    model = load_model(str(llama / "f32.h5"))
    generate(model, PROMPTS, 3)
    held = held_bytes(model)
    assert held["weights"] == model.arch.param_count() * 4 == checkpoint_tensor_bytes(llama / "f32.h5")
    assert held["dequant_scratch"] == 0


@pytest.mark.parametrize("source", ["stored", "at load"])
def test_int4_model_reports_its_quantized_bytes(llama, source):
    """int4 g16 (1 byte per weight: a half-byte value plus 8 bytes of scale and min per 16): the held bytes are
    the stored checkpoint's quantized bytes exactly, about a quarter of float32; the scratch is the dequantize
    buffers, counted apart."""
    model = (load_model(str(llama / "int4.h5")) if source == "stored" else
             load_model(str(llama / "f32.h5"), quantize="int4", group_size=16))
    generate(model, PROMPTS, 3)
    held = held_bytes(model)
    float_bytes = model.arch.param_count() * 4
    assert held["weights"] == checkpoint_tensor_bytes(llama / "int4.h5")
    assert held["weights"] < 0.3 * float_bytes
    assert 0 < held["dequant_scratch"] < float_bytes


def test_summary_uses_the_reported_bytes_and_falls_back_to_the_estimate(llama):
    """memory.weight_bytes_per_rank (and the decode bandwidth made from it): the largest rank's held bytes when
    the ranks report them, else the float estimate from the parameter count."""
    with open_checkpoint(str(llama / "int4.h5")) as ckpt:
        arch = ckpt.arch
        assert storage.stored_group_size(ckpt) == 16
    config = SimpleNamespace(model=SimpleNamespace(dtype="float32"))
    mesh = SimpleNamespace(shape=SimpleNamespace(tp=2, pp=1))
    reports = [SimpleNamespace(held={"weights": w, "dequant_scratch": s}) for w, s in ((900, 10), (1000, 7))]
    assert weight_bytes_per_rank(config, arch, mesh, reports) == (1000, 10)
    estimate, scratch = weight_bytes_per_rank(config, arch, mesh, [SimpleNamespace(), SimpleNamespace(held=None)])
    assert scratch is None and np.isclose(estimate, matmul_params(arch) * 4 / 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_hpcinfer_run_metrics_report_quantized_weight_bytes(llama, run_cli, repo_root, tmp_path, tp):
    """`hpcinfer run` of the int4 g16 checkpoint: memory.weight_bytes_per_rank is the checkpoint's quantized bytes
    split over the ranks (not the float32 size), and the dequantize scratch is reported beside it."""
    import json

    from cli_helpers import run_job

    (tmp_path / "p.jsonl").write_text('{"id": 0, "tokens": [1, 2, 3]}\n{"id": 1, "tokens": [4, 5]}\n')
    memory = {}
    for name in ("f32", "int4"):
        run_job(run_cli, repo_root, f"{llama / name}.h5", tmp_path / "p.jsonl", tmp_path / f"{name}.jsonl", tp,
                [f"parallel.tp={tp}"], 3, metrics=tmp_path / f"{name}.json")
        memory[name] = json.loads((tmp_path / f"{name}.json").read_text())["memory"]
    quantized = checkpoint_tensor_bytes(llama / "int4.h5")
    assert memory["int4"]["weight_bytes_per_rank"] < 0.3 * memory["f32"]["weight_bytes_per_rank"]
    assert quantized / tp <= memory["int4"]["weight_bytes_per_rank"] <= quantized / tp * 1.1   # norms: whole per rank
    assert memory["int4"]["dequant_scratch_bytes_per_rank"] > 0 == memory["f32"]["dequant_scratch_bytes_per_rank"]


def sharded_layers(model) -> dict:
    """Every sharded layer of a dense decoder by name: the fused q/k/v and the o projection, the MLP's fused
    gate/up and down, the embedding and the LM head (the same object when tied)."""
    layers = {"embed": model.embed, "lm_head": model.lm_head}
    for i, block in enumerate(model.blocks):
        layers.update({f"{i}.attn.qkv": block.attn.qkv, f"{i}.attn.o": block.attn.out, f"{i}.mlp.up": block.mlp.up,
                       f"{i}.mlp.down": block.mlp.down})
    return layers


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_layers_hold_no_float_copy_and_weight_bytes_counts_their_arrays(llama, mode):
    """After loading with [model] quantize, every sharded layer's float attribute (`w`, or `table` for the
    embedding / LM head) is None, and parallel.layers.weight_bytes is exactly the bytes of its quantized arrays
    (q, scale and, int4, min). A float matrix kept beside the quantized one counts too."""
    from hpcinfer.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, weight_bytes

    model = load_model(str(llama / "f32.h5"), quantize=mode, group_size=16)
    layers = sharded_layers(model)
    assert len(layers) == 2 + 4 * model.arch.num_layers
    for name, layer in layers.items():
        table = isinstance(layer, VocabParallelEmbedding)
        assert table or isinstance(layer, (ColumnParallelLinear, RowParallelLinear)), name
        float_attr, quant_attr = ("table", "qtable") if table else ("w", "qw")
        assert getattr(layer, float_attr) is None, (mode, name)
        qt = getattr(layer, quant_attr)
        expected = "int8" if table else mode        # int4 keeps the embedding / LM head at 8 bits by default
        assert qt is not None and qt.mode == expected, (mode, name)
        arrays = [qt.q, qt.scale] + ([] if qt.min is None else [qt.min])
        assert (qt.min is None) == (expected == "int8")
        assert weight_bytes(layer) == sum(a.nbytes for a in arrays) == qt.nbytes, (mode, name)
    layer = model.blocks[0].mlp.down
    quantized = weight_bytes(layer)
    layer.w = np.zeros(layer.qw.shape, np.float32)                # a float copy kept next to the quantized one
    assert weight_bytes(layer) == quantized + layer.w.nbytes
