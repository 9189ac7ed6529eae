"""`hpcinfer plan --fix KEY=PERCENT`: fixed placement percentages of one kind (weights, cache, activations) that
cannot sum to 100 are one clear error naming the keys and their sum, before any search."""

from __future__ import annotations

import pytest

from hpcinfer.cli import main

PLAN = ["plan", "--model", "tiny-dense", "--profile", "t4-16gb", "--prompt-len", "8", "--gen-len", "4"]


@pytest.mark.parametrize("fixes, keys, total", [
    (["weights_gpu=60", "weights_cpu=60"], ["weights_gpu=60", "weights_cpu=60"], "120"),
    (["cache_gpu=50", "cache_cpu=30", "cache_disk=30.5"], ["cache_gpu=50", "cache_cpu=30", "cache_disk=30.5"],
     "110.5"),
    (["act_gpu=20", "act_cpu=30", "act_disk=10"], ["act_gpu=20", "act_cpu=30", "act_disk=10"], "60"),
])
def test_fixed_percentages_that_cannot_sum_to_100_are_one_clear_error(capsys, fixes, keys, total):
    code = main(PLAN + [arg for fix in fixes for arg in ("--fix", fix)])
    err = capsys.readouterr().err
    assert code == 2
    assert all(key in err for key in keys) and f"= {total}:" in err and "sum to 100" in err
    assert "device + host + disk" not in err


def test_fixed_percentages_that_fit_still_plan(capsys):
    assert main(PLAN + ["--fix", "weights_gpu=60", "--fix", "weights_cpu=40", "--fix", "cache_gpu=100"]) == 0
    assert "[offload]" in capsys.readouterr().out
