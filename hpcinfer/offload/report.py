"""`hpcinfer plan` without --gpus: check the workload options, search FlexGen's offloading policy (offload/lp.py) and
print it as an `[offload]` section, with the prediction above it and the fastest candidates below as comments.
perf/report.py is its twin for the layout planner (`hpcinfer plan --gpus N`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError
from .cost_model import TIERS, ModelSizes
from .lp import search_policy
from .planning import planned_kv_format, planned_quant_of
from .policy import human_bytes
from .profile import PRESETS


@dataclass(frozen=True)
class OffloadPlan:
    """What the search found for a model, a workload and a machine."""

    policy: object              # the best Policy
    best: object                # its Prediction
    candidates: list            # [(Policy, Prediction)] of the feasible block shapes, fastest first
    quant_of: object            # tensor name -> (mode, group) of the weights held quantized, or None
    kv_format: object           # quant.kv.KVFormat of a quantized KV cache, or None


def check_args(args) -> None:
    """The workload options of `plan` (without --gpus), before the model is read."""
    for name in ("prompt_len", "gen_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_latency is not None and not args.max_latency > 0:
        raise ConfigError(f"--max-latency must be > 0 seconds, got {args.max_latency:g}")
    if args.prefetch_layers is not None and args.prefetch_layers < 0:
        raise ConfigError(f"--prefetch-layers must be >= 0, got {args.prefetch_layers}")


def search(args, arch, dtype: str, profile) -> OffloadPlan:
    """The best policy for `args`' workload on `profile` (arch, dtype: --model's, resolved by the caller)."""
    cpu = {"auto": None, "on": True, "off": False}[args.cpu_attention]
    fixed = fixed_percentages(args.fix)
    quant_of = planned_quant_of(args.model, arch, args.quantize, args.quantize_group)
    kv = planned_kv_format(args.kv_cache, args.kv_cache_group, arch.head_dim)
    try:
        policy, best, candidates = search_policy(arch, args.prompt_len, args.gen_len, profile, args.max_latency,
                                                 cpu_attention=cpu, schedule=args.schedule,
                                                 prefetch_layers=args.prefetch_layers, dtype=dtype, fixed=fixed,
                                                 quant_of=quant_of, kv_format=kv)
    except ValueError as exc:
        raise ConfigError(f"--fix: {exc}") from None
    return OffloadPlan(policy, best, candidates, quant_of, kv)


def fixed_percentages(items: list[str]) -> dict:
    """`--fix KEY=PERCENT` (repeatable) -> {key: percent}."""
    fixed = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            fixed[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"--fix {item!r}: expected KEY=PERCENT, e.g. --fix cache_gpu=100")
    _check_fixed_sums(fixed)
    return fixed


def _check_fixed_sums(fixed: dict) -> None:
    """The gpu / cpu / disk percentages of weights, cache and activations each sum to 100: fixed ones may not
    sum to more, and all three fixed must sum to exactly 100."""
    for what in ("weights", "cache", "act"):
        keys = [f"{what}_{tier}" for tier in ("gpu", "cpu", "disk") if f"{what}_{tier}" in fixed]
        total = sum(fixed[k] for k in keys)
        named = " + ".join(f"{k}={fixed[k]:g}" for k in keys)
        if total > 100 + 1e-9:
            raise ConfigError(f"--fix {named} = {total:g}: the {what}_gpu / {what}_cpu / {what}_disk percentages "
                              f"must sum to 100, so the fixed ones cannot sum to more")
        if len(keys) == 3 and abs(total - 100) > 1e-9:
            raise ConfigError(f"--fix {named} = {total:g}: the three percentages must sum to 100")


def plan_text(args, arch, dtype: str, profile, plan: OffloadPlan, disk_dir: str) -> str:
    """The plan as `hpcinfer plan` prints it: a TOML document whose only non-comment lines are the policy's
    `[offload]` and `[generate]` sections."""
    policy, best, kv_format = plan.policy, plan.best, plan.kv_format
    sizes = ModelSizes.of(arch, dtype, plan.quant_of, kv_format)
    if args.quantize != "none":
        dtype = f"{dtype}, matrices {args.quantize}"
    lines = [
        f"# hpcinfer plan: {args.model} ({_count(arch.param_count())} parameters, {dtype}: "
        f"{human_bytes(sizes.total_weight_bytes)} of weights"
        + (f"; KV cache {kv_format.mode} g{kv_format.group}" if kv_format is not None else "") + f") on {profile.name}",
        f"# workload: prompt {args.prompt_len} + {args.gen_len} generated tokens per sequence"
        + (f", max latency {args.max_latency:g} s" if args.max_latency is not None else "")
        + (f"; fixed: {', '.join(args.fix)}" if args.fix else ""),
        f"# predicted: {best.throughput:.3g} tokens/s, latency {best.latency_s:.4g} s for a block of "
        f"{policy.block_size} sequences (prefill {best.prefill_s:.4g} s + decode {best.decode_s:.4g} s)",
        f"# bottleneck: {best.bottleneck}",
        "# peak memory: " + ", ".join(f"{tier} {human_bytes(best.peak[tier])} of {human_bytes(best.budget[tier])}"
                                      for tier in TIERS),
        policy.to_toml_section(profile.device_memory, profile.host_memory, disk_dir, arch.num_layers,
                               args.gen_len, _profile_key(args)).rstrip("\n"),
    ]
    if args.profile is None:
        lines.insert(-1, "# no --profile: keep this machine's with `hpcinfer profile --out machine.toml` and set "
                         "[offload] profile = \"machine.toml\" for the run's predicted-vs-measured line")
    return "\n".join(lines + _candidates(plan.candidates, args.candidates))


def _candidates(candidates: list, rows: int) -> list[str]:
    """The candidates table: the `rows` fastest feasible block shapes (comments)."""
    shown = candidates[:max(rows, 0)]
    if not shown:
        return []
    lines = ["", f"# candidates (the {len(shown)} fastest of {len(candidates)} feasible block shapes):",
             "# gpu_batch  batches  block  weights g/c/d  cache g/c/d  act g/c/d  cpu_att  tokens/s  "
             "latency_s  device     host       disk"]
    for p, pred in shown:
        lines.append(
            f"# {p.gpu_batch_size:>9}  {p.num_gpu_batches:>7}  {p.block_size:>5}  "
            f"{_triple(p.weights_gpu, p.weights_cpu, p.weights_disk):>13}  "
            f"{_triple(p.cache_gpu, p.cache_cpu, p.cache_disk):>11}  "
            f"{_triple(p.act_gpu, p.act_cpu, p.act_disk):>9}  {('yes' if p.cpu_attention else 'no'):>7}  "
            f"{pred.throughput:>8.3g}  {pred.latency_s:>9.4g}  "
            + "  ".join(f"{human_bytes(pred.peak[t]):>9}" for t in TIERS))
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n / 1e3:.1f}K"


def _profile_key(args) -> str | None:
    """`--profile` as `[offload] profile` takes it: a preset's name, or the file's absolute path."""
    if args.profile is None or args.profile in PRESETS:
        return args.profile
    return os.path.abspath(args.profile)


def _triple(gpu: float, cpu: float, disk: float) -> str:
    return "/".join(f"{v:.0f}" for v in (gpu, cpu, disk))
