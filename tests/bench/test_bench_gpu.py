"""bench/gpu.py (`make bench-gpu`) without a GPU: its --quick plumbing end to end on the CPU fake of
cupy (tests/helpers/emu_cupy/) with the tiny presets, and the parts that can be wrong without a GPU checked by hand:
the FLOP and byte counts behind TFLOP/s and GB/s, DeepSpeed's capacity, and the CuPy one-hot einsum MoE it times
against. The times themselves mean nothing here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import gpu
from hpcinfer.checkpoint.presets import PRESETS

TINY = PRESETS["tiny-dense"]      # V = 256, D = 64, 4 layers, 4 heads of 16, F = 256, 128 learned positions, tied


def results(out) -> dict:
    (path,) = out.glob("gpu-*.json")
    assert path.with_suffix(".md").exists()
    return json.loads(path.read_text())


def transformers_unrunnable() -> str | None:
    """Why bench_hf cannot time transformers here (the start of its skip reason), or None where it must."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return "torch/transformers not importable"
    return None if torch.cuda.is_available() else "torch has no CUDA device here"


def test_quick_run_records_every_section(emu_cupy, tmp_path):
    """Plain-CuPy ops (kernels off: fast on the fake): every section holds numbers; only the transformers cell may
    be skipped, with the reason this machine gives (torch without CUDA), never another."""
    assert gpu.main(["--quick", "--repeats", "1", "--no-kernels", "--out", str(tmp_path)]) == 0
    r = results(tmp_path)
    assert r["device"]["emulated"] and r["commit"] and r["date"] and r["device"]["driver"]
    s = r["sections"]
    assert s["timer"] == "perf_counter+stream.synchronize"            # the fake has no CUDA event timing
    assert "error" not in json.dumps(s)
    assert s["copy"]["GBps"] > 0 and s["copy"]["bytes"] == 8 << 20
    dec = s["decode"]["tiny-dense"]
    assert dec["ms_per_token"] > 0 and dec["steps"] == gpu.QUICK.new_tokens - 1
    assert dec["fraction_of_copy"] == pytest.approx(dec["GBps"] / s["copy"]["GBps"])
    graphs = s["graphs"]["tiny-dense"]
    on = graphs["on"]                                                   # plain CuPy calls cuBLAS: never captured
    assert (on["graph_captures"], on["graph_replays"], on["graph_eager_steps"]) == (0, 0, gpu.QUICK.new_tokens - 1)
    assert graphs["off"]["graph_captures"] == 0 and graphs["speedup"] > 0
    hf, why = s["hf"]["tiny-dense"], transformers_unrunnable()
    if why is None:                                                     # torch sees a GPU: a number is due
        assert hf["ms_per_token"] > 0 and hf["hpcinfer_speedup"] > 0
    else:                                                               # the only cell that may be skipped, and why
        assert set(hf) == {"skipped"} and hf["skipped"].startswith(why), hf
    for length in map(str, gpu.QUICK.prefill_lens):
        cell = s["prefill"]["tiny-dense"][length]
        assert cell["flops"] == gpu.prefill_flops(TINY, gpu.QUICK.prefill_batch, int(length))
        assert cell["TFLOPs"] > 0 and cell["gemm"]["float16"]["TFLOPs"] > 0
    assert len(s["moe"]["cells"]) == 2                                  # the two gatings, both measured
    for cell in s["moe"]["cells"].values():
        assert cell["speedup"] > 0 and cell["max_abs_diff"] < 1e-5


def test_decode_at_several_batch_sizes(emu_cupy, tmp_path):
    """--decode-batch 1,3: a decode and a graphs cell per batch size ("tiny-dense x3" past batch 1), with the KV
    bytes of every sequence counted; a bad list is refused."""
    assert gpu.main(["--quick", "--repeats", "1", "--no-kernels", "--only", "decode,graphs", "--decode-batch", "1,3",
                     "--out", str(tmp_path)]) == 0
    s = results(tmp_path)["sections"]
    one, three = s["decode"]["tiny-dense"], s["decode"]["tiny-dense x3"]
    assert (one["batch"], three["batch"]) == (1, 3) and set(s["graphs"]) == {"tiny-dense", "tiny-dense x3"}
    assert three["bytes_per_token"]["kv"] == pytest.approx(3 * one["bytes_per_token"]["kv"])
    assert three["bytes_per_token"]["weights"] == one["bytes_per_token"]["weights"]
    assert three["tokens_per_s"] == pytest.approx(3e3 / three["ms_per_token"])
    with pytest.raises(SystemExit, match="--decode-batch '1,0'"):
        gpu.main(["--quick", "--decode-batch", "1,0", "--out", str(tmp_path)])


def test_only_with_the_kernels(emu_cupy, tmp_path):
    """The kernels' path (as on a GPU) for decode, CUDA graphs and MoE; the sections not chosen say so."""
    assert gpu.main(["--quick", "--repeats", "1", "--only", "decode,graphs,moe", "--out", str(tmp_path)]) == 0
    s = results(tmp_path)["sections"]
    assert s["decode"]["tiny-dense"]["ms_per_token"] > 0
    on = s["graphs"]["tiny-dense"]["on"]                                # the kernels' decode step is captured
    assert on["graph_captures"] >= 1 and on["graph_replays"] == gpu.QUICK.new_tokens - 1
    assert on["graph_eager_steps"] == 0
    assert [c["max_abs_diff"] < 1e-5 for c in s["moe"]["cells"].values()] == [True, True]
    for name in ("hf", "prefill"):
        assert s[name] == {"skipped": "not selected (--only)"}
    assert "copy" in s and "GBps" in s["copy"]                        # decode's reference is measured anyway


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit, match="unknown sections"):
        gpu.main(["--only", "decode,nope"])


def test_counts_by_hand():
    # per layer: q, k, v, o 64 x 64 and the MLP 64 x 256 twice = 4 * 4096 + 2 * 16384 = 49152; 4 layers
    assert gpu.matrix_params(TINY) == (196608, 256 * 64)
    # vectors: per layer 2 LayerNorms (w + b) 256, qkv bias 192, out bias 64, up bias 256, down bias 64 = 832,
    # x 4 layers + the final LayerNorm 128 = 3456; one token and one position row 128; float16
    nbytes = gpu.decode_bytes(TINY, 2, context=14)
    assert nbytes["weights"] == (196608 + 16384 + 3456 + 128) * 2 == 433152
    assert nbytes["kv"] == 4 * 2 * 4 * 16 * 14 * 4 == 28672            # layers, K and V, heads, head dim, float32
    # 2 sequences x 10 tokens: projections 2 * 196608 * 20, LM head at the 2 last positions 2 * 16384 * 2,
    # causal attention 4 layers * 2 seqs * 4 heads * (QK + PV: 2 * 2 * 16 * 55 pairs)
    assert gpu.prefill_flops(TINY, 2, 10) == 7864320 + 65536 + 112640 == 8042496


def test_capacity_as_deepspeed():
    assert gpu.moe_capacity(8, 1, 128) == 4                            # the minimum, 4
    assert gpu.moe_capacity(2048, 1, 128) == 16
    assert gpu.moe_capacity(100, 2, 8, 1.0) == 25
    assert gpu.moe_capacity(2, 1, 8) == 2                              # never above the tokens


@pytest.mark.parametrize("k, normalize, capacity", [(1, "none", 3), (2, "topk", 4), (2, "none", 12)])
def test_einsum_moe_is_the_reference(k, normalize, capacity):
    """The bench's array-code einsum path (on NumPy) equals moe_reference's one-hot einsum and the table path, with
    tokens dropped over capacity."""
    from moe_reference import einsum_moe as reference_einsum, table_moe

    rng = np.random.default_rng(3)
    T, D, E = 12, 8, 4
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate_w = rng.standard_normal((E, D)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, E).astype(np.float32)
    logits = x @ gate_w.T
    got = gpu.einsum_moe(np, x, logits, scale, k, normalize, capacity)
    expert = lambda e, rows: rows * scale[e]
    np.testing.assert_allclose(got, reference_einsum(x, gate_w, expert, k, normalize, capacity), atol=1e-5)
    np.testing.assert_allclose(got, table_moe(x, gate_w, expert, k, normalize, capacity), atol=1e-5)


def test_a_failing_section_is_recorded_and_the_run_goes_on(emu_cupy, tmp_path, monkeypatch):
    """A one-shot GPU run must not lose every number to one failure (a capture refused, out of memory)."""
    def broken(*args):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(gpu, "bench_moe", broken)
    monkeypatch.setattr(gpu, "bench_prefill", broken)
    assert gpu.main(["--quick", "--repeats", "1", "--no-kernels", "--only", "copy,moe,prefill",
                     "--out", str(tmp_path)]) == 0
    r = results(tmp_path)
    assert r["partial"] is False and r["sections"]["copy"]["GBps"] > 0
    assert r["sections"]["moe"] == {"error": "RuntimeError: out of memory (simulated)"}
    assert r["sections"]["prefill"]["tiny-dense"]["error"].startswith("RuntimeError")
    assert sorted(w.split(" failed")[0] for w in r["warnings"]) == ["moe", "prefill.tiny-dense"]
    assert "error: RuntimeError: out of memory" in next(tmp_path.glob("gpu-*.md")).read_text()


@pytest.mark.parametrize("name, difference", [
    ("gpt2-1.5b", 0),
    # GPT-J in transformers: one LayerNorm per block (hpcinfer's preset has two) and a biased LM head
    ("gpt-j-6b", 28 * 2 * 4096 - 50400),
])
def test_transformers_baseline_has_the_presets_shapes(name, difference):
    """The HF model the bench times is the preset's architecture: parameter counts agree (on the meta device)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    arch = PRESETS[name]
    config, why = gpu.hf_config(arch)
    assert why is None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert arch.param_count() - sum(p.numel() for p in model.parameters()) == difference
