"""The window's diagnostics without a GPU: bench.gpu --quantize (a cell per load mode),
bench.gpu_linear (the SBI GEMV in a captured graph, checked against float32 x @ W^T) on the CPU stand-in of
cupy, and gpu/ncu_table.py on an ncu CSV of the shape Nsight Compute writes. The times mean nothing here."""

from __future__ import annotations

import json

import pytest

from gpu import ncu_table
from bench import gpu, gpu_linear
from hpcinfer.checkpoint.presets import PRESETS


def test_quantize_modes_get_a_decode_cell_each(emu_cupy, tmp_path):
    argv = ["--quick", "--repeats", "1", "--only", "decode", "--quantize", "none,int8", "--out", str(tmp_path)]
    assert gpu.main(argv) == 0
    (path,) = tmp_path.glob("gpu-*.json")
    decode = json.loads(path.read_text())["sections"]["decode"]
    assert set(decode) == {"tiny-dense", "tiny-dense int8"}
    plain, int8 = decode["tiny-dense"], decode["tiny-dense int8"]
    assert plain["ms_per_token"] > 0 and int8["ms_per_token"] > 0
    layers, head = gpu.matrix_params(PRESETS["tiny-dense"])
    assert plain["bytes_per_token"]["weights"] - int8["bytes_per_token"]["weights"] == layers * (2 - 1)


def test_unknown_quantize_mode_is_refused():
    with pytest.raises(SystemExit, match="--quantize 'int3'"):
        gpu.main(["--quick", "--quantize", "int3"])


def test_gpu_linear_times_the_kernel_in_a_graph_and_checks_it(emu_cupy, tmp_path):
    argv = ["--preset", "tiny-dense", "--tokens", "1,3", "--out", str(tmp_path), "--copy-mb", "1", "--spill-mb", "1"]
    assert gpu_linear.main(argv) == 0
    result = json.loads((tmp_path / "gpu-linear.json").read_text())
    shapes = gpu_linear.layer_shapes(PRESETS["tiny-dense"])
    assert [(r["out"], r["in"], r["T"]) for r in result["rows"]] == [(o, i, t) for o, i in shapes for t in (1, 3)]
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["sbi_us"] > 0 and row["max_rel_err"] < 1e-5        # float16 W, float32 accumulation
        assert "cublas_us" not in row                                  # no CUDA torch beside the stand-in


CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","sbi_gemv","1","7","(32, 4, 1)","(50, 6, 1)","0","9.0","m","gpu__time_duration.sum","ns","15,000"
"1","1","python3","h","sbi_gemv","1","7","(32, 4, 1)","(50, 6, 1)","0","9.0","m","gpu__time_duration.sum","ns","17,000"
"2","1","python3","h","decode_attention","1","7","(32, 4, 1)","(25, 1, 1)","0","9.0","m","gpu__time_duration.sum","us","8"
'''


def test_ncu_table_sums_launches_per_kernel_and_shape(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(CSV)
    times = ncu_table.kernel_times(str(path))
    assert times == {("sbi_gemv", "(50, 6, 1)", "(32, 4, 1)"): [15.0, 17.0],
                     ("decode_attention", "(25, 1, 1)", "(32, 4, 1)"): [8.0]}
    text = ncu_table.table(times, layers=2)
    assert "3 launches, 40.0 us" in text
    assert "| sbi_gemv | (50, 6, 1) | (32, 4, 1) | 2 | 32.0 | 16.00 | 80.0% | 16.00 |" in text
