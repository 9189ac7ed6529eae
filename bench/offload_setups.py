"""What the offload benchmark (offload.py) compares: each Setup is one whole run's [offload] keys, its
group and the role its row plays in the report. FlexGen's Table 4 ablations take the LP's policy and remove one
thing at a time (`plan_ablations`); the hand-set rows compare the schedules at the same GPU batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Setup:
    name: str
    group: str                   # "host" | "disk" | "cache" | "policy" | "reference"
    role: str                    # what the row stands for, in the table
    keys: dict = field(default_factory=dict)     # [offload] keys (disk_dir and budgets are added)
    budget: bool = True          # run under the device budget (the reference does not)
    threads: int = 0             # BLAS threads; 0 = --threads (default: every usable CPU, as `hpcinfer run`)
    quantize: str = "none"       # [model] quantize: the weights (and what the tiers move) int8 / int4
    kv_cache: str = "none"       # [model] kv_cache: the KV cache (and what the zig-zag moves) int8 / int4


def setups(args) -> list[Setup]:
    b, k = args.batch // args.gpu_batches, args.gpu_batches
    host = dict(weights_gpu=0, weights_cpu=100)
    disk = dict(weights_gpu=0, weights_cpu=0)
    zz = dict(schedule="zigzag", gpu_batch_size=b, num_gpu_batches=k)
    row = dict(schedule="row", gpu_batch_size=b, num_gpu_batches=k)
    cache_host = dict(cache_gpu=0, cache_cpu=100)
    return [
        Setup("all on device", "reference", "no offload: the ideal, above the budget", {}, budget=False),
        Setup("host: zig-zag", "host", f"FlexGen block schedule, {k} GPU batches of {b}, prefetch 1",
              {**host, **zz, "prefetch_layers": 1}),
        Setup("host: row", "host", f"ZeRO-Inference row by row, {k} GPU batches of {b}, prefetch 1",
              {**host, **row, "prefetch_layers": 1}),
        Setup("host: zig-zag, no overlap", "host", "prefetch_layers = 0: every read waits",
              {**host, **zz, "prefetch_layers": 0}),
        Setup("host: zig-zag, BLAS threads - 1", "host", f"prefetch 1, {max(1, args.threads - 1)} BLAS thread(s): "
              "a core left to the prefetch thread", {**host, **zz, "prefetch_layers": 1},
              threads=max(1, args.threads - 1)),
        Setup("host: row, whole batch", "host", f"row, 1 GPU batch of {args.batch} (needs {k}x the activation "
              "memory)", {**host, "schedule": "row", "num_gpu_batches": 1, "prefetch_layers": 1}),
        Setup("disk: zig-zag", "disk", f"FlexGen block schedule, {k} GPU batches of {b}, prefetch 1",
              {**disk, **zz, "prefetch_layers": 1}),
        Setup("disk: row", "disk", f"ZeRO-Inference row by row, {k} GPU batches of {b}, prefetch 1",
              {**disk, **row, "prefetch_layers": 1}),
        Setup("disk: zig-zag, no overlap", "disk", "prefetch_layers = 0", {**disk, **zz, "prefetch_layers": 0}),
        Setup("cache host: zig-zag", "cache", "weights and KV cache in host memory, cpu_attention off",
              {**host, **zz, **cache_host, "prefetch_layers": 1, "cpu_attention": False}),
        Setup("cache host: zig-zag, cpu_attention", "cache", "the same, cpu_attention on",
              {**host, **zz, **cache_host, "prefetch_layers": 1, "cpu_attention": True}),
    ]


def quant_setups(args) -> list[Setup]:
    """--quant: float32, int8 and int4 weights (`[model] quantize`), each all on the device (its reference) and
    streamed from host memory and from disk with the zig-zag schedule, prefetch 1."""
    b, k = args.batch // args.gpu_batches, args.gpu_batches
    zz = dict(schedule="zigzag", gpu_batch_size=b, num_gpu_batches=k, prefetch_layers=1)
    out = []
    for mode in ("none", "int8", "int4"):
        label = "float32" if mode == "none" else mode
        out += [Setup(f"{label}: all on device", "reference", f"{label} weights, no offload", {}, budget=False,
                      quantize=mode),
                Setup(f"{label}: host zig-zag", label, f"{label} weights in host memory, {k} GPU batches of {b}",
                      {"weights_gpu": 0, "weights_cpu": 100, **zz}, quantize=mode),
                Setup(f"{label}: disk zig-zag", label, f"{label} weights on disk, {k} GPU batches of {b}",
                      {"weights_gpu": 0, "weights_cpu": 0, **zz}, quantize=mode)]
    return out


def kv_setups(args) -> list[Setup]:
    """--kv-quant: float32, int8 and int4 KV caches (`[model] kv_cache`), each on the device (its reference, with
    the same GPU batches: a quantized cache turns the float rounding differences of another batching into other
    tokens, so only the same arithmetic may be held to equal tokens) and in host memory with the zig-zag schedule (weights in host memory too, prefetch 1, no CPU attention): every
    host-resident GPU batch's cache passes through the device staging cache, quantized."""
    b, k = args.batch // args.gpu_batches, args.gpu_batches
    zz = dict(schedule="zigzag", gpu_batch_size=b, num_gpu_batches=k, prefetch_layers=1)
    out = []
    for mode in ("none", "int8", "int4"):
        label = "float32" if mode == "none" else mode
        out += [Setup(f"KV {label}: zig-zag on device", "reference", f"{label} KV cache and the weights on the "
                      f"device, the same {k} GPU batches of {b}", zz, budget=False, kv_cache=mode),
                Setup(f"KV {label}: cache host zig-zag", f"kv-{label}", f"{label} KV cache and the weights in "
                      f"host memory, {k} GPU batches of {b}", {"weights_gpu": 0, "weights_cpu": 100, "cache_gpu": 0,
                                                              "cache_cpu": 100, "cpu_attention": False, **zz},
                      kv_cache=mode)]
    return out


def plan_ablations(plan) -> list:
    """FlexGen's Table 4 on the LP's policy (a Setup): the same policy without overlap (prefetch_layers = 0) or,
    when the plan itself has none (a NumPy-measured profile: transfers share the cores), with it (prefetch 1),
    without CPU attention (when it had it), and with ZeRO-Inference's row-by-row schedule (the same placement and
    GPU batches)."""
    keys = plan.keys
    overlapped = keys.get("prefetch_layers", 1) > 0
    name, role = (("plan: no overlap", "the LP's policy, prefetch_layers = 0") if overlapped else
                  ("plan: prefetch 1", "the LP's policy with overlap: prefetch_layers = 1"))
    out = [Setup(name, "policy", role, {**keys, "prefetch_layers": 0 if overlapped else 1})]
    if keys.get("cpu_attention"):
        out.append(Setup("plan: no CPU attention", "policy", "the LP's policy, cpu_attention off",
                         {**keys, "cpu_attention": False}))
    if keys.get("schedule") == "zigzag" and keys.get("cache_gpu", 100) == 100 and not keys.get("cpu_attention"):
        out.append(Setup("plan: row schedule", "policy", "the LP's placement, row-by-row schedule",
                         {**keys, "schedule": "row"}))
    return out
