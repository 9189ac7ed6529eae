"""Command line: `hpcinfer run | convert | inspect | profile | plan | bench` (also `python -m hpcinfer ...`).

The arguments and the dispatch; what each command does lives in its layer: runtime.main_run, checkpoint/convert.py,
offload/ (the profile, the offload planner and its report), perf/ (links measured under mpiexec, the layout
planner), bench/suites/main.py."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time

from .backend.ops import make_ops
from .bench.suites.main import main_bench
from .checkpoint.convert import convert
from .checkpoint.format import describe, open_checkpoint
from .checkpoint.presets import PRESETS
from .comm.mpi_library import load_mpi
from .config import parse_bytes
from .errors import ConfigError, HpcinferError
from .offload import report as offload_report
from .offload.planning import planned_model
from .offload.profile import measure, resolve_profile, save_profile
from .offload.profile_gpu import with_gpu
from .perf.links import measure_ranks, with_link_defaults_noted, with_mpiexec_noted
from .perf.report import plan_layouts
from .quant.formats import DEFAULT_EMBEDDING, EMBEDDINGS, LOAD_MODES
from .runtime import main_run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcinfer", description="MPI-launched SPMD transformer inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a generation job (under mpiexec -n N, or alone)")
    run.add_argument("config", help="job config (TOML); see docs/config.md")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value (repeatable), e.g. --set generate.max_new_tokens=64")
    run.add_argument("--restart", action="store_true", help="start over: discard the results an earlier run of "
                     "this output left, even of a different config or prompt file (docs/reliability.md)")
    convert = sub.add_parser("convert", help="convert a Hugging Face folder or a .gguf file to an hpcinfer "
                                             "HDF5 checkpoint")
    convert.add_argument("source", help="Hugging Face model folder (config.json + safetensors/bin) or .gguf file")
    convert.add_argument("output", help="output .h5 file")
    convert.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                         help="storage dtype (default float32)")
    convert.add_argument("--quantize", default="none", choices=LOAD_MODES,
                         help="store the matrices quantized: int8 (symmetric per output channel), int4 / asym8 "
                              "(group-wise asymmetric 4 / 8 bits) (docs/quantization.md; default none)")
    convert.add_argument("--group-size", type=int, default=None, help="int4 / asym8 group size along the input "
                         "dimension (default: the source's block grid, 32 for a GGUF's Q4_0 / Q4_1 / Q8_0 "
                         "tensors, whose blocks are then kept where they have the target's bits; else 64)")
    convert.add_argument("--quantize-embedding", default=DEFAULT_EMBEDDING, choices=EMBEDDINGS,
                         help="with --quantize int4: the token embedding and LM head at 8 bits (int8, the default: "
                              "int8 per row, or a GGUF's Q8_0 blocks kept) or int4 like the other matrices (same)")
    convert.add_argument("--keep-quantized", action="store_true",
                         help="GGUF: keep Q4_1 / Q8_0 matrices as they are instead of dequantizing them")
    inspect = sub.add_parser("inspect", help="print a checkpoint's architecture and tensors, and check it")
    inspect.add_argument("checkpoint")
    inspect.add_argument("--verify", action="store_true", help="also check every tensor's CRC-32 and the metadata "
                         "manifest (docs/checkpoint-format.md); exit 2 on any damage")
    _offload_parsers(sub)
    _bench_parser(sub)
    return parser


def _bench_parser(sub) -> None:
    """`bench` (docs/bench.md)."""
    bench = sub.add_parser("bench", help="run the benchmark suites of a bench config (docs/bench.md), or "
                                         "regenerate a report from stored results")
    bench.add_argument("config", nargs="?", help="bench config (TOML), e.g. inputs/bench-cpu.toml")
    bench.add_argument("--suite", action="append", default=[], metavar="NAME",
                       help="run only this suite (repeatable): dense-latency, moe-latency, throughput, "
                            "offload-max-batch")
    bench.add_argument("--out", default="bench/results", help="folder for the results (default bench/results)")
    bench.add_argument("--report", metavar="RESULTS.json", help="regenerate the markdown report and plots of a "
                                                                "stored results file, beside it")
    bench.add_argument("--keep", action="store_true", help="keep the jobs' configs, outputs and logs")


def _offload_parsers(sub) -> None:
    """`profile` and `plan` (docs/offload-planning.md)."""
    profile = sub.add_parser("profile", help="measure this machine's tier bandwidths and matmul rates (TOML)")
    profile.add_argument("--out", help="write the profile here (default: print it)")
    profile.add_argument("--disk-dir", default=None,
                         help="directory the disk tier lives in, measured with a temp file (default: the "
                              "system temp dir)")
    profile.add_argument("--size", default="256MiB", help="bytes moved per measurement (default 256MiB)")
    plan = sub.add_parser("plan", help="search FlexGen's offloading policy for a model on a machine and print it "
                                       "as an [offload] section")
    plan.add_argument("--model", required=True, help="a preset name (docs/presets.md) or an hpcinfer checkpoint")
    plan.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence (default 512)")
    plan.add_argument("--gen-len", type=int, default=32, help="generated tokens per sequence (default 32)")
    plan.add_argument("--max-latency", type=float, default=None, metavar="S",
                      help="seconds a block may take at most (default: no limit)")
    plan.add_argument("--profile", default=None, metavar="FILE|PRESET",
                      help="hardware profile: a file from `hpcinfer profile` or a preset (t4-16gb, "
                           "a100-40gb-pcie4, h100-80gb); default: measure this machine")
    plan.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                      help="weight dtype (default: the checkpoint's; for a preset float32, or float16 with --gpus); "
                           "the offload plan counts the KV cache at float32, as the runtime allocates it")
    plan.add_argument("--quantize", default="none", choices=LOAD_MODES,
                      help="plan for weights quantized at load ([model] quantize; a quantized checkpoint is "
                           "counted as stored): the quantized bytes are what moves")
    plan.add_argument("--quantize-group", type=int, default=64, help="int4 / asym8 group size (default 64)")
    plan.add_argument("--kv-cache", default="none", choices=["none", "int8", "int4"],
                      help="plan for a quantized KV cache ([model] kv_cache): its bytes are what the cache holds "
                           "and moves")
    plan.add_argument("--kv-cache-group", type=int, default=64, help="KV cache group size (default 64)")
    plan.add_argument("--schedule", default="zigzag", choices=["zigzag", "row"],
                      help="zigzag (FlexGen's block schedule, default) or row (ZeRO-Inference)")
    plan.add_argument("--prefetch-layers", type=int, default=None,
                      help="layers fetched ahead; 0 = no overlap (default: 1 when the profile's transfers overlap "
                           "the compute, as on a GPU; 0 on a profile measured by the NumPy backend, where they "
                           "share the cores)")
    plan.add_argument("--cpu-attention", default="auto", choices=["auto", "on", "off"],
                      help="decode attention on the host for host-resident cache (default: whichever is faster)")
    plan.add_argument("--fix", action="append", default=[], metavar="KEY=PERCENT",
                      help="hold one placement percentage (repeatable), e.g. --fix cache_gpu=100 --fix act_gpu=100 "
                           "(ZeRO-Inference's placement); the LP places the rest")
    plan.add_argument("--candidates", type=int, default=10, help="rows of the candidates table (default 10)")
    plan.add_argument("--disk-dir", default=None, help="directory of the disk tier: printed as [offload] disk_dir "
                      "when the plan puts weights on disk, and measured when there is no --profile (default: the "
                      "system temp dir)")
    _layout_plan_arguments(plan)
    for parser in (profile, plan):
        parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                            help="measure the device as this backend sees it: cupy measures the GPU's link from "
                                 "pinned memory, its matmul and memory (auto: cupy when a GPU is visible)")
        for tier in ("device", "host", "disk"):
            parser.add_argument(f"--{tier}-memory", default=None, metavar="BYTES",
                                help=f'{tier} tier capacity: bytes, or a size such as "16GB" or "2GiB"')


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return main_run(args.config, args.overrides, args.restart)     # errors after MPI loads: its own
        if args.command == "convert":
            return _convert(args.source, args.output, args.dtype, args.quantize, args.group_size,
                            args.keep_quantized, args.quantize_embedding)
        if args.command == "profile":
            return _profile(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "bench":
            return main_bench(args.config, args.suite, args.out, args.report, args.keep)
        return _inspect(args.checkpoint, args.verify)
    except HpcinferError as exc:
        print(f"hpcinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _convert(source: str, output: str, dtype: str, quantize: str = "none", group_size: int | None = None,
             keep_quantized: bool = False, embedding: str = DEFAULT_EMBEDDING) -> int:
    t0 = time.perf_counter()
    with _log_lines_on_stderr():                     # the converter's log lines: its group choice, its warnings
        arch = convert(source, output, dtype, quantize, group_size, keep_quantized, embedding)
    print(f"hpcinfer: converted {source} -> {output} ({arch.family}, {arch.num_layers} layers, "
          f"{arch.param_count():,} parameters, {dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


class _CommandFormatter(logging.Formatter):
    def format(self, record) -> str:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"hpcinfer: {level}{record.getMessage()}"


@contextlib.contextmanager
def _log_lines_on_stderr():
    """The "hpcinfer" logger's info lines and warnings on stderr, as `hpcinfer: ...` lines, while a command runs
    outside an MPI job (whose ranks log through logs.setup_logging)."""
    logger = logging.getLogger("hpcinfer")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandFormatter())
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _inspect(path: str, verify: bool = False) -> int:
    with open_checkpoint(path) as ckpt:
        print(describe(ckpt), flush=True)
        if verify:
            t0 = time.perf_counter()
            done = ckpt.verify()
            seconds = time.perf_counter() - t0
            print(f"verify: OK ({done['datasets']} datasets, {done['bytes']:,} bytes, crc32 and metadata manifest "
                  f"match, {seconds:.2f} s, {done['bytes'] / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
    return 0


def _bytes_option(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        result = parse_bytes(value.strip())
    except (ValueError, AttributeError):
        raise ConfigError(f"--{name} {value!r} is not a number of bytes nor a size such as \"16GB\"") from None
    if result < 0:
        raise ConfigError(f"--{name} {value!r} must be >= 0")
    return result


def _budgets(args) -> dict:
    return {f"{tier}_memory": _bytes_option(f"{tier}-memory", getattr(args, f"{tier}_memory"))
            for tier in ("device", "host", "disk")}


def _disk_dir(args) -> str:
    disk_dir = getattr(args, "disk_dir", None) or tempfile.gettempdir()
    if not os.path.isdir(disk_dir):
        raise ConfigError(f"--disk-dir '{disk_dir}' is not a directory")
    return disk_dir


def _measure(args):
    """(profile, ops): this process's profile (offload/profile.measure, with the GPU's figures on cupy:
    offload/profile_gpu.with_gpu) and the Ops it measured with."""
    disk_dir = _disk_dir(args)
    size = _bytes_option("size", getattr(args, "size", "256MiB"))
    ops = make_ops(getattr(args, "backend", "auto"), 0)
    try:
        profile = measure(disk_dir, size=size, **_budgets(args))
    except OSError as exc:
        raise ConfigError(f"cannot measure the disk under '{disk_dir}': {exc.strerror or exc}") from None
    if ops.name != "cupy":
        return profile, ops
    return with_gpu(profile, ops.xp, size, _budgets(args).get("device_memory")), ops   # overlap = True: a GPU


def _profile(args) -> int:
    t0 = time.perf_counter()
    comm = _mpi_world()
    profile = _measure_ranks(args, comm) if comm is not None else with_link_defaults_noted(*_measure(args))
    if profile is None:                                  # ranks other than 0 of an mpiexec run: rank 0 writes
        return 0
    if args.out is None:
        sys.stdout.write(profile.to_toml())
        return 0
    try:
        save_profile(profile, args.out)
    except OSError as exc:
        raise ConfigError(f"cannot write the profile to '{args.out}': {exc.strerror or exc}") from None
    print(f"hpcinfer: wrote {args.out} in {time.perf_counter() - t0:.1f} s: {profile.summary()}")
    if profile.notes:
        print(f"hpcinfer: note: {profile.notes}")
    return 0


def _mpi_world():
    """MPI.COMM_WORLD when this process runs under mpiexec with >= 2 ranks, else None (a 1-process run; also when
    mpi4py is missing or finds no MPI library, said on stderr: the profile of one process needs no MPI)."""
    try:
        MPI = load_mpi()
    except ConfigError as exc:
        print(f"hpcinfer: warning: profiling this process alone: {exc}", file=sys.stderr)
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.size >= 2 else None


def _measure_ranks(args, comm):
    """The profile of one rank of this node, measured by every rank of an mpiexec run at once, with the links
    measured by MPI ping-pong (perf/links.measure_ranks); rank 0 returns it, the other ranks None."""
    disk_dir = _disk_dir(args)
    size = _bytes_option("size", getattr(args, "size", "256MiB"))
    ops = make_ops(getattr(args, "backend", "auto"), comm.rank)
    if ops.name == "cupy":
        raise ConfigError("profile under mpiexec measures CPU ranks (the NumPy backend) only: run "
                          "`hpcinfer profile --backend cupy` in one process for the GPU's figures")
    try:
        profile = measure_ranks(comm, disk_dir, size=size)
    except OSError as exc:
        raise ConfigError(f"cannot measure the disk under '{disk_dir}': {exc.strerror or exc}") from None
    if profile is None:
        return None
    return with_mpiexec_noted(profile, comm.size, _budgets(args))


def _layout_plan_arguments(plan) -> None:
    """`plan --gpus N`: the parallel layout planner (docs/planner.md); without --gpus, plan is the offload LP."""
    plan.add_argument("--gpus", type=int, default=None, help="plan the parallel layout for N GPUs (ranks) "
                      "instead of an offloading policy (docs/planner.md)")
    plan.add_argument("--hardware", default=None, metavar="PRESET|FILE", help="with --gpus: the machine "
                      "(dgx-a100-40gb (default), dgx-h100-80gb, or a file from `hpcinfer profile`)")
    plan.add_argument("--gpu-memory", default=None, metavar="BYTES", help="with --gpus: memory per GPU, e.g. 40GB")
    plan.add_argument("--batch", type=int, default=8, help="with --gpus: sequences in flight, over all replicas "
                      "(default 8)")
    plan.add_argument("--latency-budget", type=float, default=None, metavar="MS",
                      help="with --gpus: keep layouts whose per-token latency is at most MS milliseconds")
    plan.add_argument("--objective", default="latency", choices=["latency", "throughput"],
                      help="with --gpus: rank by per-token latency (default) or by tokens/s")
    plan.add_argument("--top", type=int, default=10, help="with --gpus: rows of the layout table (default 10)")


def _plan(args) -> int:
    if args.gpus is not None:
        arch, stored_dtype = planned_model(args.model)
        memory = _bytes_option("gpu-memory", args.gpu_memory) or _bytes_option("device-memory", args.device_memory)
        return plan_layouts(args, arch, args.dtype or ("float16" if args.model in PRESETS else stored_dtype), memory)
    offload_report.check_args(args)
    arch, stored_dtype = planned_model(args.model)
    dtype = args.dtype or stored_dtype
    if args.profile is None:
        print("hpcinfer: no --profile: measuring this machine (hpcinfer profile --out FILE keeps it)",
              file=sys.stderr)
        profile = _measure(args)[0]
    else:
        profile = resolve_profile(args.profile).with_budgets(**_budgets(args))
    plan = offload_report.search(args, arch, dtype, profile)
    print(offload_report.plan_text(args, arch, dtype, profile, plan, _disk_dir(args)))
    return 0
