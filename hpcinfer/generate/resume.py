"""Resumable, preemption-safe output: a fingerprint of what determines the results, a sidecar that stores it
beside the output, and an append-only JSON Lines log committed one finished batch at a time.

- `fingerprint(parts)`: a digest of JSON-able parts, e.g. {"config": config_values(config, exclude),
  "checkpoint": file_identity(path), "prompts": file_digest(path)}. Kept whole in the sidecar, so a mismatch
  names what changed.
- `Sidecar(output)`: `OUTPUT.state.json`; `start(fp, restart)` says whether the output may be resumed (the same
  fingerprint), starts over (no sidecar, or `restart`), or refuses a changed job with a ConfigError.
- `JsonlLog(path)`: `recover()` reads the committed lines (a torn last line is cut off), `append(lines)` writes
  whole lines in one write + flush + fsync, `finalize(lines)` rewrites the file atomically (temp + rename).
Nothing here knows about prompts or models: encoder jobs writing HDF5 reuse `fingerprint` and `Sidecar`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from ..errors import ConfigError
from .output import write_atomic

STATE_VERSION = 1
SIDECAR_SUFFIX = ".state.json"


# ------------------------------------------------------------------------------------------------ fingerprint

def config_values(config, exclude=()) -> dict:
    """{"section.key": value} of every section of a Config (frozen dataclasses), without the keys in `exclude`
    (output paths and runtime-only keys that do not change the results)."""
    values = {}
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for key, value in dataclasses.asdict(section).items():
            name = f"{f.name}.{key}"
            if name not in exclude:
                values[name] = value
    return values


def file_digest(path: str, chunk: int = 1 << 20) -> str:
    """sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def file_identity(path: str) -> dict:
    """A large file's identity without reading it: absolute path, size and modification time."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def fingerprint(parts: dict) -> dict:
    """{"digest": sha256 of the canonical JSON of parts, "parts": parts}."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return {"digest": "sha256:" + hashlib.sha256(text.encode()).hexdigest(), "parts": json.loads(text)}


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two fingerprint parts (nested dicts), e.g. "config.generate.seed: 0 -> 1"."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}" if len(repr(a)) + len(repr(b)) < 160 else f"{prefix}{key}")
    return out


# ---------------------------------------------------------------------------------------------------- sidecar

class Sidecar:
    """`OUTPUT.state.json`: {"version", "fingerprint": {"digest", "parts"}, "complete": bool}."""

    def __init__(self, output: str):
        self.output, self.path = output, output + SIDECAR_SUFFIX

    def read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"resume state '{self.path}' cannot be read ({exc}); re-run with --restart to start "
                              f"over") from None
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "fingerprint" not in state:
            raise ConfigError(f"resume state '{self.path}' is not a version-{STATE_VERSION} hpcinfer state file; "
                              f"re-run with --restart to start over")
        return state

    def write(self, fp: dict, complete: bool = False) -> None:
        write_atomic(self.path, json.dumps({"version": STATE_VERSION, "fingerprint": fp, "complete": complete},
                                           indent=1) + "\n")

    def start(self, fp: dict, restart: bool) -> bool:
        """True: resume the output (same fingerprint). False: start over (nothing to resume, or `restart`).
        A different fingerprint without `restart` is a ConfigError naming what changed."""
        state = None if restart else self.read()
        if state is None:
            return False
        if state["fingerprint"].get("digest") == fp["digest"]:
            return True
        changed = differences(state["fingerprint"].get("parts", {}), fp["parts"])
        shown = "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise ConfigError(f"output '{self.output}' holds results of a different job (changed since: "
                          f"{shown or 'unknown'}); re-run with `hpcinfer run --restart` to start over, or restore "
                          f"the original config, checkpoint and prompts to resume")

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


# ---------------------------------------------------------------------------------------------- the JSONL log

class JsonlLog:
    """An append-only JSON Lines file, committed in whole lines."""

    def __init__(self, path: str):
        self.path = path

    def recover(self) -> list[dict]:
        """The committed records. A torn last line (no newline, or not JSON) is cut off the file; a bad line
        before the last is an error (the file was not written by this log)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1                          # bytes up to the last whole line
        lines = data[:end].splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except ValueError:
                if number < len(lines):
                    raise ConfigError(f"{self.path}:{number}: not a JSON line, so this output cannot be resumed; "
                                      f"re-run with --restart to start over") from None
                end -= len(line) + 1                         # a torn last line: drop it too
        if end < len(data):
            os.truncate(self.path, end)
        return records

    def append(self, records: list[dict]) -> None:
        """Whole lines in one write, then flush and fsync: a kill leaves at most a torn last line."""
        if not records:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            data = text.encode("utf-8")
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def reset(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)

    def finalize(self, records: list[dict]) -> None:
        """Replace the log by exactly `records`, atomically."""
        write_atomic(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
