"""The layout search: every valid layout of N ranks, predicted by step.py, filtered by memory and a latency
budget, ranked by an objective.

Searched: tp (divisors of N up to the GPUs of a node), pp (divisors of N / tp up to the layers), dp = the rest;
for MoE models expert_tp (divisors of dp * tp) with ep = dp * tp / expert_tp, and the all-to-all variant (the PCC
ones only when tp > 1: with tp = 1 they are the plain ones); micro-batch counts 1 without a pipeline, and with
pp > 1 the prompt and generation counts from {pp, 2 pp} (capped at the per-replica batch; the batch itself when
it is smaller). Invalid layouts (layout.layout_problem, the runtime's own checks) never reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .layout import ALL_TO_ALL, Layout, divisors, layout_problem
from .memory import rank_memory
from .offload import plan_offload
from .step import Prediction, Workload, predict

OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True)
class PlanResult:
    ranked: list                 # [Prediction], best first: valid, fitting and within the latency budget
    considered: int              # valid layouts predicted
    too_big: int                 # of them, over the memory budget
    too_slow: int                # of them, fitting but over the latency budget
    smallest_memory: int         # bytes per rank of the leanest valid layout (what a user would have to provide)
    fastest_s: float             # the smallest token step of the fitting layouts, budget or not (inf: none fit)
    offloaded: int = 0           # of the too_big ones, planned with offload instead (perf/offload.py): in ranked
                                 # or too_slow, not in too_big


def micro_batch_options(pp: int, batch: int) -> list[int]:
    if pp == 1:
        return [1]
    return sorted({min(n, batch) for n in (pp, 2 * pp)})


def candidate_layouts(arch, gpus: int, gpus_per_node: int, batch: int):
    """Every layout of `gpus` ranks the search looks at (valid or not); `batch` = global sequences."""
    ranks_per_node = min(gpus_per_node, gpus)
    moe = bool(arch.moe_experts)
    for tp in (d for d in divisors(gpus) if d <= ranks_per_node):
        for pp in (d for d in divisors(gpus // tp) if d <= arch.num_layers):
            dp = gpus // (tp * pp)
            per_replica = -(-batch // dp)
            base = Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=ranks_per_node)
            for expert_tp in (divisors(dp * tp) if moe else [1]):
                kinds = [k for k in ALL_TO_ALL if tp > 1 or not k.startswith("pcc")] if moe else ["flat"]
                for kind in kinds:
                    for pmb in micro_batch_options(pp, per_replica):
                        for gmb in micro_batch_options(pp, per_replica):
                            ep = dp * tp // expert_tp if moe else 1
                            yield replace(base, ep=ep, expert_tp=expert_tp if moe else 1, all_to_all=kind,
                                          prompt_micro_batches=pmb, gen_micro_batches=gmb)


def _key(objective: str):
    if objective == "latency":
        return lambda p: (p.token_s, p.prompt_s, p.memory)
    return lambda p: (-p.throughput, p.token_s, p.memory)


def plan(arch, gpus: int, work: Workload, hw, objective: str = "latency",
         latency_budget_s: float | None = None, offload: bool = True) -> PlanResult:
    """Search the layouts of `gpus` ranks of machine `hw` (a HardwareProfile with its link fields). offload: a
    layout over the memory that the runtime runs with `[offload]` (pp = 1; an MoE model with dp = 1) is planned
    with its weights (and KV cache) partly in host memory or on disk (perf/offload.py) instead of dropped."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if gpus < 1 or work.batch < 1:
        raise ValueError(f"gpus and batch must be >= 1, got {gpus} and {work.batch}")
    ranked, considered, too_big, too_slow, smallest, fastest = [], 0, 0, 0, None, float("inf")
    offloaded, solved = 0, {}
    for layout in candidate_layouts(arch, gpus, hw.gpus_per_node, work.batch):
        if layout_problem(arch, layout, work.per_replica(layout.dp)) is not None:
            continue
        considered += 1
        memory = rank_memory(arch, layout, work)
        smallest = memory if smallest is None else min(smallest, memory)
        if memory > hw.device_memory:
            prediction = plan_offload(arch, layout, work, hw, solved) if offload else None
            if prediction is None:
                too_big += 1
                continue
            offloaded += 1
        else:
            prediction = replace(predict(arch, layout, work, hw), memory=memory)
        fastest = min(fastest, prediction.token_s)
        if latency_budget_s is not None and prediction.token_s > latency_budget_s:
            too_slow += 1
            continue
        ranked.append(prediction)
    ranked.sort(key=_key(objective))
    return PlanResult(ranked, considered, too_big, too_slow, smallest or 0, fastest, offloaded)


def best(result: PlanResult) -> Prediction | None:
    return result.ranked[0] if result.ranked else None
