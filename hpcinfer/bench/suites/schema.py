"""The JSON Schema of `hpcinfer bench` results (docs/bench.md explains every field), checked with the jsonschema
library before a file is written and when a report is regenerated from one.

Two versions, chosen by the file's own `schema` key:
- "hpcinfer-bench/2" (written now): an hpcinfer cell must carry every figure of issue 9 (prompt latency, per-token
  median / p90, tokens/s, TFLOP/s per rank, achieved bandwidth per rank and its share of the machine, pipeline
  bubble, peak memory per tier, mesh) and the backend it ran on. A figure that does not apply to a cell is an
  explicit null with its reason in `figures.null_reasons` (never a silent 0 or a missing key). The transformers
  baseline keeps the lean figures (it has no mesh, weight bandwidth or bubble) and states its device.
- "hpcinfer-bench/1" (files written before 2026-11-26, e.g. bench/results/bench-cpu-2026-11-2[12].json): the lean
  figures everywhere, kept so that stored results still validate and their reports can be regenerated.
"""

from __future__ import annotations

from ...errors import ConfigError, InputError

V1, V2 = "hpcinfer-bench/1", "hpcinfer-bench/2"
CURRENT = V2

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT_OR_NULL = {"type": ["integer", "null"]}

MEMORY_TIERS = ("device_weights_bytes_per_rank", "device_kv_peak_bytes_per_rank", "host_peak_rss_bytes_per_rank",
                "weights_from_host_bytes", "weights_from_disk_bytes", "device_total_bytes_per_rank")
LEAN = ("prompt_latency_ms", "per_token_ms_median", "per_token_ms_p90", "tokens_per_s")
# The figures an hpcinfer cell of schema 2 must state (a number, or null with a reason). Memory tiers are named
# "memory.<tier>" in null_reasons.
NULLABLE = ("tflops_per_rank", "bandwidth_GBps_per_rank", "bandwidth_utilization", "bubble_fraction")

# ---- schema 1: lean figures (still read) ---------------------------------------------------------------------

FIGURES_V1 = {
    "type": "object",
    "required": list(LEAN),
    "properties": {
        "prompt_latency_ms": _NUM, "per_token_ms_median": _NUM, "per_token_ms_p90": _NUM, "tokens_per_s": _NUM,
        "tflops_per_rank": _NUM, "bandwidth_GBps_per_rank": _NUM, "bandwidth_utilization": _NUM_OR_NULL,
        "bubble_fraction": _NUM, "generate_s": _NUM, "load_s": _NUM,
        "memory": {"type": "object", "properties": {k: _INT_OR_NULL for k in MEMORY_TIERS}},
        "mesh": {"type": "object", "required": ["world", "pp", "dp", "tp"]},
    },
}


def _null_needs_reason(key: str, nested: str | None = None) -> dict:
    """If figure `key` (or memory tier `nested`) is null, figures.null_reasons must name it."""
    cond = {"properties": {key: {"type": "null"}}, "required": [key]} if nested is None else \
        {"properties": {"memory": {"properties": {nested: {"type": "null"}}, "required": [nested]}}}
    name = key if nested is None else f"{key}.{nested}"
    return {"if": cond, "then": {"required": ["null_reasons"],
                                 "properties": {"null_reasons": {"required": [name]}}}}


FIGURES_V2 = {
    "type": "object",
    "required": list(LEAN) + list(NULLABLE) + ["generate_s", "load_s", "memory", "mesh", "backend"],
    "properties": {
        **{k: _NUM for k in LEAN + ("generate_s", "load_s")},
        **{k: _NUM_OR_NULL for k in NULLABLE},
        "memory": {"type": "object", "required": list(MEMORY_TIERS),
                   "properties": {k: _INT_OR_NULL for k in MEMORY_TIERS}},
        "mesh": {"type": "object", "required": ["world", "pp", "dp", "tp", "threads_per_rank"]},
        "backend": {"enum": ["numpy", "cupy"]},
        "null_reasons": {"type": "object", "additionalProperties": {"type": "string", "minLength": 1}},
    },
    "allOf": [_null_needs_reason(k) for k in NULLABLE] + [_null_needs_reason("memory", t) for t in MEMORY_TIERS],
}

LAYOUT = {"type": "object", "required": ["name", "ranks", "tp", "pp", "dp", "ep", "expert_tp"],
          "properties": {"name": {"type": "string"}, **{k: {"type": "integer", "minimum": 1}
                                                        for k in ("ranks", "tp", "pp", "dp", "ep", "expert_tp")}}}


def _cell(figures: dict) -> dict:
    return {
        "type": "object",
        "required": ["layout", "batch", "variant", "status"],
        "properties": {
            "layout": LAYOUT, "batch": {"type": "integer", "minimum": 1}, "variant": {"type": "string"},
            "status": {"enum": ["ok", "skipped", "rejected", "failed"]}, "reason": {"type": "string"},
            "figures": figures, "runs": {"type": "array", "items": figures},
        },
        "if": {"properties": {"status": {"const": "ok"}}},
        "then": {"required": ["figures", "runs"]},
        "else": {"required": ["reason"]},
    }


def _baseline(strict: bool) -> dict:
    ok_needs = ["layout", "batch", "ratios"]
    schema = {
        "type": "object",
        "required": ["name", "kind", "status"],
        "properties": {
            "name": {"type": "string"}, "kind": {"enum": ["transformers", "naive"]},
            "status": {"enum": ["ok", "not applicable"]}, "reason": {"type": "string"},
            "layout": {"type": "string"}, "batch": {"type": "integer"}, "figures": FIGURES_V1,
            "ratios": {"type": "object", "additionalProperties": _NUM},
            "checks": {"type": "object", "required": ["min", "length"]},
            "device": {"type": "string", "minLength": 1},
        },
        "if": {"properties": {"status": {"const": "ok"}}},
        "then": {"required": ok_needs},
        "else": {"required": ["reason"]},
    }
    if strict:       # schema 2: an ok transformers baseline says where it ran ("cpu", "cuda:0 (H200)")
        schema["then"] = {"required": ok_needs, "if": {"properties": {"kind": {"const": "transformers"}}},
                          "then": {"required": ok_needs + ["device", "figures"]}}
    return schema


def _suite(cell: dict, baseline: dict) -> dict:
    return {
        "type": "object",
        "required": ["name", "prompt_len", "new_tokens", "batches", "model", "cells", "baselines"],
        "properties": {
            "name": {"enum": ["dense-latency", "moe-latency", "throughput", "offload-max-batch"]},
            "prompt_len": {"type": "integer", "minimum": 1}, "new_tokens": {"type": "integer", "minimum": 2},
            "batches": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
            "model": {"type": "object", "required": ["family", "parameters", "layers", "moe"]},
            "cells": {"type": "array", "items": cell}, "baselines": {"type": "array", "items": baseline},
            "max_batch": {"type": "object"},
        },
    }


def _top(version: str, suite: dict) -> dict:
    required = ["schema", "date", "timestamp", "machine", "software", "config", "suites", "not_applicable",
                "warnings"] + (["backend"] if version == V2 else [])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"hpcinfer bench results ({version})",
        "type": "object",
        "required": required,
        "properties": {
            "schema": {"const": version},
            "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
            "backend": {"enum": ["numpy", "cupy"]},
            "machine": {"type": "object", "required": ["cpu_model", "cpus_usable", "gpus", "memory_read"],
                        "properties": {"gpus": {"type": "array", "items": {
                            "type": "object", "required": ["name", "driver"]}},
                            "memory_read": {"type": "object", "required": ["GBps"]}}},
            "software": {"type": "object", "required": ["hpcinfer", "git_commit"]},
            "config": {"type": "object", "required": ["path", "repeats", "layouts", "launcher"]},
            "suites": {"type": "array", "items": suite},
            "not_applicable": {"type": "array", "items": {"type": "object", "required": ["name", "reason"]}},
            "warnings": {"type": "array", "items": {"type": "string"}},
        },
    }


SCHEMA_V1 = _top(V1, _suite(_cell(FIGURES_V1), _baseline(False)))
SCHEMA_V2 = _top(V2, _suite(_cell(FIGURES_V2), _baseline(True)))
SCHEMAS = {V1: SCHEMA_V1, V2: SCHEMA_V2}
SCHEMA = SCHEMAS[CURRENT]


def validate(result: dict, where: str = "bench results") -> None:
    """Raise InputError naming the first schema violation (its path in the JSON and what was expected), against
    the schema version the file names (an unknown version is itself the violation)."""
    try:
        import jsonschema
    except ImportError:
        raise ConfigError("checking bench results needs the jsonschema package: pip install -e '.[bench]'") \
            from None
    version = result.get("schema") if isinstance(result, dict) else None
    if version not in SCHEMAS:
        raise InputError(f"{where}: schema: {version!r} is not a bench results schema; known: "
                         f"{', '.join(SCHEMAS)}")
    errors = list(jsonschema.Draft202012Validator(SCHEMAS[version]).iter_errors(result))
    if errors:
        e = jsonschema.exceptions.best_match(errors)          # the deepest, most specific problem
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise InputError(f"{where}: {path}: {e.message} ({len(errors)} problem(s) in all)")
