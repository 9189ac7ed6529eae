"""bench.gpu_attention (the decode attention sweep of the prepared GPU command) rehearsed on the CPU stand-in of
cupy with --quick sizes: every (layout, dtype, batch, context) row is measured through a captured graph, agrees
with NumpyOps.attention, names the chunk count chosen and counts the K/V bytes it must read. Times mean nothing
here."""

from __future__ import annotations

import json

import pytest

from bench import gpu_attention
import kernel_emulator as emulate

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")


def test_the_quick_sweep_writes_a_row_per_case(emu_cupy, tmp_path):
    assert gpu_attention.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-attention.json").read_text())
    rows = result["rows"]
    assert {(r["layout"], r["batch"], r["context"]) for r in rows} == {
        (layout, batch, context) for layout in ("dense", "paged") for batch in (1, 2) for context in (20, 70)}
    for r in rows:
        assert r["dtype"] == "float16" and r["max_abs_err"] < 5e-3 and r["us"] > 0
        assert r["kv_bytes"] == 2 * r["batch"] * 2 * r["context"] * 64 * 2        # K and V, Hkv 2, hd 64, fp16
        assert r["chunks"] >= 1
    assert "| paged | float16 | 4:2:64 |" in (tmp_path / "gpu-attention.md").read_text()


def test_shapes_the_kernels_do_not_take_are_refused():
    with pytest.raises(SystemExit):
        gpu_attention.main(["--shapes", "12:1:64"])          # group 12 > MAX_GROUP
