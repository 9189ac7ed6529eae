"""The results tail every benchmark script ends with: `<out>/<name>-<date>.json` (the whole result) and `.md`
(the report)."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: str | Path, name: str, result: dict, markdown: str, log=None) -> Path:
    """`<out>/<name>-<date>.json` (the whole result) and `.md` (the report); prints the report, logs the paths
    and every warning in result["warnings"]. Returns the stem."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}-{result['date']}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    Path(f"{stem}.md").write_text(markdown)
    print(markdown)
    if log is not None:
        elapsed = result.get("elapsed_s")
        log(f"wrote {stem}.json and {stem}.md" + (f" in {elapsed:.0f} s" if elapsed is not None else ""))
        for w in result.get("warnings") or []:
            log(f"warning: {w}")
    return stem
