"""The chat-workload benchmarks' plumbing (bench/chat_workload.py, bench/chat_cpu.py) without the real
model: the kept workload's shape, a real `hpcinfer run` through hpcinfer_run on a tiny preset (alone and at dp = 2,
continuous and static agreeing), EOS cutting, agreement counts, and the report's rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from bench import chat_workload
from bench import chat_cpu
from bench.cpu_ops import attention_rows, weight_matrices
from hpcinfer.checkpoint.presets import PRESETS, open_preset
from hpcinfer.comm.group import Groups
from hpcinfer.metrics import held_weight_bytes
from hpcinfer.model.transformer import Decoder


def test_the_kept_workload_has_its_shape():
    kept = [json.loads(line) for line in Path(chat_cpu.PROMPTS).read_text().splitlines()]
    assert len(kept) == 64 and len({p["id"] for p in kept}) == 64
    assert all(p["chat"] is True and p["text"].split("\n\n")[0] in chat_workload.QUESTIONS for p in kept)
    words = sorted(len(p["text"].split("\n\n", 1)[1].split()) for p in kept)
    assert words[-1] <= chat_cpu.WORDS[1] and words[-1] > 4 * words[0]          # (a short topic gives fewer words)


@pytest.mark.parametrize("dp", [1, 2])
def test_hpcinfer_run_returns_metrics_and_outputs(tmp_path, dp):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [(7 * i + k) % 200 + 1 for k in range(3 + 2 * i)]})
                               + "\n" for i in range(6)))
    runs = {mode: chat_workload.hpcinfer_run(prompts, tmp_path / f"{mode}.jsonl", dp, 2, 5, {"batching": mode}, 300,
                                             {"preset": "tiny-dense"}) for mode in ("static", "continuous")}
    for mode, metrics in runs.items():
        assert metrics["batching"]["mode"] == mode and metrics["wall_s"] > 0
        assert len(metrics["outputs"]) == 6 and all(1 <= len(row) <= 5 for row in metrics["outputs"])
    assert runs["static"]["outputs"] == runs["continuous"]["outputs"]


def test_eos_cut_and_agreement():
    assert chat_workload.up_to_eos([5, 6, 2, 7], [2]) == [5, 6, 2]
    assert chat_workload.up_to_eos([5, 6], [2]) == [5, 6]
    assert chat_workload.agreement([[1, 2], [3], [4]], [[1, 2], [3, 9], [4]]) == 2


def test_report_rows_are_against_transformers():
    result = {"date": "2026-11-27", "commit": "abc", "machine": {"cpu_model": "cpu", "cpus_usable": 2},
              "settings": {"prompts": 2, "max_new": 8, "batch": 8, "prompt_tokens": {"min": 5, "max": 9, "total": 14}},
              "runs": {"transformers (static batches of 8)": {"tokens_per_s": 20.0, "generate_s": 10.0,
                                                            "generated_tokens": 200, "agree": "2 / 2"},
                       "hpcinfer continuous (batch_size 8)": {"tokens_per_s": 50.0, "generate_s": 4.0,
                                                             "generated_tokens": 200, "agree": "2 / 2"}}}
    text = chat_cpu.report(result)
    assert "| hpcinfer continuous (batch_size 8) | 50.0 | 4 | 2.50x | 200 | 2 / 2 |" in text
    assert "| transformers (static batches of 8) | 20.0 | 10 | 1.00x | 200 | 2 / 2 |" in text


def test_op_clock_counts_outermost_calls_only():
    """cpu_ops.OpClock: an op called inside another (fused_linear's own linear) is the outer op's time."""
    import time as _time

    from bench.cpu_ops import OpClock

    class Ops:
        def linear(self, x):
            _time.sleep(0.01)
            return x

        def fused_linear(self, x):
            return self.linear(x)

    ops = Ops()
    clock = OpClock(ops, ("linear", "fused_linear"))
    ops.fused_linear(1)
    ops.linear(2)
    taken = clock.take()
    assert set(taken) == {"linear", "fused_linear"}
    assert 0.01 <= taken["fused_linear"] < 0.05 and 0.01 <= taken["linear"] < 0.05
    assert clock.take() == {}


def test_weight_matrices_are_every_matrix_a_decode_step_multiplies_by_once():
    """cpu_ops.weight_matrices (the projections-alone table): every float32 [out, in] matrix the model holds, each
    once (the tied LM head is the embedding table), nearly all of held_weight_bytes (the rest: norms, biases)."""
    model = Decoder(NumpyOps(), Groups(), PRESETS["tiny-dense"]).load(open_preset("tiny-dense"))
    matrices = weight_matrices(model)
    assert len({id(m) for m in matrices}) == len(matrices)
    assert all(m.ndim == 2 and m.dtype == np.float32 for m in matrices)
    assert len(matrices) >= model.arch.num_layers * 2 + 1
    held, counted = held_weight_bytes(model), sum(m.nbytes for m in matrices)
    assert 0.9 * held <= counted <= held


def test_attention_rows_time_both_settings_over_both_stores():
    """cpu_ops.attention_rows (decode attention alone, issue 31): numpy and numba over the slot store and the paged
    pool of each block size, every row with its K/V bytes; the ops are left on numba."""
    model = Decoder(NumpyOps(1, "numba"), Groups(), PRESETS["tiny-dense"]).load(open_preset("tiny-dense"))
    rows = attention_rows(model, 3, [5, 20], 1, blocks=(4, 16))
    assert {(r["context"], r["kernels"], r["store"]) for r in rows} == {
        (c, k, s) for c in (5, 20) for k in ("numpy", "numba") for s in ("slots", "paged bs4", "paged bs16")}
    assert all(r["GBps"] > 0 and r["kv_bytes"] == rows[0]["kv_bytes"] * (r["context"] + 1) // 6 for r in rows)
    assert model.ops.cpu_kernels == "numba"
