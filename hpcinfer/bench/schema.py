"""The JSON Schema of `hpcinfer bench` results (schema "hpcinfer-bench/1"; docs/bench.md explains every field),
checked with the jsonschema library before a file is written and when a report is regenerated from one."""

from __future__ import annotations

from ..errors import ConfigError, InputError

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT_OR_NULL = {"type": ["integer", "null"]}

FIGURES = {
    "type": "object",
    "required": ["prompt_latency_ms", "per_token_ms_median", "per_token_ms_p90", "tokens_per_s"],
    "properties": {
        "prompt_latency_ms": _NUM, "per_token_ms_median": _NUM, "per_token_ms_p90": _NUM, "tokens_per_s": _NUM,
        "tflops_per_rank": _NUM, "bandwidth_GBps_per_rank": _NUM, "bandwidth_utilization": _NUM_OR_NULL,
        "bubble_fraction": _NUM, "generate_s": _NUM, "load_s": _NUM,
        "memory": {"type": "object", "properties": {
            "device_weights_bytes_per_rank": _INT_OR_NULL, "device_kv_peak_bytes_per_rank": _INT_OR_NULL,
            "host_peak_rss_bytes_per_rank": _INT_OR_NULL, "weights_from_host_bytes": _INT_OR_NULL,
            "weights_from_disk_bytes": _INT_OR_NULL, "device_total_bytes_per_rank": _INT_OR_NULL}},
        "mesh": {"type": "object", "required": ["world", "pp", "dp", "tp"]},
    },
}

LAYOUT = {"type": "object", "required": ["name", "ranks", "tp", "pp", "dp", "ep", "expert_tp"],
          "properties": {"name": {"type": "string"}, **{k: {"type": "integer", "minimum": 1}
                                                        for k in ("ranks", "tp", "pp", "dp", "ep", "expert_tp")}}}

CELL = {
    "type": "object",
    "required": ["layout", "batch", "variant", "status"],
    "properties": {
        "layout": LAYOUT, "batch": {"type": "integer", "minimum": 1}, "variant": {"type": "string"},
        "status": {"enum": ["ok", "skipped", "rejected", "failed"]}, "reason": {"type": "string"},
        "figures": FIGURES, "runs": {"type": "array", "items": FIGURES},
    },
    "if": {"properties": {"status": {"const": "ok"}}},
    "then": {"required": ["figures", "runs"]},
    "else": {"required": ["reason"]},
}

BASELINE = {
    "type": "object",
    "required": ["name", "kind", "status"],
    "properties": {
        "name": {"type": "string"}, "kind": {"enum": ["transformers", "naive"]},
        "status": {"enum": ["ok", "not applicable"]}, "reason": {"type": "string"},
        "layout": {"type": "string"}, "batch": {"type": "integer"}, "figures": FIGURES,
        "ratios": {"type": "object", "additionalProperties": _NUM},
        "checks": {"type": "object", "required": ["min", "length"]},
    },
    "if": {"properties": {"status": {"const": "ok"}}},
    "then": {"required": ["layout", "batch", "ratios"]},
    "else": {"required": ["reason"]},
}

SUITE = {
    "type": "object",
    "required": ["name", "prompt_len", "new_tokens", "batches", "model", "cells", "baselines"],
    "properties": {
        "name": {"enum": ["dense-latency", "moe-latency", "throughput", "offload-max-batch"]},
        "prompt_len": {"type": "integer", "minimum": 1}, "new_tokens": {"type": "integer", "minimum": 2},
        "batches": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        "model": {"type": "object", "required": ["family", "parameters", "layers", "moe"]},
        "cells": {"type": "array", "items": CELL}, "baselines": {"type": "array", "items": BASELINE},
        "max_batch": {"type": "object"},
    },
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "hpcinfer bench results",
    "type": "object",
    "required": ["schema", "date", "timestamp", "machine", "software", "config", "suites", "not_applicable",
                 "warnings"],
    "properties": {
        "schema": {"const": "hpcinfer-bench/1"},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "machine": {"type": "object", "required": ["cpu_model", "cpus_usable", "gpus", "memory_read"],
                    "properties": {"gpus": {"type": "array", "items": {
                        "type": "object", "required": ["name", "driver"]}},
                        "memory_read": {"type": "object", "required": ["GBps"]}}},
        "software": {"type": "object", "required": ["hpcinfer", "git_commit"]},
        "config": {"type": "object", "required": ["path", "repeats", "layouts", "launcher"]},
        "suites": {"type": "array", "items": SUITE},
        "not_applicable": {"type": "array", "items": {"type": "object", "required": ["name", "reason"]}},
        "warnings": {"type": "array", "items": {"type": "string"}},
    },
}


def validate(result: dict, where: str = "bench results") -> None:
    """Raise InputError naming the first schema violation (its path in the JSON and what was expected)."""
    try:
        import jsonschema
    except ImportError:
        raise ConfigError("checking bench results needs the jsonschema package: pip install -e '.[bench]'") \
            from None
    errors = list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(result))
    if errors:
        e = jsonschema.exceptions.best_match(errors)          # the deepest, most specific problem
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise InputError(f"{where}: {path}: {e.message} ({len(errors)} problem(s) in all)")
