"""Results out: JSON Lines in input order, and a metrics JSON, each written atomically (temp file + rename)
so an interrupted job never leaves a partial file."""

from __future__ import annotations

import json
import os


def write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def result_record(prompt_id: str, tokens: list, finish_reason: str, tokenizer) -> dict:
    record = {"id": prompt_id, "output_tokens": tokens}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(tokens)
    record["finish_reason"] = finish_reason
    return record


def write_results(path: str, records: list) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_metrics(path: str, metrics: dict) -> None:
    write_atomic(path, json.dumps(metrics, indent=2) + "\n")
