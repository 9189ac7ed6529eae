"""bench/batching.py without running it: the kept workload has make_prompts' shape (seeded chat
prompts over the whole length range), and the report's ratios and cells come from the runs it is given."""

from __future__ import annotations

import json
from pathlib import Path

from bench import batching


def test_the_kept_workload_has_the_shape_make_prompts_gives():
    """(Not compared with a fresh make_prompts(): pydoc_data/topics.py changes between Python releases.)"""
    kept = [json.loads(line) for line in Path(batching.PROMPTS).read_text().splitlines()]
    fresh = batching.make_prompts()
    assert [p["id"] for p in kept] == [p["id"] for p in fresh]
    assert len(kept) >= 256 and len({p["id"] for p in kept}) == len(kept)
    assert all(p["chat"] is True and p["text"].split("\n\n")[0] in batching.QUESTIONS for p in kept)
    words = sorted(len(p["text"].split("\n\n", 1)[1].split()) for p in kept)
    assert words[0] <= 15 and words[-1] >= 600                 # about 16 to 1,024 tokens with the template


def run(tokens_per_s, occupancy=None, imbalance=None):
    return {"tokens_per_s": tokens_per_s, "occupancy": occupancy, "preemptions": 0, "replica_imbalance": imbalance,
            "token_latency_s": {"p50": 0.1, "p90": 0.2, "p99": 0.3}}


def test_report_ratios_are_against_static_at_the_same_dp():
    result = {"date": "2026-11-27", "commit": "abc", "machine": {"cpu_model": "cpu", "cpus_usable": 2},
              "settings": {"prompts": 4, "max_new": 8, "batch": 2, "prompt_tokens": {"min": 5, "max": 50, "median": 9}},
              "runs": {"static dp=1": run(80.0, 0.5, 1.0), "continuous dp=1": run(100.0, 1.0, 1.0),
                       "static dp=2": run(90.0, 0.5, 1.2), "continuous dp=2": run(135.0, 1.0, 1.05),
                       "transformers generate": {"tokens_per_s": 40.0}},
              "checks": {"dp=1: continuous file == static file": True}}
    text = batching.report(result)
    assert "| continuous dp=1 | 100.0 | 1.25x | 1.00 | 0.100 / 0.300 | 0 | 1.000 |" in text
    assert "| continuous dp=2 | 135.0 | 1.50x | 1.00 | 0.100 / 0.300 | 0 | 1.050 |" in text
    assert "| transformers generate | 40.0 | 0.50x |  |  |  |  |" in text
    assert "- dp=1: continuous file == static file: True" in text
