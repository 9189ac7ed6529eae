"""The markdown report and matplotlib PNG plots of `hpcinfer bench` results, made from the results JSON alone, so
that `hpcinfer bench --report RESULTS.json` regenerates them from a stored file (docs/bench.md)."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import InputError
from .schema import validate

PLOTS = ("latency", "throughput", "bandwidth", "scaling")


NA = "n/a"              # a figure that is null (its reason is listed under the table) or absent (older schema)
OLD_HF_DEVICE = "cpu (not recorded: before schema 2 it ran on the CPU only)"


def _mb(n) -> str:
    return NA if n is None else f"{n / 1e6:.0f}"


def _f(v, fmt: str = ".1f") -> str:
    return NA if v is None else format(v, fmt)


def _pct(v) -> str:
    return NA if v is None else f"{100 * v:.0f}%"


def backends_line(result: dict) -> str:
    """Where hpcinfer's cells and the transformers baseline ran (schema 2 records both; schema 1 neither)."""
    cells = sorted({c["figures"].get("backend") for s in result["suites"] for c in s["cells"]
                    if c["status"] == "ok"} - {None})
    ours = result.get("backend") or "not recorded (schema hpcinfer-bench/1)"
    if cells and cells != [ours]:
        ours += f" (cells: {', '.join(cells)})"
    hf = sorted({b.get("device") or OLD_HF_DEVICE for s in result["suites"] for b in s["baselines"]
                 if b["kind"] == "transformers" and b["status"] == "ok"})
    line = f"hpcinfer backend: {ours}"
    if hf:
        line += f"; transformers baseline device: {', '.join(hf)}"
    return line + "."


def machine_line(result: dict) -> str:
    m, sw = result["machine"], result["software"]
    gpus = "; ".join(f"{g['name']} (driver {g['driver']})" for g in m["gpus"]) or "no GPU"
    return (f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable CPU(s), {gpus}; memory read "
            f"{m['memory_read']['GBps']:.1f} GB/s. {backends_line(result)} hpcinfer {sw['hpcinfer']}, commit "
            f"{sw['git_commit']}. Config `{result['config']['path']}`, {result['config']['repeats']} round(s), "
            f"cells alternated; medians over rounds. Whole run {result.get('elapsed_s', 0):.0f} s.")


CELL_HEADER = ("| layout | ranks pp×dp×tp | batch | variant | backend | prompt (ms) | token median / p90 (ms) | "
               "tokens/s | TFLOP/s per rank | GB/s per rank (of machine) | bubble | device weights / KV (MB per "
               "rank) | host peak (MB per rank) |")
CELL_ALIGN = "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"


def cell_row(c: dict) -> str:
    f, lay = c["figures"], c["layout"]
    mem = f.get("memory", {})
    return (f"| {lay['name']} | {lay['ranks']} = {lay['pp']}×{lay['dp']}×{lay['tp']} | {c['batch']} | {c['variant']} "
            f"| {f.get('backend') or NA} "
            f"| {f['prompt_latency_ms']:.1f} | {f['per_token_ms_median']:.1f} / {f['per_token_ms_p90']:.1f} | "
            f"{f['tokens_per_s']:.1f} | {_f(f.get('tflops_per_rank'), '.3f')} | "
            f"{_f(f.get('bandwidth_GBps_per_rank'))} ({_pct(f.get('bandwidth_utilization'))}) | "
            f"{_pct(f.get('bubble_fraction'))} | {_mb(mem.get('device_weights_bytes_per_rank'))} / "
            f"{_mb(mem.get('device_kv_peak_bytes_per_rank'))}{_device_total(mem)} | "
            f"{_mb(mem.get('host_peak_rss_bytes_per_rank'))} |")


def null_lines(cells: list) -> list[str]:
    """Why the table says n/a: each (figure, reason) of the cells' null_reasons once, with the cells' count."""
    seen = {}
    for c in cells:
        for key, why in (c["figures"].get("null_reasons") or {}).items():
            if key != "memory.device_total_bytes_per_rank":            # shown only where there is one
                seen[key, why] = seen.get((key, why), 0) + 1
    return [f"- n/a `{key}` ({n} cell{'s' if n > 1 else ''}): {why}" for (key, why), n in seen.items()]


def _device_total(mem: dict) -> str:
    """An offloaded cell's whole device footprint (streamed weights + embedding tables + KV cache + ...)."""
    total = mem.get("device_total_bytes_per_rank")
    return "" if total is None else f" (device total {_mb(total)})"


def baseline_lines(suite: dict) -> list[str]:
    ok = [b for b in suite["baselines"] if b["status"] == "ok"]
    lines = []
    if ok:
        lines += ["Against the baselines in the same run (> 1: hpcinfer is better; baseline time / hpcinfer time, "
                  "hpcinfer tokens/s / baseline tokens/s):", "",
                  "| baseline | layout | batch | prompt latency | per-token median | tokens/s | tokens agree |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for b in ok:
            r, ch = b["ratios"], b.get("checks") or {}
            lines.append(f"| {_baseline_name(b)} | {b['layout']} | {b['batch']} | "
                         f"{_f(r.get('prompt_latency_ms'), '.2f')}× | "
                         f"{_f(r.get('per_token_ms_median'), '.2f')}× | {_f(r.get('tokens_per_s'), '.2f')}× | "
                         f"{ch.get('min', '–')}/{ch.get('length', '–')} |")
        lines.append("")
    for note in sorted({b["device_note"] for b in ok if b.get("device_note")}):
        lines.append(f"- **transformers device:** {note}")
    for b in suite["baselines"]:
        if b["status"] != "ok":
            lines.append(f"- {b['name']}: not applicable: {b['reason']}")
    return lines


def _baseline_name(b: dict) -> str:
    """The transformers baseline with its device ("transformers on cpu"); older results did not record it."""
    if b["kind"] != "transformers":
        return b["name"]
    return f"{b['name']} on {b.get('device') or 'cpu'}"


def suite_lines(suite: dict) -> list[str]:
    mod = suite["model"]
    name = mod.get("preset") or mod.get("checkpoint")
    lines = [f"## {suite['name']}", "", f"{suite['about']}. Here: prompt {suite['prompt_len']}, generate "
             f"{suite['new_tokens']}, batches {suite['batches']}; model `{name}` ({mod['family']}, "
             f"{mod['parameters'] / 1e6:.1f}M parameters, {mod['layers']} layers{', MoE' if mod['moe'] else ''}, "
             f"{mod.get('dtype', 'float32')})." + (f" Offload: `{suite['offload']}`." if suite["offload"] else ""), ""]
    if suite.get("skipped"):
        return lines + [f"Not run: {suite['skipped']}.", ""]
    ok = [c for c in suite["cells"] if c["status"] == "ok"]
    if ok:
        lines += [CELL_HEADER, CELL_ALIGN]
        lines += [cell_row(c) for c in ok] + [""]
        nulls = null_lines(ok)
        lines += nulls + ([""] if nulls else [])
    others = [c for c in suite["cells"] if c["status"] != "ok"]
    for c in others:
        lines.append(f"- {c['layout']['name']}, batch {c['batch']}, {c['variant']}: {c['status']}: {c['reason']}")
    if others:
        lines.append("")
    if suite.get("max_batch"):
        lines += ["Largest batch that fits: " + "; ".join(f"{v}: batch {m['batch']} at {m['tokens_per_s']:.1f} "
                                                         f"tokens/s" for v, m in suite["max_batch"].items()), ""]
    return lines + baseline_lines(suite) + [""]


def markdown(result: dict, plots: list[str]) -> str:
    lines = [f"# hpcinfer bench {result['date']}", "", machine_line(result), ""]
    for suite in result["suites"]:
        lines += suite_lines(suite)
    lines += ["## Not measured here", ""] + [f"- {n['name']}: {n['reason']}" for n in result["not_applicable"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines += ["", "prompt = prefill of the whole batch (`prefill_s`); token = one decode step (`decode_step_ms`); "
              "tokens/s = generated tokens / generation time (prompt phase included); TFLOP/s per rank = 2 × matmul "
              "parameters × tokens / ranks / time; GB/s per rank = a rank's matmul weight bytes / median decode "
              "step, and its share of the machine's measured read bandwidth (all ranks of the node together); "
              "bubble = time a pipeline stage waited / generation time; memory: device weights and KV peak per "
              "rank (under offload the device weights are the streamed weights' peak, and the device total is "
              "what the offload budget check counts: resident and streamed weights, embedding tables, KV cache), "
              "host peak resident set per rank; backend = the Ops the cell's job ran on (numpy or cupy). n/a = the "
              "figure does not apply to the cell (the reason is listed under its table) or the results file "
              "predates it. Only ratios within one run count: never compare absolute times across result files."]
    if result["warnings"]:
        lines += [""] + [f"**Warning:** {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


# ---- plots --------------------------------------------------------------------------------------------------------

def _series(suite: dict, key: str) -> dict:
    """{(layout, variant): [(batch, value)]} of the cells that ran, plus the transformers baseline."""
    out = {}
    for c in suite["cells"]:
        if c["status"] == "ok" and c["figures"].get(key) is not None:
            out.setdefault((c["layout"]["name"], c["variant"]), []).append((c["batch"], c["figures"][key]))
    for b in suite["baselines"]:
        if b["kind"] == "transformers" and b["status"] == "ok" and b["figures"].get(key) is not None:
            out.setdefault(("transformers", "baseline"), []).append((b["batch"], b["figures"][key]))
    return out


def _vs_batch(ax, suite: dict, key: str, ylabel: str, scale: float = 1.0) -> None:
    from matplotlib.ticker import NullFormatter

    batches = sorted({b for points in _series(suite, key).values() for b, _ in points})
    for (lay, variant), points in sorted(_series(suite, key).items()):
        xs, ys = zip(*sorted(points))
        label = lay if variant == "hpcinfer" else f"{lay}, {variant}"
        ax.plot(xs, [y * scale for y in ys], marker="o", linestyle="-" if variant == "hpcinfer" else "--",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.set_title(suite["name"])
    ax.legend(fontsize=7)


def scaling_batch(suite: dict) -> tuple[int | None, str]:
    """The batch the scaling plot compares rank counts at: the largest batch that ran (hpcinfer variant) on every
    rank count of the suite, so that each rank count has a bar. When no batch ran on all of them (e.g. 1 rank ran
    only batch 1, 2 ranks only batch 2), the largest batch that ran at all, with a note saying which rank counts
    it leaves out. (None, "") when no hpcinfer cell ran."""
    ok = [c for c in suite["cells"] if c["status"] == "ok" and c["variant"] == "hpcinfer"]
    if not ok:
        return None, ""
    by_ranks = {}
    for c in ok:
        by_ranks.setdefault(c["layout"]["ranks"], set()).add(c["batch"])
    common = set.intersection(*by_ranks.values())
    if common:
        return max(common), ""
    batch = max(c["batch"] for c in ok)
    missing = sorted(r for r, batches in by_ranks.items() if batch not in batches)
    return batch, f"no batch ran on every rank count; {', '.join(map(str, missing))} rank(s) missing"


def _scaling(ax, suite: dict) -> None:
    """tokens/s per layout (ordered by ranks) at the suite's largest batch that ran on every rank count
    (scaling_batch)."""
    batch, note = scaling_batch(suite)
    if batch is None:
        return
    ok = [c for c in suite["cells"] if c["status"] == "ok" and c["variant"] == "hpcinfer"]
    cells = sorted((c for c in ok if c["batch"] == batch), key=lambda c: (c["layout"]["ranks"], c["layout"]["name"]))
    ax.bar([f"{c['layout']['name']}\n({c['layout']['ranks']} rank{'s' if c['layout']['ranks'] > 1 else ''})"
            for c in cells],
           [c["figures"]["tokens_per_s"] for c in cells])
    ax.set_ylabel("tokens/s")
    if note:
        ax.set_title(f"{suite['name']}, batch {batch}\n({note})", fontsize=9)
    else:
        ax.set_title(f"{suite['name']}, batch {batch}")
    ax.tick_params(axis="x", labelsize=7)


def plots(result: dict, stem: Path) -> list[str]:
    """latency vs batch, throughput vs batch, bandwidth utilization vs batch, scaling with ranks: one PNG each,
    one panel per suite that ran. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = [s for s in result["suites"] if any(c["status"] == "ok" for c in s["cells"])]
    if not suites:
        return []
    draw = {"latency": lambda ax, s: _vs_batch(ax, s, "per_token_ms_median", "per-token latency, median (ms)"),
            "throughput": lambda ax, s: _vs_batch(ax, s, "tokens_per_s", "generated tokens/s"),
            "bandwidth": lambda ax, s: _vs_batch(ax, s, "bandwidth_utilization",
                                                 "decode weight GB/s / machine read GB/s (%)", 100.0),
            "scaling": _scaling}
    written = []
    for name in PLOTS:
        fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 4), squeeze=False)
        for ax, suite in zip(axes[0], suites):
            draw[name](ax, suite)
        fig.suptitle(f"hpcinfer bench {result['date']}: {name}")
        fig.tight_layout()
        path = Path(f"{stem}-{name}.png")
        fig.savefig(path, dpi=90, bbox_inches="tight")           # keep the y labels whole
        plt.close(fig)
        written.append(str(path))
    return written


def write_report(result: dict, stem: Path) -> tuple[Path, list[str]]:
    """`<stem>.md` and its PNGs beside it; returns the markdown path and the plots."""
    validate(result, f"{stem}.json")
    names = plots(result, stem)
    path = Path(f"{stem}.md")
    path.write_text(markdown(result, names))
    return path, names


def report_from_file(results_json: str) -> tuple[Path, list[str]]:
    """Regenerate the report and plots beside a stored results file."""
    try:
        result = json.loads(Path(results_json).read_text())
    except FileNotFoundError:
        raise InputError(f"bench results '{results_json}' do not exist") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"bench results '{results_json}' are not JSON: {exc}") from None
    stem = Path(results_json).with_suffix("")
    return write_report(result, stem)
