"""The GPU paths of bench/quant.py and encoder.py (`--backend cupy`) end to end on the CPU stand-in
for cupy (tests/helpers/emu_cupy/), in their smallest configurations on tiny models: the result's structure, the
files written, and that hpcinfer really ran on CupyOps. Speed means nothing here (the kernels run on an emulator);
the NumPy paths run the same functions as a reference for the structure.

bench.quant's per-mode measurement (`run_modes`) is fed tiny-dense models quantized at load (SmolLM2's converted
checkpoints are too slow for the emulator); bench.encoder's `main` runs whole on a tiny random BERT converted from
a Hugging Face folder (its transformers baseline is skipped on cupy when torch has no CUDA, as here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kernel_emulator as emulate
from hpcinfer.backend.numpy_ops import NumpyOps
from bench import encoder as bench_encoder
from bench import quant as bench_quant
from bench.results import write_results

EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(4)] for i in range(max(bench_quant.BATCHES))]


def _tiny_quant_models(make_ops, modes: list, dtype: str) -> tuple[dict, dict]:
    """tiny-dense per mode (quantized while loading, as `[model] quantize` does; its KV format and top-k as
    bench.quant.load_mode_model sets them), and the fresh records."""
    from hpcinfer.checkpoint.presets import PRESETS, open_preset
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.transformer import Decoder
    from hpcinfer.quant.kv import kv_format
    from hpcinfer.quant.storage import load_quant

    load_mode = {"int8": "int8", "int4-g64": "int4"}
    models, records = {}, {}
    for mode in modes:
        ckpt, arch = open_preset("tiny-dense"), PRESETS["tiny-dense"]
        kv, topk = bench_quant.attention_of(mode)
        quant = load_quant(ckpt, load_mode.get(bench_quant.weights_of(mode), "none"), 64)
        models[mode] = Decoder(make_ops(), Groups(), arch, dtype, kv_format=kv_format(kv, 64, arch.head_dim),
                               attention_topk=topk).load(ckpt, quantize=quant)
        records[mode] = bench_quant.new_record(mode, models[mode], None, None)
    return models, records


def _quant_result(models, records, modes, cuda_graphs, backend, tmp_path):
    results = bench_quant.run_modes(models, records, modes, PROMPTS, rounds=1, new_tokens=2, cuda_graphs=cuda_graphs)
    settings = {"backend": backend, "rounds": 1, "new_tokens": 2, "prompt": 4,
                "batches": list(bench_quant.BATCHES), "threads": 1, "cuda_graphs": cuda_graphs}
    result = bench_quant.build_result(results, models[modes[0]].ops, settings,
                                      "tiny-dense", None, 0.0)
    name = "quant-gpu" if backend == "cupy" else "quant"
    stem = write_results(tmp_path, name, result, bench_quant.markdown(result))
    return json.loads(stem.with_suffix(".json").read_text()), stem.with_suffix(".md").read_text()


def _check_quant_records(saved: dict, modes: list) -> None:
    assert [r["mode"] for r in saved["modes"]] == modes
    base = saved["modes"][0]
    for r in saved["modes"]:
        assert r["ratio_to_base"]["base"] == modes[0]
        for b in bench_quant.BATCHES:
            assert r["decode_ms_per_token"][str(b)] > 0 and len(r["decode_step_s"][str(b)]) == 1
            assert len(r[f"tokens_b{b}"]) == b and all(len(t) == 2 for t in r[f"tokens_b{b}"])
        assert r["resident_weight_bytes"] > 0
    quantized = [r for r in saved["modes"] if bench_quant.weights_of(r["mode"]) != modes[0]]
    assert all(r["resident_weight_bytes"] < base["resident_weight_bytes"] for r in quantized)
    kv = [r for r in saved["modes"] if r["mode"].endswith("+kv-int4")]
    assert all(r["kv_bytes_b16"] < base["kv_bytes_b16"] for r in kv)


@pytest.mark.slow
@needs_emulator
def test_quant_cupy_modes_end_to_end(emu_cupy, tmp_path):
    """float16 baseline, int8, int4 g64 + int4 KV on CupyOps, eager and graphed, into quant-gpu-<date>.*"""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.backend.cupy_quant import DeviceQuantizedTensor

    modes = [bench_quant.FLOAT["cupy"], "int8", "int4-g64+kv-int4"]
    models, records = _tiny_quant_models(lambda: CupyOps(device=0), modes, "float16")
    assert any(isinstance(v, DeviceQuantizedTensor) for v in _values(models["int8"]))
    saved, md = _quant_result(models, records, modes, True, "cupy", tmp_path)
    _check_quant_records(saved, modes)
    assert saved["device"]["backend"] == "cupy" and saved["device"]["device_name"].startswith("Emulated")
    assert saved["settings"]["cuda_graphs"] and "machine" in saved and "git_commit" in saved
    for r in saved["modes"]:
        assert r["backend"] == "cupy" and r["ops"] == "CupyOps"
        assert r["device_weight_bytes"] == r["resident_weight_bytes"] > 0     # every weight lives on the device
        assert "graphs_error" not in r, r.get("graphs_error")
        assert all(r["decode_graph_ms_per_token"][str(b)] > 0 for b in bench_quant.BATCHES)
        assert r["graph_tokens_equal_b1"] and r["graph_tokens_equal_b16"]  # replays give the eager tokens
    assert saved["modes"][1]["device_weight_bytes"] < saved["modes"][0]["device_weight_bytes"]
    assert "CuPy backend on Emulated" in md and "graphs b1 ms/token" in md
    assert (tmp_path / f"quant-gpu-{saved['date']}.json").is_file()


def test_quant_numpy_modes_same_structure(tmp_path):
    modes = [bench_quant.FLOAT["numpy"], "int8", "float32+kv-int4"]
    models, records = _tiny_quant_models(NumpyOps, modes, "float32")
    saved, md = _quant_result(models, records, modes, False, "numpy", tmp_path)
    _check_quant_records(saved, modes)
    assert saved["device"]["backend"] == "numpy" and saved["device_pool_used_bytes"] is None
    assert all(r["device_weight_bytes"] is None and "decode_graph_ms_per_token" not in r for r in saved["modes"])
    assert "NumPy backend" in md and "graphs b1" not in md


def test_quant_modes_per_backend():
    assert bench_quant.modes_for("numpy")[0] == "float32" and bench_quant.modes_for("cupy")[0] == "float16"
    assert "float16+kv-int4" in bench_quant.modes_for("cupy")
    assert {"int8", "int4-g64", "q4_1-kept", "int4-g64+kv-int4"} <= set(bench_quant.modes_for("cupy"))


def _values(obj, seen=None):
    """Every attribute value reachable from obj (lists walked), for finding the device-quantized weights."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    children = obj if isinstance(obj, list) else vars(obj).values() if hasattr(obj, "__dict__") else ()
    for child in children:
        if not isinstance(child, (np.ndarray, str, int, float)):
            yield from _values(child, seen)


# ---- bench/encoder.py ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """(checkpoint, Hugging Face folder) of a tiny random BERT."""
    from encoder_models import save_tiny_encoder
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp("bench-bert")
    folder = save_tiny_encoder("bert", root / "hf")
    convert_hf(folder, str(root / "bert.h5"))
    return str(root / "bert.h5"), folder


def _encoder_main(monkeypatch, tmp_path, tiny_bert, backend: str) -> tuple[dict, str]:
    import threadpoolctl
    import torch

    # main() sets the thread counts of the whole process; keep this pytest process's own
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(threadpoolctl, "threadpool_limits", lambda **kw: None)
    checkpoint, folder = tiny_bert
    assert bench_encoder.main(["--backend", backend, "--checkpoint", checkpoint, "--folder", folder,
                               "--out", str(tmp_path), "--repeats", "1", "--seq-len", "16", "--batch", "4",
                               "--b1-runs", "1", "--batch-runs", "1", "--threads", "1"]) == 0
    name = "encoder-gpu" if backend == "cupy" else "encoder"
    [path] = tmp_path.glob(f"{name}-*.json")
    return json.loads(path.read_text()), path.with_suffix(".md").read_text()


@needs_emulator
def test_encoder_cupy_end_to_end(emu_cupy, monkeypatch, tmp_path, tiny_bert):
    """hpcinfer on CupyOps; transformers on cuda (torch here has none: skipped, with the reason); graphs n/a."""
    import torch

    saved, md = _encoder_main(monkeypatch, tmp_path, tiny_bert, "cupy")
    assert saved["hpcinfer_ops"] == "CupyOps" and saved["device"]["backend"] == "cupy"
    assert saved["device"]["device_name"].startswith("Emulated") and saved["software"]["torch"]
    assert saved["medians"]["hpcinfer"]["b1_ms"] > 0 and saved["medians"]["hpcinfer"]["batch_sentences_per_s"] > 0
    assert saved["cuda_graphs"]["hpcinfer"].startswith("n/a")
    if torch.cuda.is_available():                     # a CUDA torch (a GPU session) times transformers too
        assert "transformers" in saved["systems"]
    else:
        assert saved["systems"] == ["hpcinfer"] and saved["speedup"] is None
        assert "torch.cuda.is_available() is False" in saved["skipped"]["transformers"]
        assert "transformers skipped" in md
    assert "CuPy backend on Emulated" in md


def test_encoder_numpy_against_transformers(monkeypatch, tmp_path, tiny_bert):
    saved, md = _encoder_main(monkeypatch, tmp_path, tiny_bert, "numpy")
    assert saved["systems"] == ["hpcinfer", "transformers"] and saved["hpcinfer_ops"] == "NumpyOps"
    assert saved["speedup"] == saved["speedup_per_system"]["transformers"] and saved["speedup"]["b1"] > 0
    assert saved["checks"]["cosine_min"] > 0.99999
    assert saved["skipped"] == {} and saved["device"]["backend"] == "numpy"
    assert "speedup vs transformers" in md
