"""The performance model against measurements on this machine, and the papers' scale claims from the model.

    .venv/bin/python -m bench.planner_check --out bench/results    # about 3 minutes, quiet 2-core box

1. Measures this machine as 2 MPI ranks see it (hpcinfer.perf.links.measure_ranks under mpiexec -n 2: per-rank
   matmul rate, memory bandwidth and decode-shaped matmuls' weight bandwidth (gemv_bandwidth) with 1 BLAS
   thread each, ping-pong latency and bandwidth) into
   out/planner-check/hardware.toml, the hardware format `hpcinfer plan --hardware FILE` reads.
2. Writes a GPT-2-small-shaped checkpoint (12 layers, D 768, 12 heads, vocabulary 50257; random weights from the
   preset generator, float32) and runs `hpcinfer run` on it for 1 rank, tp=1/dp=2, tp=2 and pp=2 (one BLAS
   thread per rank, so the ranks do not fight over the 2 cores), `--repeats` times each; the measured per-token
   latency is the median decode step (metrics `decode_step_ms.median`). The same for a small DeepSpeed-MoE model
   (8 layers, D 512, 8 experts on every other layer, top-1, vocabulary 8192; 88M parameters) at 1 rank and ep = 2:
   dp=2 flat, tp=2 flat and tp=2 pcc+hierarchical (`--only dense|moe` runs one half).
3. Predicts the same layouts with hpcinfer.perf.step.predict on the measured hardware and writes both, with the
   error, and the scale claims (PCC, 52B MoE 8 -> 64 GPUs, the trillion-parameter MoE on 256 A100s) to
   <out>/planner-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hpcinfer.arch import tensor_shapes
from hpcinfer.checkpoint.presets import PRESETS, open_preset, write_token_prompts
from hpcinfer.checkpoint.writer import CheckpointWriter
from hpcinfer.offload.profile import PRESETS as HW, load_profile
from hpcinfer.perf.comm_cost import Links, all_to_all, all_to_all_latency_terms
from hpcinfer.perf.layout import Layout, layout_problem
from hpcinfer.perf.memory import rank_memory
from hpcinfer.perf.planner import plan
from hpcinfer.perf.step import Workload, predict

from . import REPO

WORK = REPO / "out" / "planner-check"
# name -> (ranks, tp, pp, all-to-all variant: None for the dense model); an MoE layout has ep = dp tp, expert_tp 1
LAYOUTS = {"1 rank": (1, 1, 1, None), "tp=1 dp=2": (2, 1, 1, None), "tp=2": (2, 2, 1, None),
           "pp=2": (2, 1, 2, None),
           "MoE 1 rank": (1, 1, 1, "flat"), "MoE dp=2 ep=2 flat": (2, 1, 1, "flat"),
           "MoE tp=2 ep=2 flat": (2, 2, 1, "flat"), "MoE tp=2 ep=2 pcc+hierarchical": (2, 2, 1, "pcc+hierarchical")}
BATCH, PROMPT, GEN = 4, 32, 16                                   # per replica


MODELS = {False: "gpt2-124m", True: "moe-small-8"}            # moe -> preset (docs/presets.md)


def _arch(moe: bool = False):
    return PRESETS[MODELS[moe]]


def write_checkpoint(path: Path, moe: bool = False) -> None:
    if path.exists():
        return
    arch = _arch(moe)
    source = open_preset(MODELS[moe])
    with CheckpointWriter(str(path), arch, "float32") as w:
        for name in tensor_shapes(arch):
            w.add(name, source.read(name))


def _python_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_"))}
    env["PYTHONPATH"] = str(REPO)
    return env


def _mpiexec(n: int, args: list[str], timeout: int = 600) -> None:
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(n), sys.executable, *args]
    subprocess.run(cmd, cwd=REPO, env=_python_env(), check=True, timeout=timeout)


def measure_hardware(path: Path) -> None:
    _mpiexec(2, ["-c", "import sys; from mpi4py import MPI; from hpcinfer.perf.links import measure_ranks; "
                       "from hpcinfer.offload.profile import save_profile; "
                       "p = measure_ranks(MPI.COMM_WORLD, sys.argv[1]); "
                       "p is not None and save_profile(p, sys.argv[1] + '/hardware.toml')", str(path.parent)])


def run_layout(name: str, n: int, tp: int, pp: int, all_to_all: str | None, checkpoint: Path) -> dict:
    dp = n // (tp * pp)
    tag = name.replace(" ", "_").replace("=", "").replace("+", "-")
    vocab = _arch(all_to_all is not None).vocab_size
    prompts, metrics = WORK / f"prompts-{dp}-{vocab}.jsonl", WORK / f"metrics-{tag}.json"
    write_token_prompts(str(prompts), BATCH * dp, PROMPT, vocab)
    moe = ""
    if all_to_all is not None:                  # MoE replicas split ONE batch in lockstep: batch_size is all of it
        moe = f'ep = {dp * tp}\nexpert_tp = 1\n\n[moe]\nall_to_all = "{all_to_all}"\n\n'
    batch_size = BATCH * dp if all_to_all is not None else BATCH
    config = WORK / f"{tag}.toml"
    config.write_text(f'[model]\ncheckpoint = "{checkpoint}"\n\n[parallel]\ntp = {tp}\npp = {pp}\n{moe}\n'
                      f'[schedule]\nprompt_micro_batches = {pp}\ngen_micro_batches = {pp}\n\n'
                      f'[runtime]\nbackend = "numpy"\nthreads = 1\n\n'
                      f'[generate]\nprompts = "{prompts}"\noutput = "{WORK / ("out-" + tag + ".jsonl")}"\n'
                      f'max_new_tokens = {GEN}\nbatch_size = {batch_size}\nignore_eos = true\n'
                      f'metrics = "{metrics}"\n')
    for stale in WORK.glob(f"out-{tag}.jsonl*"):                    # a finished output would be resumed, not rerun
        stale.unlink()
    _mpiexec(n, ["-m", "hpcinfer", "run", str(config)])
    return json.loads(metrics.read_text())


def predict_layout(n: int, tp: int, pp: int, all_to_all: str | None, hw) -> dict:
    dp, arch = n // (tp * pp), _arch(all_to_all is not None)
    layout = Layout(tp=tp, pp=pp, dp=dp, prompt_micro_batches=pp, gen_micro_batches=pp, ranks_per_node=n)
    if all_to_all is not None:
        layout = dataclasses.replace(layout, ep=dp * tp, all_to_all=all_to_all)
    assert layout_problem(arch, layout, BATCH) is None
    work = Workload(BATCH * dp, PROMPT, GEN, "float32")
    p = predict(arch, layout, work, hw)
    return {"layout": layout.label(all_to_all is not None), "token_ms": p.token_s * 1e3,
            "prompt_ms": p.prompt_s * 1e3, "compute_ms": p.stage_compute_s * 1e3,
            "comm_ms": p.stage_comm_s * 1e3, "memory_bytes": rank_memory(arch, layout, work)}


def validate(repeats: int, only: str | None = None) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    checkpoints = {False: WORK / "gpt2-124m-random.h5", True: WORK / "ds-moe-88m-random.h5"}
    measure_hardware(WORK / "hardware.toml")
    hw = load_profile(str(WORK / "hardware.toml"))
    rows = {}
    for name, (n, tp, pp, all_to_all) in LAYOUTS.items():
        moe = all_to_all is not None
        if only is not None and moe != (only == "moe"):
            continue
        write_checkpoint(checkpoints[moe], moe)
        runs = [run_layout(name, n, tp, pp, all_to_all, checkpoints[moe]) for _ in range(repeats)]
        measured = statistics.median(r["decode_step_ms"]["median"] for r in runs)
        predicted = predict_layout(n, tp, pp, all_to_all, hw)
        rows[name] = {"ranks": n, "tp": tp, "pp": pp, "all_to_all": all_to_all, "measured_token_ms": measured,
                      "measured_runs_ms": [r["decode_step_ms"]["median"] for r in runs],
                      "weight_GBps_per_rank": statistics.median(r["decode_weight_bandwidth_GBps_per_rank"]
                                                                for r in runs),
                      "predicted": predicted, "error": predicted["token_ms"] / measured - 1.0}
    return {"hardware": hw.to_toml(), "loadavg": os.getloadavg(), "layouts": rows,
            "workload": {"batch_per_replica": BATCH, "prompt_len": PROMPT, "gen_len": GEN, "dtype": "float32"}}


def scale_claims() -> dict:
    """The papers' claims, from the model alone (DGX A100 nodes, float16)."""
    hw = HW["dgx-a100-40gb"]
    links = Links.of(hw)
    pcc = {}
    for kind in ("flat", "hierarchical", "pcc", "pcc+hierarchical"):     # one token a tp group, D = 2048 fp16
        pcc[kind] = {"messages": all_to_all_latency_terms(kind, 128, 8, 8),
                     "us_per_layer": all_to_all(kind, 128, 8, 8, 1 / 128, 2 * 2048, links) * 1e6}
    moe52 = {}
    for gpus in (8, 16, 32, 64):
        best = plan(PRESETS["ds-moe-1.3b-128"], gpus, Workload(8 * gpus, 128, 100, "float16"), hw,
                    "throughput").ranked[0]
        moe52[gpus] = {"layout": best.layout.label(True), "token_ms": best.token_s * 1e3,
                       "tokens_per_s": best.throughput, "per_gpu": best.throughput / gpus}
    trillion = {}
    for batch in (8, 256):
        ranked = plan(PRESETS["ds-moe-24b-128"], 256, Workload(batch, 128, 100, "float16"), hw).ranked
        for label, best in (("best", ranked[0]), ("best pp=1", next(p for p in ranked if p.layout.pp == 1))):
            trillion[f"{batch}, {label}"] = {
                "layout": best.layout.label(True), "token_ms": best.token_s * 1e3,
                "compute_ms": best.stage_compute_s * 1e3, "comm_ms": best.stage_comm_s * 1e3}
    return {"pcc_messages_128_gpus_tp8": pcc, "moe_52b_8_to_64": moe52, "trillion_256_a100": trillion}


def markdown(result: dict) -> str:
    lines = [f"# Planner check, {result['date']}", "", f"Load average during the run: "
             f"{', '.join(f'{x:.2f}' for x in result['validation']['loadavg'])} (2 cores, shared with other jobs)",
             "", "| layout | mesh (ep, expert_tp, all-to-all for MoE) | measured token ms | predicted token ms | error | "
             "predicted compute / comm ms | measured / 1 rank | predicted / 1 rank | achieved weight GB/s a rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = result["validation"]["layouts"]
    for name, row in rows.items():
        p = row["predicted"]
        one = rows["MoE 1 rank" if row.get("all_to_all") else "1 rank"]
        lines.append(f"| {name} | {p.get('layout', '')} | {row['measured_token_ms']:.1f} | {p['token_ms']:.1f} | "
                     f"{row['error']:+.0%} | "
                     f"{p['compute_ms']:.1f} / {p['comm_ms']:.3f} | "
                     f"{row['measured_token_ms'] / one['measured_token_ms']:.2f} | "
                     f"{p['token_ms'] / one['predicted']['token_ms']:.2f} | {row.get('weight_GBps_per_rank', 0):.2f} |")
    if rows:
        hw = result["validation"]["hardware"]
        lines += ["", "Measured hardware (per rank, while both ranks measure):", "", "```", hw.rstrip(), "```"]
    s = result["scale"]
    lines += ["", "## Scale (model only, dgx-a100-40gb, float16)", "",
              "All-to-all of an MoE layer, 128 GPUs, tp = 8, 8 a node, one token a tp group (messages a rank "
              "sends per exchange; dispatch + combine time): " + ", ".join(
                  f"{k} {v['messages']} ({v['us_per_layer']:.0f} us)" for k, v in
                  s["pcc_messages_128_gpus_tp8"].items()), "",
              "| 52B MoE GPUs | best layout (throughput) | token ms | tokens/s | tokens/s per GPU |",
              "|---|---|---|---|---|"]
    for gpus, row in s["moe_52b_8_to_64"].items():
        lines.append(f"| {gpus} | {row['layout']} | {row['token_ms']:.2f} | {row['tokens_per_s']:.4g} | "
                     f"{row['per_gpu']:.4g} |")
    lines += ["", "| 1T MoE, 256 A100: batch, which | layout (latency objective) | token ms | slowest stage compute / "
              "comm ms |", "|---|---|---|---|"]
    for batch, row in s["trillion_256_a100"].items():
        lines.append(f"| {batch} | {row['layout']} | {row['token_ms']:.2f} | {row['compute_ms']:.2f} / "
                     f"{row['comm_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale-only", action="store_true", help="skip the measurements (model numbers only)")
    parser.add_argument("--only", choices=("dense", "moe"), default=None,
                        help="measure only the dense (GPT-2-small) or only the MoE layouts")
    args = parser.parse_args()
    date = _dt.date.today().isoformat()
    result = {"date": date, "scale": scale_claims()}
    result["validation"] = ({"loadavg": os.getloadavg(), "layouts": {}} if args.scale_only
                            else validate(args.repeats, args.only))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"planner-{date}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"planner-{date}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
