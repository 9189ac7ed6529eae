"""bench/abab.py's plumbing without running jobs: the rounds alternate A B A B after a warm-up run per side, the
medians and ratio come from the timed rounds only, differing tokens are reported, and the report's rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import abab


def test_rounds_alternate_and_the_ratio_is_of_the_timed_medians(tmp_path, monkeypatch):
    calls = []
    speed = {"A": 1.0, "B": 1.0, "A0": 10.0, "B0": 12.0, "A1": 30.0, "B1": 24.0, "A2": 20.0, "B2": 18.0}

    def fake_run(tree, case, work, tag, cpu_kernels=None):
        calls.append((case, tag))
        return {"tokens_per_s": speed[tag], "outputs": [[1, 2]] if tag != "B1" else [[1, 3]]}

    monkeypatch.setattr(abab, "run_case", fake_run)
    rows = abab.compare({"A": Path("a"), "B": Path("b")}, ["decode1"], 3, tmp_path)
    timed = [("decode1", tag) for tag in ("A0", "B0", "A1", "B1", "A2", "B2")]
    assert calls == [("warm-up", "A"), ("warm-up", "B")] + timed
    row = rows[0]
    assert (row["A_median"], row["B_median"]) == (20.0, 18.0) and abs(row["ratio"] - 0.9) < 1e-12
    assert row["A"] == [10.0, 30.0, 20.0] and row["same_tokens"] is False
    text = abab.report({"baseline": "abc123", "date": "2026-12-02", "commit": "def",
                        "machine": {"cpu_model": "AMD EPYC", "cpus_online": 2}, "rows": rows})
    assert "| decode1 | 4 | 1 | 10.0, 30.0, 20.0 | 12.0, 24.0, 18.0 | 0.900 | NO |" in text


def test_unknown_cases_are_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        abab.main(["--baseline", "HEAD", "--cases", "chat8,nope"])
    assert stop.value.code == 2
    assert "--cases: choose from chat8, decode1, decode16" in capsys.readouterr().err
