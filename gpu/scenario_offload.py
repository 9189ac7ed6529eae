"""The offloading scenarios of issue 32 (gpu/scenarios.py runs them): FlexGen's throughput on a model several times
the GPU budget, and ZeRO-Inference's layer streaming, each against the bound it should reach.

flexgen  OPT-30B's shapes in float16 (~60 GB at 48 layers, random weights built in host memory in the run), the
         GPU budget capped (16 GB: FlexGen's T4 case scaled up), the placement the LP picks
         (offload/lp.search_policy over the links and rates measured in the run), the zig-zag block schedule at the
         LP's block (gpu_batch_size x num_gpu_batches). Cases: the LP's policy; the same with CPU attention
         delegation flipped; float16 against int4 weights + int4 KV at fewer layers. Each: tokens/s against the cost
         model's prediction for that policy, and against the PCIe bound (the bytes the run moved host -> device
         over the pinned host -> device bandwidth measured in the run: fraction_of_bound = bound_s / run_s).
zero     the same shapes at fewer layers, every layer's weights in pinned host memory, streamed layer by layer
         (the row schedule) with prefetch of 1 layer and without, at batch 1 .. 64. Per batch: the weight bytes of
         one step over the decode step's time (achieved host -> device GB/s, against the pinned copy's), and the
         fraction of the transfer hidden behind compute: with t_off the step without prefetch (transfer then
         compute), transfer = step bytes / pinned bandwidth and compute = t_off - transfer, the exposed transfer
         of the prefetched step t_on is max(0, t_on - compute) and hidden = 1 - exposed / transfer.
"""

from __future__ import annotations

import dataclasses
import tempfile

from hpcinfer.config import OffloadSection
from hpcinfer.offload import profile_gpu
from hpcinfer.offload.cost_model import CostModel
from hpcinfer.offload.lp import search_policy
from hpcinfer.offload.profile import measure as measure_host
from hpcinfer.quant.kv import kv_format
from hpcinfer.quant.storage import load_quant, quant_of

from .scenario_common import (GB, QUANT_GROUP, FastRandomSource, build, generate, guarded, measure, opt_30b,
                              prompts_for, release, sync_of, tiny_opt)


@dataclasses.dataclass(frozen=True)
class OffloadScale:
    layers: int                  # flexgen's model
    budget: int                  # device bytes the LP plans for (and the runtime holds to)
    host_memory: int             # host bytes the LP may use
    prompt: int
    gen: int
    gpu_batch_sizes: tuple
    num_gpu_batches: tuple
    int4_layers: int             # the float16 / int4 comparison's model
    zero_layers: int
    zero_batches: tuple
    copy_bytes: int              # the link probes' array
    need_s: dict                 # case -> seconds it needs at least (else skipped)


SCALES = {
    "full": OffloadScale(48, 16 * 2**30, 90 * 2**30, 64, 8, (8, 16, 32), (1, 2, 4, 8), 8, 8,
                         (1, 4, 16, 64), 256 * 2**20,
                         {"build": 45, "policy": 25, "cpu_attention": 25, "int4": 50, "zero": 10}),
    "tiny": OffloadScale(4, 380_000, 2**30, 6, 2, (2, 4), (1, 2), 2, 2, (1, 2), 1 << 20,
                         {"build": 1, "policy": 1, "cpu_attention": 1, "int4": 1, "zero": 1}),
}


def arch_for(scale: str, layers: int):
    return opt_30b(layers) if scale == "full" else tiny_opt(layers)


def section(policy, budget: int, disk_dir: str, **changes) -> OffloadSection:
    """The [offload] section that runs `policy` (lp.Policy) under the device budget."""
    keys = {k: getattr(policy, k) for k in ("schedule", "gpu_batch_size", "num_gpu_batches", "weights_gpu",
                                            "weights_cpu", "cache_gpu", "cache_cpu", "act_gpu", "act_cpu",
                                            "cpu_attention", "prefetch_layers")}
    return OffloadSection(**{**keys, **changes}, device_memory=budget, disk_dir=disk_dir)


def against_bounds(figures: dict, predicted, links: dict) -> dict:
    """A run's figures with the cost model's prediction and the PCIe bound beside them."""
    h2d = figures["weights_bytes_from_host"] + figures["kv_bytes_to_device"]
    bound_s = h2d / links["h2d_pinned"]
    figures.update(predicted_tokens_per_s=predicted.throughput, predicted_s=predicted.total_s,
                   predicted_bottleneck=predicted.bottleneck,
                   measured_over_predicted=figures["tokens_per_s"] / predicted.throughput,
                   h2d_bytes=h2d, pcie_bound_s=bound_s, pcie_bound_tokens_per_s=figures["generated"] / bound_s,
                   fraction_of_bound=bound_s / figures["run_s"])
    return figures


def flexgen(ops, results, scale: str) -> None:
    s = SCALES[scale]
    cp, work = ops.xp, tempfile.mkdtemp(prefix="scenario-flexgen-")
    links = measure(cp, s.copy_bytes)
    profile = profile_gpu.gpu_profile(measure_host(work, device_memory=s.budget, host_memory=s.host_memory,
                                                   size=min(s.copy_bytes, 64 * 2**20)), links)
    arch = arch_for(scale, s.layers)
    policy, predicted, candidates = search_policy(arch, s.prompt, s.gen, profile, gpu_batch_sizes=s.gpu_batch_sizes,
                                                  num_gpu_batches=s.num_gpu_batches, dtype="float16")
    results.set(links=links, profile=profile.summary(), model={"shape": "OPT-30B", "layers": arch.num_layers},
                policy=dataclasses.asdict(policy), candidates=len(candidates))
    cost = CostModel(arch, s.prompt, s.gen, profile, dtype="float16")
    off = section(policy, s.budget, work)
    if results.left() < s.need_s["build"]:
        results.skip("build", f"{results.left():.0f} s left")
        return
    model = build(ops, arch, "float16", off)
    prompts = prompts_for(arch, policy.block_size, s.prompt)
    sync = sync_of(ops)
    guarded(results, "lp-policy", s.need_s["policy"],
            lambda: against_bounds(generate(model, prompts, s.gen, off, sync), predicted, links))
    flipped = dataclasses.replace(policy, cpu_attention=not policy.cpu_attention)
    guarded(results, f"cpu-attention-{'on' if flipped.cpu_attention else 'off'}", s.need_s["cpu_attention"],
            lambda: against_bounds(generate(model, prompts, s.gen, section(flipped, s.budget, work), sync),
                                   cost.predict(flipped), links))
    release(model, ops)
    for quantized in (False, True):
        guarded(results, f"{'int4' if quantized else 'float16'}-{s.int4_layers}-layers", s.need_s["int4"],
                lambda q=quantized: int4_case(ops, scale, policy, profile, links, q, work))


def int4_case(ops, scale: str, policy, profile, links: dict, quantized: bool, work: str) -> dict:
    """The LP's policy on a model of int4_layers layers, float16, or int4 weights and int4 KV."""
    s = SCALES[scale]
    arch = arch_for(scale, s.int4_layers)
    mode = "int4" if quantized else "none"
    off = section(policy, s.budget, work)
    model = build(ops, arch, "float16", off, quantize=mode, kv_cache=mode)
    quant = quant_of(FastRandomSource("scenario", arch), load_quant(FastRandomSource("scenario", arch), "int4"))
    cost = CostModel(arch, s.prompt, s.gen, profile, dtype="float16", quant_of=quant if quantized else None,
                     kv_format=kv_format(mode, QUANT_GROUP, arch.head_dim))
    try:
        figures = generate(model, prompts_for(arch, policy.block_size, s.prompt), s.gen, off, sync_of(ops))
    finally:
        release(model, ops)
    return against_bounds(figures, cost.predict(policy), links)


def zero(ops, results, scale: str) -> None:
    s = SCALES[scale]
    cp = ops.xp
    links = measure(cp, s.copy_bytes)
    arch = arch_for(scale, s.zero_layers)
    results.set(links=links, model={"shape": "OPT-30B", "layers": arch.num_layers})
    runs: dict = {}
    for prefetch in (1, 0):
        if results.left() < s.need_s["build"] / 4:
            results.skip(f"prefetch-{prefetch}", f"{results.left():.0f} s left")
            continue
        off = OffloadSection(schedule="row", weights_gpu=0, weights_cpu=100, prefetch_layers=prefetch)
        model = build(ops, arch, "float16", off)
        try:
            for batch in s.zero_batches:
                runs[prefetch, batch] = guarded(results, f"prefetch-{prefetch}-batch-{batch}", s.need_s["zero"],
                                                lambda b=batch: streaming_run(model, arch, b, s, off, ops, links))
        finally:
            release(model, ops)
    for batch in s.zero_batches:
        on, off_run = runs.get((1, batch)), runs.get((0, batch))
        if on and off_run and "error" not in on and "error" not in off_run:
            results.add(f"hidden-batch-{batch}", hidden_fraction(on, off_run, links))


def streaming_run(model, arch, batch: int, s: OffloadScale, off, ops, links: dict) -> dict:
    before = model.weights.bytes_from_host
    figures = generate(model, prompts_for(arch, batch, s.prompt), s.gen, off, sync_of(ops))
    steps = 1 + len(figures["decode_step_s"])                                   # prefill + decode steps
    step_bytes = (model.weights.bytes_from_host - before) / steps
    figures.update(batch=batch, step_bytes=step_bytes, achieved_GBps=step_bytes / figures["decode_median_s"] / GB,
                   fraction_of_pinned=step_bytes / figures["decode_median_s"] / links["h2d_pinned"])
    return figures


def hidden_fraction(on: dict, off: dict, links: dict) -> dict:
    transfer = on["step_bytes"] / links["h2d_pinned"]
    compute = max(0.0, off["decode_median_s"] - transfer)
    exposed = max(0.0, on["decode_median_s"] - compute)
    return {"batch": on["batch"], "transfer_s": transfer, "compute_s": compute, "step_prefetch_s":
            on["decode_median_s"], "step_no_prefetch_s": off["decode_median_s"],
            "hidden": min(1.0, max(0.0, 1 - exposed / transfer)) if transfer > 0 else None}
