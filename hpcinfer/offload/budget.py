"""The memory plan of an offloaded run, checked against the byte budgets before any weight is read."""

from __future__ import annotations

from ..config import parse_bytes
from ..errors import ConfigError
from ..parallel.micro_batches import micro_batches
from ..quant.formats import QuantError
from ..quant.kv import kv_format
from .cost_model import CostModel
from .policy import Policy
from .profile import resolve_profile
from .sizes import ACT_ITEMSIZE, device_rows, kv_token_bytes, layer_bytes, table_bytes
from .tiers import place_layers


def itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def kv_format_of(config, arch):
    """`[model] kv_cache` / `kv_cache_group` for this model: a quant.kv.KVFormat, or None for a float32 cache."""
    try:
        return kv_format(config.model.kv_cache, config.model.kv_cache_group, arch.head_dim)
    except QuantError as exc:
        raise ConfigError(f"{config.path}: model.kv_cache_group = {config.model.kv_cache_group}: {exc}") from None


def plan_bytes(arch, config, stage, prompt_lengths: list, quant_of=None, fetch_share: int = 1) -> dict:
    """Bytes per tier on one rank: weights by tier, the streaming window, embeddings, and the KV cache at tensor
    granularity: of each GPU batch's N x Hkv rows (sequence, KV head), device_rows(N Hkv, cache_gpu) on the device
    and the rest in host memory; when any row is in host memory, two device staging buffers of one layer of the
    largest such batch (one loading while the other computes), unless CPU attention attends every row where it
    lies (the device rows on the device, the host rows on the host: host_attention_bytes of scratch instead). At the bytes of `[model] kv_cache` (offload/sizes.kv_token_bytes: an int4 cache is ~7x smaller than
    float32). quant_of: which tensors are held quantized (quant.storage.quant_of). fetch_share: the replicas of a
    partitioned fetch group; each keeps 1/fetch_share of every host and disk layer. The activations:
    act_plan_bytes."""
    off, tp = config.offload, config.parallel.tp
    size = itemsize(config.model.dtype)
    layers = list(stage.layers)
    per_layer = [layer_bytes(arch, i, size, tp, quant_of) for i in layers]
    tiers = place_layers(len(layers), off.weights_gpu, off.weights_cpu)
    streamed = [b for b, t in zip(per_layer, tiers) if t != "device"]
    window = (off.prefetch_layers + 1) * max(streamed, default=0)
    tables = table_bytes(arch, stage.is_first, stage.is_last, size, tp, quant_of)
    kept = lambda tier: sum(-(-b // fetch_share) for b, t in zip(per_layer, tiers) if t == tier)
    kv_device, kv_host, staging = kv_plan_bytes(arch, config, len(layers), prompt_lengths)
    act_device, act_host = act_plan_bytes(arch, config, prompt_lengths)
    scratch = host_attention_bytes(arch, config, prompt_lengths)
    resident = sum(b for b, t in zip(per_layer, tiers) if t == "device")
    return {
        "device": resident + window + tables + kv_device + staging + act_device,
        "host": kept("host") + kv_host + act_host + scratch,
        "disk": kept("disk"),
        "parts": {"resident layers": resident, "streaming window": window, "embedding tables": tables,
                  "KV cache on the device": kv_device + staging, "activations on the device": act_device},
        "host_parts": {"host layers": kept("host"), "KV cache rows in host memory": kv_host,
                       "activation rows in host memory": act_host,
                       **({"host attention scratch": scratch} if scratch else {})},
    }


def kv_plan_bytes(arch, config, num_layers: int, prompt_lengths: list) -> tuple[int, int, int]:
    """(device rows, host rows, staging buffers) bytes of the KV cache of a block, as generate/schedules/zigzag.py holds it."""
    off, tp = config.offload, config.parallel.tp
    heads = arch.num_kv_heads // tp
    max_len = max(min(n + config.generate.max_new_tokens, arch.max_positions) for n in prompt_lengths)
    per_row_layer = max_len * kv_token_bytes(arch, tp, kv_format_of(config, arch)) // heads   # K and V of a row
    gpu_batches = micro_batches(config.generate.batch_size, off.num_gpu_batches)
    on_device = [device_rows(len(g) * heads, off.cache_gpu) for g in gpu_batches]
    host_rows = [len(g) * heads - r for g, r in zip(gpu_batches, on_device)]
    staged = [len(g) for g, h in zip(gpu_batches, host_rows) if h > 0]
    staging = 0 if off.cpu_attention or not staged else 2 * max(staged) * heads * per_row_layer
    return (sum(on_device) * num_layers * per_row_layer, sum(host_rows) * num_layers * per_row_layer, staging)


def host_attention_bytes(arch, config, prompt_lengths: list) -> int:
    """Host scratch of CPU attention (generate/schedules/zigzag.py holds it): for the GPU batch with the most host rows h
    (sequence x KV head), its float32 scores [h, g, Lmax] (g query heads a KV head) and, for a quantized cache,
    the float32 K and V it dequantizes [h, Lmax, hd] each; 0 without CPU attention or without a host row."""
    off, tp = config.offload, config.parallel.tp
    if not off.cpu_attention:
        return 0
    heads = arch.num_kv_heads // tp
    group = arch.num_heads // arch.num_kv_heads
    max_len = max(min(n + config.generate.max_new_tokens, arch.max_positions) for n in prompt_lengths)
    rows = max(len(g) * heads - device_rows(len(g) * heads, off.cache_gpu)
               for g in micro_batches(config.generate.batch_size, off.num_gpu_batches))
    dequantized = 2 * arch.head_dim if kv_format_of(config, arch) is not None else 0
    return rows * max_len * (group + dequantized) * ACT_ITEMSIZE


def act_plan_bytes(arch, config, prompt_lengths: list) -> tuple[int, int]:
    """(device, host) bytes of the activations at their peak, the prefill step of the block that needs most, as
    offload/activations.py holds them: of each GPU batch's T_b prompt tokens (rows [T_b, D]), R_b =
    device_rows(T_b, act_gpu) on the device and the rest in host memory; when any row is in host memory, two
    device staging buffers [max_b T_b, D]. At act_gpu = 100 the whole block's hidden states are on the device
    (the row schedule, act_gpu = 100 only, holds one GPU batch's at a time)."""
    off, size = config.offload, ACT_ITEMSIZE * arch.hidden_size                     # bytes of one row
    batch = config.generate.batch_size
    device = host = 0
    for first in range(0, len(prompt_lengths), batch):                             # the blocks (job._batches)
        block = prompt_lengths[first:first + batch]
        tokens = [sum(block[i] for i in g) for g in micro_batches(len(block), off.num_gpu_batches)]   # T_b
        rows = [device_rows(t, off.act_gpu) for t in tokens]                                          # R_b
        on_host = sum(tokens) - sum(rows)
        held = max(rows) if off.schedule == "row" else sum(rows)          # row: one GPU batch at a time
        device = max(device, (held + (2 * max(tokens) if on_host else 0)) * size)
        host = max(host, on_host * size)
    return device, host


# What to change when a tier does not fit: the keys that take bytes out of it.
_ADVICE = {"device": "lower weights_gpu / cache_gpu / act_gpu",
           "host": "lower weights_cpu (more layers on disk) / cache_cpu (more KV rows on the device) / act_cpu "
                   "(more activation rows on the device)"}


def check_budgets(arch, config, stages, prompt_lengths: list, quant_of=None, fetch_share: int = 1) -> None:
    """A ConfigError naming the tier, its budget, the bytes the plan needs there and each part of them, when a
    stage's plan does not fit `device_memory` or `host_memory`."""
    off = config.offload
    for stage in stages:
        plan = plan_bytes(arch, config, stage, prompt_lengths, quant_of, fetch_share)
        for tier, key in (("device", "device_memory"), ("host", "host_memory")):
            budget = parse_bytes(getattr(off, key))
            if budget and plan[tier] > budget:
                itemized = plan["parts"] if tier == "device" else plan["host_parts"]
                parts = ", ".join(f"{k} {int(v):,}" for k, v in itemized.items())
                advice = _ADVICE[tier]
                raise ConfigError(f"{config.path}: [offload] {key} = {budget:,} bytes cannot hold this plan: "
                                  f"{int(plan[tier]):,} bytes needed on the {tier} ({parts}); {advice}, or raise "
                                  f"{key}")


def predicted_vs_measured(arch, config, prompt_lengths: list, blocks: int, measured_s: float,
                          quant_of=None) -> dict | None:
    """The cost model's time for this run's policy on `[offload] profile`, beside the measured time (quant_of:
    the tensors held quantized, whose quantized bytes are what moves)."""
    off = config.offload
    if off.profile is None:
        return None
    policy = Policy.from_section(off, config.generate.batch_size)
    prompt_len = max(1, round(sum(prompt_lengths) / len(prompt_lengths)))
    model = CostModel(arch, prompt_len, config.generate.max_new_tokens, resolve_profile(off.profile),
                      config.model.dtype, quant_of, kv_format_of(config, arch))
    predicted = model.predict(policy).total_s * blocks
    return {"profile": off.profile, "predicted_s": predicted, "measured_s": measured_s,
            "measured_over_predicted": measured_s / predicted if predicted > 0 else None}
