"""Offload as a search dimension of the layout planner: a layout whose rank does not fit streams its layers.

Which layouts (the runtime's limits, config._check_offload and job.open_job): pp = 1 only (offload streams the
layers of one pipeline stage); a dense model with any tp (inside a node) and dp, the dp replicas of a node that
hold the same tp shard sharing each fetch (`partitioned_fetch`: group f = min(dp, ranks a node / tp),
job._fetch_share); an MoE model only with dp = 1 (its replicas would have to step together), so tp = ep *
expert_tp = N on one node. Every other layout that does not fit stays dropped.

Placement: the offload planner's own LP (offload/lp.solve_placement, FlexGen's cost model) for the rank's shard,
with the block = the replica's batch b = ceil(B / dp) split into k GPU batches (k a divisor of b up to 16), the
activations on the device and no CPU attention (the step model below computes attention on the device), budgets
per rank: the GPU's memory, host and disk = the hardware file's (a node's) / the ranks of a node. The shard: the
model with H, Hkv, F and the expert width divided by tp and ceil(V / tp) vocabulary rows (`shard_arch`), which
holds the bytes offload/sizes.py counts for a rank but for its vectors (norms and biases the runtime keeps whole),
whose difference is taken off the budgets the LP sees (`shard_margin`), so the runtime's budget check passes.

Time (docs/planner.md): the step model's compute and communication of the layout with k micro-batches (a GPU
batch each, as the zig-zag schedule runs them), plus per token step and per prompt phase the transfers of the
placement, each on its link:
    host_to_device  S / f + cc b c kv L           S: bytes of the rank's streamed layers (host and disk tiers),
    device_to_host  cc b t kv L                   c: positions the decode step reads (P + G/2), t: 1 a token step,
    disk_to_host    S_disk / f                       P the prompt phase (its new cache rows out; no cache in)
    gather          sum over streamed layers of all_gather(layer bytes, f, intra-node link)   (partitioned fetch)
overlapped with compute when the hardware overlaps (`overlap`, GPU presets true) and prefetch_layers >= 1: the
step is max(compute, host_to_device, device_to_host, disk_to_host) + communication + gather (the gather runs on
the compute stream, offload/tiers.py); otherwise their sum.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..offload import partition
from ..offload.lp import PlacementError, solve_placement
from ..offload.sizes import kv_token_bytes, layer_bytes, table_bytes
from ..offload.tiers import place_layers
from .comm_cost import Links, all_gather
from .layout import Layout, divisors
from .step import Prediction, Workload, slowest_stage

MAX_GPU_BATCHES = 16             # FlexGen's "less than 20", the offload search's default grid
FIXED = {"act_gpu": 100, "act_cpu": 0}      # activations on the device (one GPU batch's hidden states are small)


@dataclass(frozen=True)
class OffloadPlan:
    policy: object               # offload.policy.Policy for one rank
    fetch_share: int             # f: replicas of a partitioned fetch group (1: each rank fetches its own layers)
    streamed_bytes: float        # S: bytes of the rank's layers on the host and disk tiers (each fetched a step)
    disk_bytes: float            # S_disk: of them, on disk
    token_transfer_s: dict       # link -> seconds of one token step (host_to_device, device_to_host, disk_to_host)
    prompt_transfer_s: dict      # link -> seconds of the prompt phase
    gather_s: float              # partitioned fetch's all-gathers of one step (prompt phase or token step)
    peak: dict                   # tier -> bytes a rank holds: the offload cost model's peak of the shard, plus
                                 # on the device and host the vectors it does not count (shard_margin)
    device_memory: int           # the budgets of a rank the plan was made for (printed in [offload])
    host_memory: int
    overlap: bool                # transfers overlap compute

    def label(self) -> str:
        p = self.policy
        text = f"w{_pct(p.weights_gpu)}/{_pct(p.weights_cpu)}/{_pct(p.weights_disk)}"
        if p.cache_gpu < 100:
            text += f" kv{_pct(p.cache_gpu)}/{_pct(p.cache_cpu)}"
        return text + (f" pf{self.fetch_share}" if self.fetch_share > 1 else "")

    def to_toml(self, num_layers: int, gen_len: int, disk_dir: str | None) -> str:
        """The `[offload]` (and `[generate]`) sections of the offload planner's to_toml_section, plus
        `partitioned_fetch = true` when the replicas share their fetches."""
        text = self.policy.to_toml_section(self.device_memory, self.host_memory, disk_dir, num_layers, gen_len)
        if self.fetch_share > 1:
            head, tail = text.split("\n[generate]", 1)
            text = (head.rstrip("\n") + f"\npartitioned_fetch = true  # {self.fetch_share} replicas of a node share "
                    f"each layer fetch\n\n[generate]" + tail)
        return text


def _pct(value: float) -> str:
    return f"{value:g}"


def eligible(arch, layout: Layout) -> bool:
    """Whether the runtime accepts `[offload]` with this layout (config._check_offload, job.open_job)."""
    if layout.pp != 1:
        return False
    if arch.moe_experts and layout.dp > 1:
        return False
    return True


def fetch_share(layout: Layout) -> int:
    """job._fetch_share with partitioned_fetch on: the dp replicas of a node holding the same tp shard."""
    return partition.fetch_share(layout.dp, layout.tp, layout.ranks_per_node)


def shard_arch(arch, tp: int):
    """The model as one tp rank holds it: heads, KV heads, MLP and expert widths / tp, ceil(V / tp) vocabulary
    rows (the rows sizes.tensor_bytes gives a rank of the token table and LM head). None when a width does not
    divide."""
    if tp == 1:
        return arch
    widths = [arch.num_heads, arch.num_kv_heads, arch.intermediate_size] + \
        ([arch.moe_intermediate_size] if arch.moe_intermediate_size else [])
    if any(w % tp for w in widths):
        return None
    return dataclasses.replace(arch, num_heads=arch.num_heads // tp, num_kv_heads=arch.num_kv_heads // tp,
                               intermediate_size=arch.intermediate_size // tp,
                               moe_intermediate_size=arch.moe_intermediate_size // tp,
                               vocab_size=-(-arch.vocab_size // tp))


def shard_margin(arch, shard, tp: int, work: Workload) -> int:
    """Bytes the runtime holds on a rank beyond what the shard model counts: vectors kept whole (biases of the
    split matrices), >= 0."""
    isz, q = work.itemsize, work.quant_of
    real = sum(layer_bytes(arch, i, isz, tp, q) for i in range(arch.num_layers)) + \
        table_bytes(arch, True, True, isz, tp, q)
    counted = sum(layer_bytes(shard, i, isz, 1, q) for i in range(arch.num_layers)) + \
        table_bytes(shard, True, True, isz, 1, q)
    return max(0, real - counted)


def rank_budgets(hw, layout: Layout) -> tuple[int, int, int]:
    """(device, host, disk) bytes of one rank: the GPU's memory, and the node's host memory and disk shared by the
    ranks of a node."""
    ranks = max(1, layout.ranks_per_node)
    return hw.device_memory, hw.host_memory // ranks, hw.disk_memory // ranks


def plan_offload(arch, layout: Layout, work: Workload, hw, cache: dict | None = None) -> Prediction | None:
    """The best offloaded prediction of `layout` (its Prediction with `offload` set), None when the runtime does
    not take offload with it or no placement fits the rank's budgets. cache: placements already solved, shared
    by the layouts of one search (they differ only in the MoE exchange for the same tp, dp and node shape)."""
    if not eligible(arch, layout):
        return None
    key = (layout.tp, layout.dp, layout.ranks_per_node)
    if cache is None or key not in cache:
        found = placements(arch, layout, work, hw)
        if cache is None:
            cache = {}
        cache[key] = found
    best = None
    device, host, _ = rank_budgets(hw, layout)
    for policy, peak in cache[key]:
        prediction = predict_offloaded(arch, layout, work, hw, policy, peak, device, host)
        if best is None or _total(prediction, work) < _total(best, work) * (1 - 1e-12):
            best = prediction
    return best


def placements(arch, layout: Layout, work: Workload, hw) -> list:
    """[(policy, peak)]: the offload LP's placement of a rank for each split of its block into GPU batches that
    fits (peak: tier -> bytes with shard_margin added)."""
    shard = shard_arch(arch, layout.tp)
    if shard is None:
        return []
    b = work.per_replica(layout.dp)
    margin = shard_margin(arch, shard, layout.tp, work)
    device, host, disk = rank_budgets(hw, layout)
    if min(device, host) <= margin:
        return []
    lp_hw = hw.with_budgets(device_memory=device - margin, host_memory=host - margin, disk_memory=disk)
    found = []
    for k in (d for d in divisors(b) if d <= MAX_GPU_BATCHES):
        try:
            policy, lp_pred = solve_placement(shard, work.prompt_len, work.gen_len, b // k, k, lp_hw,
                                              cpu_attention=False, dtype=work.dtype, fixed=FIXED,
                                              quant_of=work.quant_of, kv_format=work.kv_format)
        except (PlacementError, ConfigError, ValueError):
            continue
        if policy.weights_gpu >= 100 and policy.cache_gpu >= 100:
            continue            # nothing moved: the step model's memory (memory.rank_memory) says it does not fit
        found.append((policy, {tier: lp_pred.peak[tier] + (margin if tier != "disk" else 0)
                               for tier in lp_pred.peak}))
    return found


def _total(p: Prediction, work: Workload) -> float:
    return p.prompt_s + (work.gen_len - 1) * p.token_s


def predict_offloaded(arch, layout: Layout, work: Workload, hw, policy, peak: dict, device_budget: int,
                      host_budget: int) -> Prediction:
    """The step model's prediction of `layout` running one block of b sequences under `policy` on every rank."""
    links, L, tp = Links.of(hw), arch.num_layers, layout.tp
    f = fetch_share(layout) if policy.weights_gpu < 100 else 1
    b, k = work.per_replica(layout.dp), policy.num_gpu_batches
    tiers = place_layers(L, policy.weights_gpu, policy.weights_cpu)
    each = [layer_bytes(arch, i, work.itemsize, tp, work.quant_of) for i in range(L)]
    streamed = [nbytes for nbytes, tier in zip(each, tiers) if tier != "device"]
    S, S_disk = sum(streamed), sum(n for n, t in zip(each, tiers) if t == "disk")
    kv = kv_token_bytes(arch, tp, work.kv_format)                      # the runtime's rows: float32 or packed
    cache_host = policy.cache_cpu / 100
    context = work.prompt_len + work.gen_len / 2
    token = {"host_to_device": (S / f + cache_host * b * context * kv * L) / hw.host_to_device,
             "device_to_host": cache_host * b * kv * L / hw.device_to_host,
             "disk_to_host": S_disk / f / hw.disk_to_host}
    prompt = {"host_to_device": S / f / hw.host_to_device,
              "device_to_host": cache_host * b * work.prompt_len * kv * L / hw.device_to_host,
              "disk_to_host": S_disk / f / hw.disk_to_host}
    gather = sum(all_gather(n, f, links.intra) for n in streamed)
    overlap = hw.overlap and policy.prefetch_layers >= 1

    batches = dataclasses.replace(layout, prompt_micro_batches=k, gen_micro_batches=k)   # the GPU batches
    m = math.ceil(b / k)                                                         # sequences a GPU batch
    p_compute, p_comm = slowest_stage(arch, batches, m * work.prompt_len, m, work.prompt_len, work, hw, links)
    g_compute, g_comm = slowest_stage(arch, batches, m, m, context, work, hw, links, decode=True)

    def step(compute: float, comm: float, transfers: dict) -> float:
        moved = list(transfers.values())
        return (max([compute] + moved) if overlap else compute + sum(moved)) + comm + gather

    prompt_s = step(k * p_compute, k * p_comm, prompt)
    token_s = step(k * g_compute, k * g_comm, token)
    total = prompt_s + (work.gen_len - 1) * token_s
    plan = OffloadPlan(policy=policy, fetch_share=f, streamed_bytes=S, disk_bytes=S_disk, token_transfer_s=token,
                       prompt_transfer_s=prompt, gather_s=gather,
                       peak=peak, device_memory=device_budget, host_memory=host_budget, overlap=overlap)
    return Prediction(layout=layout, prompt_s=prompt_s, token_s=token_s, throughput=work.batch * work.gen_len / total,
                      bubble=0.0, stage_compute_s=g_compute, stage_comm_s=g_comm + gather / k,
                      memory=int(math.ceil(peak["device"])), offload=plan)
