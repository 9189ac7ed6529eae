"""bench/quant.py's attention modes (int8 KV, top-k sparse attention) on a tiny model, and a smoke
run of bench/perplexity.py on SmolLM2 (2 short windows; skipped without models/smollm2.h5)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import perplexity as bench_perplexity
from bench import quant as bench_quant
from hpcinfer.backend.numpy_ops import NumpyOps

PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(6)] for i in range(max(bench_quant.BATCHES))]


def test_modes_include_int8_kv_and_top_k():
    for backend, f in bench_quant.FLOAT.items():
        modes = bench_quant.modes_for(backend)
        assert modes[0] == f and {f"{f}+kv-int8", f"{f}+topk-0.1", "int4-g64+kv-int4+topk-0.1"} <= set(modes)
        assert [bench_quant.attention_of(m) for m in modes] is not None        # every listed mode parses
    assert bench_quant.attention_of("int4-g64+kv-int4+topk-0.1") == ("int4", 0.1)
    assert bench_quant.attention_of("float32") == ("none", 0.0)
    assert bench_quant.weights_of("int4-g64+kv-int4+topk-0.1") == "int4-g64"
    for bad in ("float32+kv-int3", "float32+topk-0", "float32+topk-2", "float32+sparse"):
        with pytest.raises(SystemExit, match="unknown option"):
            bench_quant.attention_of(bad)


def test_attention_modes_run_and_use_their_cache_and_top_k():
    """One round of the new modes on tiny-dense, each built with the mode's options (as load_mode_model passes
    them to api.load_model): the int8 cache is smaller than the float one, and the top-k modes really ran with
    top-k set on every layer."""
    from hpcinfer.checkpoint.presets import PRESETS, open_preset
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.transformer import Decoder
    from hpcinfer.quant.kv import kv_format

    arch, modes = PRESETS["tiny-dense"], ["float32", "float32+kv-int8", "float32+topk-0.1"]
    models = {}
    for mode in modes:
        kv, topk = bench_quant.attention_of(mode)
        models[mode] = Decoder(NumpyOps(), Groups(), arch, "float32", kv_format=kv_format(kv, 64, arch.head_dim),
                               attention_topk=topk).load(open_preset("tiny-dense"))
    records = {m: bench_quant.new_record(m, models[m], None, None) for m in modes}
    for mode in modes:
        bench_quant.measure_round(mode, models[mode], records[mode], PROMPTS, 2, False)
    assert records["float32+kv-int8"]["kv_bytes_b16"] < records["float32"]["kv_bytes_b16"]
    assert {m: {b.attn.topk for b in models[m].blocks} for m in modes} == \
        {"float32": {0.0}, "float32+kv-int8": {0.0}, "float32+topk-0.1": {0.1}}
    assert all(len(records[m]["tokens_b16"]) == 16 for m in modes)


def test_window_nll_is_the_negative_log_softmax_of_the_next_token():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1, 1, 1]], dtype=np.float32))
    got = bench_perplexity.window_nll(logits, [2, 0, 2])
    assert np.allclose(got, [-math.log(0.5), -math.log(0.8)])


@pytest.mark.skipif(not bench_perplexity.H5.is_file(), reason=f"{bench_perplexity.H5} not present")
def test_perplexity_smoke_run_on_smollm2(tmp_path):
    """2 windows of 8 tokens: the token-by-token loop (the decode modes' path) equals the prefill
    (float32-decode = float32, within float32 rounding), and the result files are written complete."""
    args = ["--windows", "2", "--window", "8", "--modes", "float32,float32-decode", "--out", str(tmp_path),
            "--tag", "smoke"]
    assert bench_perplexity.main(args) == 0
    [path] = tmp_path.glob("perplexity-*smoke.json")
    result = json.loads(path.read_text())
    assert result["complete"] and [r["mode"] for r in result["modes"]] == ["float32", "float32-decode"]
    base, decode = (r["perplexity"] for r in result["modes"])
    assert all(r["predictions"] == 14 for r in result["modes"])
    assert math.isclose(decode, base, rel_tol=1e-4) and 1 < base < 1e4
    assert path.with_suffix(".md").is_file()
