"""bench.gpu_linear's comparison of SBI tilings and fused norms, on the CPU stand-in of cupy (the times mean
nothing here; the rows, their keys and the kernels' errors do). The lead's GPU run compares the tilings with
`--tiling rows,cols` on one machine, in one call."""

from __future__ import annotations

import json

import pytest

from hpcinfer.backend import cupy_sbi
from bench import gpu_linear
from hpcinfer.checkpoint.presets import PRESETS


@pytest.mark.slow
def test_gpu_linear_rows_per_tiling_and_norm(emu_cupy, tmp_path, capsys):
    tilings = ["cols", "rows:2x2x1"]          # "rows", the default, is what every other gpu_linear test times
    argv = ["--preset", "tiny-dense", "--tokens", "1,3", "--tiling", ",".join(tilings), "--norm", "none,layernorm",
            "--out", str(tmp_path), "--copy-mb", "1", "--spill-mb", "1"]
    assert gpu_linear.main(argv) == 0
    result = json.loads((tmp_path / "gpu-linear.json").read_text())
    shapes = gpu_linear.layer_shapes(PRESETS["tiny-dense"])
    keys = [(r["out"], r["in"], r["T"], r["norm"], r["tiling"]) for r in result["rows"]]
    assert keys == [(o, i, t, n, tl) for o, i in shapes for t in (1, 3) for n in ("none", "layernorm")
                    for tl in tilings]
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["sbi_us"] > 0 and row["max_rel_err"] < 1e-5        # float16 W, float32 accumulation
        launch = cupy_sbi.plan(row["T"], row["in"], row["out"], "float16", 1, tiling=row["tiling"])
        assert tuple(row["block"]) == launch.block
    assert result["tilings"] == tilings
    table = capsys.readouterr().out
    assert "| tiling | norm | grid | block |" in table and "| rows:2x2x1 | layernorm |" in table


@pytest.mark.parametrize("argv, message", [(["--tiling", "rows,diagonal"], "--tiling"),
                                           (["--norm", "batchnorm"], "--norm")])
def test_gpu_linear_refuses_unknown_options(emu_cupy, argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_linear.main(argv)
    assert message in capsys.readouterr().err
