"""`hpcinfer plan --gpus N`: resolve the arguments, search, and print the result as one TOML document.

A layout over the memory that the runtime runs with `[offload]` is planned with offload (perf/offload.py): the
table marks it and, when it is the best, the `[offload]` and `[generate]` sections are printed too. With one GPU
and nothing that fits even so, the plan is FlexGen's offload policy for that GPU (offload/lp.py) instead.

Everything but the best layout's sections is a comment, so the whole output parses as TOML (`tomllib.loads`)
and can be pasted into a job config.
"""

from __future__ import annotations

from ..arch import tensor_shapes
from ..config import parse_bytes
from ..errors import ConfigError
from ..offload.lp import search_policy
from ..offload.planning import planned_kv_format, planned_quant_of
from ..offload.policy import human_bytes
from ..offload.profile import resolve_profile
from .layout import Layout
from .memory import weight_bytes
from .planner import OBJECTIVES, PlanResult, plan
from .step import Workload

DEFAULT_HARDWARE = "dgx-a100-40gb"


# Options of `hpcinfer plan` that only the offload planner (no --gpus) reads, with their argparse defaults: the
# layout planner's offloaded layouts use the zig-zag schedule, one layer of prefetch, no CPU attention and no
# --fix (perf/offload.py), so given with --gpus they would be silently ignored. --host-memory and --disk-memory
# are read (a node's capacities, shared by its ranks), --disk-dir too (the printed disk_dir).
OFFLOAD_ONLY = {"schedule": "zigzag", "prefetch_layers": None, "cpu_attention": "auto", "fix": [],
                "max_latency": None, "candidates": 10, "backend": "auto"}
_INSTEAD = {"max_latency": " (with --gpus: --latency-budget MS)", "candidates": " (with --gpus: --top K)"}


def _check_args(args) -> None:
    for name, default in OFFLOAD_ONLY.items():
        if getattr(args, name, default) != default:
            raise ConfigError(f"--{name.replace('_', '-')} is an offload planner option (`hpcinfer plan` without "
                              f"--gpus, docs/offload-planning.md); the layout planner (--gpus) plans its offloaded "
                              f"layouts with the zig-zag schedule, the profile's default prefetch and no CPU "
                              f"attention, and does not read it{_INSTEAD.get(name, '')}: remove it")
    for name in ("gpus", "batch", "prompt_len", "gen_len"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.latency_budget is not None and not args.latency_budget > 0:
        raise ConfigError(f"--latency-budget must be > 0 milliseconds, got {args.latency_budget:g}")
    if args.objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {args.objective!r}")


def resolve_hardware(args, gpu_memory: int | None):
    """The HardwareProfile named by --hardware (or --profile), with the memory per GPU replaced when given, and a
    node's host memory and disk (--host-memory, --disk-memory)."""
    hw = resolve_profile(args.hardware or args.profile or DEFAULT_HARDWARE).with_budgets(
        device_memory=gpu_memory, host_memory=_size(args, "host_memory"), disk_memory=_size(args, "disk_memory"))
    if args.gpus > hw.gpus_per_node and args.gpus % hw.gpus_per_node:
        raise ConfigError(f"--gpus {args.gpus} is not a whole number of nodes of {hw.gpus_per_node} GPUs "
                          f"({hw.name}: gpus_per_node = {hw.gpus_per_node})")
    return hw


def _size(args, name: str) -> int | None:
    value = getattr(args, name, None)
    if value is None:
        return None
    try:
        result = parse_bytes(str(value).strip())
    except ValueError:
        result = -1
    if result < 0:
        raise ConfigError(f"--{name.replace('_', '-')} {value!r} is not a number of bytes nor a size such as "
                          f"\"16GB\"")
    return result


def _disk_dir(args) -> str:
    """Where an offloaded best layout's disk tier goes (--disk-dir, default the system temp dir)."""
    import tempfile

    return getattr(args, "disk_dir", None) or tempfile.gettempdir()


def plan_layouts(args, arch, dtype: str, gpu_memory: int | None) -> int:
    """Search and print (the argparse namespace of `hpcinfer plan`; arch and dtype resolved from --model)."""
    _check_args(args)
    hw = resolve_hardware(args, gpu_memory)
    quant_of, kv = quantization(args, arch)
    work = Workload(args.batch, args.prompt_len, args.gen_len, dtype, quant_of, kv)
    budget = None if args.latency_budget is None else args.latency_budget / 1e3
    result = plan(arch, args.gpus, work, hw, args.objective, budget)
    held = weight_bytes(arch, Layout(1, 1, 1), range(arch.num_layers), True, True, work)
    header = [f"# hpcinfer plan: {args.model} ({arch.param_count() / 1e9:.3g}B parameters, {dtype}"
              f"{_quant_label(args, quant_of, kv)}: {human_bytes(held)}) on {args.gpus} GPUs of {hw.name} "
              f"({human_bytes(hw.device_memory)} each, {hw.gpus_per_node} a node)",
              f"# workload: batch {work.batch} (over the dp replicas), prompt {work.prompt_len}, generate "
              f"{work.gen_len}; objective {args.objective}"
              + (f", per-token latency <= {args.latency_budget:g} ms" if budget else ""),
              f"# layouts: {result.considered} valid, {result.too_big} over the memory, {result.too_slow} over the "
              f"latency budget, {len(result.ranked)} kept"
              + (f" ({result.offloaded} more over the memory, planned with offload: weights or KV cache in host "
                 f"memory or on disk, {human_bytes(hw.host_memory)} of host memory a node)" if result.offloaded
                 else "")]
    if not result.ranked:
        print("\n".join(header))
        if args.gpus == 1 and result.considered and result.too_big == result.considered:
            return _offload_fallback(args, arch, work, hw)
        raise ConfigError(_nothing_fits(args, result, hw))
    print("\n".join(header + [""] + table(result, bool(arch.moe_experts), args.top) + [""]
                    + best_toml(result, arch, work, _disk_dir(args))))
    return 0


def quantization(args, arch) -> tuple:
    """(quant_of, kv_format) of `--quantize` / `--kv-cache` (and their groups) as the offload planner reads them
    (offload.planning: a quantized checkpoint counts as stored), quant_of None when no weight is quantized. The
    same helpers as the offload planner's, so that both planners agree on what is quantized."""
    quant_of = planned_quant_of(args.model, arch, args.quantize, args.quantize_group)
    if not any(quant_of(name) for name in tensor_shapes(arch)):
        quant_of = None
    return quant_of, planned_kv_format(args.kv_cache, args.kv_cache_group, arch.head_dim)


def _quant_label(args, quant_of, kv) -> str:
    text = ""
    if quant_of is not None:
        text += f", weights {args.quantize if args.quantize != 'none' else 'as stored'} (quantized)"
    if kv is not None:
        text += f", KV cache {kv.mode} (group {kv.group})"
    return text


def _offload_fallback(args, arch, work: Workload, hw) -> int:
    """One GPU and nothing fits: FlexGen's offload policy search (offload/lp.py) on the same machine."""
    policy, pred, _ = search_policy(arch, work.prompt_len, work.gen_len, hw, dtype=work.dtype,
                                    quant_of=work.quant_of, kv_format=work.kv_format)
    print(f"# nothing fits in {human_bytes(hw.device_memory)}: offloading (FlexGen's policy search, "
          f"docs/offload-planning.md) predicts {pred.throughput:.4g} tokens/s, a block of {policy.block_size} "
          f"sequences in {pred.latency_s:.4g} s; bottleneck {pred.bottleneck}")
    print(policy.to_toml_section(hw.device_memory, hw.host_memory).rstrip("\n"))
    return 0


def _nothing_fits(args, result: PlanResult, hw) -> str:
    if result.considered == 0:
        return f"no valid layout of {args.gpus} GPUs for {args.model} (see docs/planner.md for what is searched)"
    if result.too_big == result.considered:
        return (f"no layout of {args.gpus} GPUs fits {args.model} in {human_bytes(hw.device_memory)} a GPU: the "
                f"leanest needs {human_bytes(result.smallest_memory)}, and no pp = 1 layout fits with offload "
                f"(weights and KV cache in {human_bytes(hw.host_memory)} of host memory a node); add GPUs, lower "
                f"--batch, raise --host-memory, or plan offloading with `hpcinfer plan --model {args.model} "
                f"--profile ...` (without --gpus: any block size)")
    return (f"no fitting layout meets --latency-budget {args.latency_budget:g} ms: the fastest takes "
            f"{result.fastest_s * 1e3:.3g} ms a token")


def table(result: PlanResult, moe: bool, top: int) -> list[str]:
    rows = [f"# the {min(top, len(result.ranked))} best (token = time between two tokens of a sequence; "
            f"prompt = the batch's prompt phase; tokens/s over prompt + generation; offload: weights on "
            f"device/host/disk %, kv: KV cache device/host %, pfN: partitioned fetch over N replicas):",
            f"# {'rank':>4}  {'layout':<44} {'token ms':>9} {'prompt ms':>10} {'tokens/s':>10} {'bubble':>6} "
            f"{'mem/GPU':>10}  offload"]
    for i, p in enumerate(result.ranked[:max(top, 0)], 1):
        rows.append(f"# {i:>4}  {p.layout.label(moe):<44} {p.token_s * 1e3:>9.3g} {p.prompt_s * 1e3:>10.4g} "
                    f"{p.throughput:>10.4g} {p.bubble:>6.2f} {human_bytes(p.memory):>10}  "
                    f"{p.offload.label() if p.offload else '-'}")
    return rows


def best_toml(result: PlanResult, arch, work: Workload, disk_dir: str | None = None) -> list[str]:
    p = result.ranked[0]
    moe = bool(arch.moe_experts)
    comm_share = p.stage_comm_s / (p.stage_comm_s + p.stage_compute_s) if p.stage_comm_s else 0.0
    lines = [f"# best: {p.layout.label(moe)}: token {p.token_s * 1e3:.3g} ms "
             f"({comm_share:.0%} communication), prompt {p.prompt_s * 1e3:.4g} ms, "
             f"{p.throughput:.4g} tokens/s, {human_bytes(p.memory)} a GPU"]
    if p.offload is None:
        return lines + [p.layout.to_toml(moe, work.batch).rstrip("\n")]
    off = p.offload
    link = " + ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in off.token_transfer_s.items() if seconds)
    lines += [f"# offloading: {human_bytes(off.streamed_bytes)} of layers streamed a token step per rank "
              f"({human_bytes(off.streamed_bytes / off.fetch_share)} over its host link"
              + (f", all-gathered over {off.fetch_share} replicas in {off.gather_s * 1e3:.3g} ms" if off.fetch_share
                 > 1 else "") + f"); transfers a token step: {link or 'none'}, "
              f"{'overlapped with' if off.overlap else 'added to'} compute; peak per rank: device "
              f"{human_bytes(off.peak['device'])}, host {human_bytes(off.peak['host'])}, disk "
              f"{human_bytes(off.peak['disk'])}"]
    sections = p.layout.to_toml(moe, work.batch)
    sections = sections[:sections.index("\n# [generate]")]                   # [generate] is printed for real below
    return lines + [sections.rstrip("\n"), "", off.to_toml(arch.num_layers, work.gen_len, disk_dir).rstrip("\n")]
