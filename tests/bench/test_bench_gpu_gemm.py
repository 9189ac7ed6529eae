"""The GEMM sweep of the prepared GPU command (bench.gpu_gemm) rehearsed on the CPU stand-in of
cupy with a tiny preset's shapes: every row times the paths that take its T (the GEMV at 1, the tensor-core GEMM
from 2) in a captured graph and checks the kernel against float32 x @ W^T. The times mean nothing here."""

from __future__ import annotations

import json

import pytest

from bench import gpu_gemm, gpu_linear
from hpcinfer.checkpoint.presets import PRESETS


@pytest.mark.exhaustive
def test_gemm_sweep_times_each_path_in_a_graph(emu_cupy, tmp_path):
    argv = ["--shapes", "tiny-dense", "--tokens", "1,3", "--out", str(tmp_path), "--copy-mb", "1",
            "--spill-mb", "1"]
    assert gpu_gemm.main(argv) == 0
    result = json.loads((tmp_path / "gpu-gemm.json").read_text())
    shapes = gpu_linear.layer_shapes(PRESETS["tiny-dense"])
    assert [(r["out"], r["in"], r["T"]) for r in result["rows"]] == [(o, i, t) for o, i in shapes for t in (1, 3)]
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["gemv_us"] > 0 and row["gemv_err"] < 1e-5
        assert ("tc_us" in row) == (row["T"] > 1)          # the tensor-core GEMM declines one token
        assert row.get("tc_err", 0) < 1e-5 and "cublas_us" not in row
    assert result["cublaslt_ctypes"] == "not built"


def test_shape_sets_and_refusals():
    assert gpu_gemm.shape_sets(["llama8b"])["llama8b"] == gpu_gemm.LLAMA_8B
    assert gpu_gemm.shape_sets(["gpt2"])["gpt2"] == gpu_linear.layer_shapes(PRESETS["gpt2-1.5b"])
    with pytest.raises(SystemExit):
        gpu_gemm.main(["--shapes", "gpt5"])
