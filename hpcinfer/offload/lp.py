"""FlexGen's policy search (Section 4.3, Eq. 1): enumerate (gpu_batch_size, num_gpu_batches), and for each solve a
linear program for the nine placement fractions (those the runtime cannot honour pinned: RUNTIME_PINNED).

The LP, for a fixed b = gpu_batch_size, k = num_gpu_batches (and a fixed cpu_attention, tried both ways):
    variables   x = (wg, wc, wd, cg, cc, cd, hg, hc, hd) in [0, 1], T_pre >= 0, T_gen >= 0
    minimize    L T_pre + L (n - 1) T_gen                     seconds per block = B n / throughput
    subject to  T_pre >= term(x)  for each prefill term       (compute and the four links; overlap: the max)
                T_gen >= term(x)  for each decode term        (no overlap: T >= the sum of the terms)
                peak_device(x) <= device_memory, peak_host(x) <= host_memory, peak_disk(x) <= disk_memory
                wg + wc + wd = 1,  cg + cc + cd = 1,  hg + hc + hd = 1
                L T_pre + L (n - 1) T_gen <= max_latency      (when given; FlexGen: "extended to include
                                                               latency constraints")
The terms and peaks are cost_model's `Linear` expressions, but for the staging buffers, a step function of the
placement (two device buffers of a GPU batch's cache rows as soon as any cache row is off the device, two of its
activation rows likewise: cost_model.Staging). The LP is solved once per side of each step (`_cases`): the cache
wholly on the device (cg = 1, no buffers) or not (buffers counted, plus half a row per GPU batch for the rounding
to whole rows), the same for the activations; the fastest case wins (the fewer buffers on a tie), so a plan never
moves a sliver of a tensor whose staging it cannot hold. Ties (e.g. I/O hidden under compute whatever the
placement) are broken by a second LP: at the optimal time, minimize the sum of every term (the time with no
overlap), which keeps data in the fastest tier that costs no throughput: the percentages stay intuitive.
"""

from __future__ import annotations

import math

import numpy as np

from ..arch import ModelArch
from ..errors import ConfigError
from . import rounding
from .cost_model import LINKS, TIERS, VARIABLES, CostModel, CostTerms, Prediction, evaluate
from .policy import Policy, human_bytes
from .profile import HardwareProfile
from .tiers import place_layers

NV = len(VARIABLES)                       # the nine fractions; then T_pre, T_gen
GROUPS = ((0, 1, 2), (3, 4, 5), (6, 7, 8))   # weights, cache, activations: (gpu, cpu, disk)
BUDGET_KEYS = {"device": "device_memory", "host": "host_memory", "disk": "disk_memory"}


class PlacementError(ConfigError):
    """No placement of this model fits the budgets (or meets max_latency); `tier` names what does not fit."""

    def __init__(self, message: str, tier: str, tiers: tuple = ()):
        super().__init__(message)
        self.tier = tier                  # device | host | disk | device+host+disk | max_latency
        self.tiers = tiers or (tier,)     # every tier whose budget alone, if larger, would make it fit


def solve_placement(arch: ModelArch, prompt_len: int, gen_len: int, gpu_batch_size: int, num_gpu_batches: int,
                    profile: HardwareProfile, max_latency: float | None = None, *, cpu_attention: bool | None = None,
                    schedule: str = "zigzag", prefetch_layers: int | None = None, dtype: str = "float32",
                    fixed: dict | None = None, quant_of=None, kv_format=None) -> tuple[Policy, Prediction]:
    """The best placement for one block shape: (the policy with rounded percentages, its prediction).

    prefetch_layers None: default_prefetch(profile).

    cpu_attention None: solve with and without CPU delegation and keep the faster (without, on a tie).
    fixed: Policy percentages to hold, e.g. {"cache_gpu": 100, "act_gpu": 100} (ZeRO-Inference keeps the cache
    and activations on the device); the LP places the rest.
    quant_of: which tensors are quantized (quant.storage.quant_of): their quantized bytes are what moves.
    kv_format: a quantized KV cache (quant.kv.KVFormat): its bytes are what the cache terms count and move.
    Raises PlacementError naming the tier that does not fit, or max_latency when only the latency does not.
    """
    prefetch_layers = default_prefetch(profile) if prefetch_layers is None else prefetch_layers
    model = CostModel(arch, prompt_len, gen_len, profile, dtype, quant_of, kv_format)
    bounds = _whole_layer_bounds(_bounds(fixed or {}, schedule), arch.num_layers)
    best, first_error, unplaced = None, None, None
    for cpu in _cpu_choices(cpu_attention, schedule):
        if cpu and cpu_attention is None and bounds[VARIABLES.index("cg")][0] > DELEGATED_CACHE_GPU_MAX:
            continue                                # auto, with the cache pinned to the device: nothing to delegate
        terms = model.terms(gpu_batch_size, num_gpu_batches, cpu, schedule, prefetch_layers)
        problems = [_case_problem(terms, profile, staged, case_bounds)
                    for cpu_bounds in _cache_bounds(bounds, cpu) for staged, case_bounds in _cases(terms, cpu_bounds)]
        problems = problems or [_Problem(terms, profile, bounds)]          # bounds that allow no case: infeasible
        for problem in problems:
            x = problem.solve(max_latency)
            if x is None:
                continue
            policy = _placed_policy(x, problem, max_latency, gpu_batch_size, num_gpu_batches, cpu, schedule,
                                    prefetch_layers)
            if policy is None:
                unplaced = unplaced or _unplaced_error(x, problem, gpu_batch_size, num_gpu_batches, cpu, schedule,
                                                       prefetch_layers)
                continue
            prediction = evaluate(problem.terms, policy, profile)
            if best is None or prediction.total_s < best[1].total_s * (1 - 1e-9):
                best = (policy, prediction)
        if best is None and first_error is None and unplaced is None:
            first_error = _diagnose(problems, max_latency, gpu_batch_size, num_gpu_batches)
    if best is None:
        raise first_error or unplaced
    return best


def _unplaced_error(x: np.ndarray, problem: "_Problem", b: int, k: int, cpu_attention: bool, schedule: str,
                    prefetch_layers: int) -> PlacementError:
    """The LP fits with a fraction of a layer, but no whole-layer placement near it does: name the tier the
    nearest one overflows."""
    L = problem.terms.num_layers
    counts = rounding.layer_splits(x, L)[0]
    g, c = rounding.weight_percents(counts, L)
    tidy = rounding.tidy
    policy = Policy(gpu_batch_size=b, num_gpu_batches=k, weights_gpu=tidy(g), weights_cpu=tidy(c),
                    cache_gpu=tidy(100 * x[3]), cache_cpu=tidy(min(100 * x[4], 100 - 100 * x[3])),
                    act_gpu=tidy(100 * x[6]), act_cpu=tidy(min(100 * x[7], 100 - 100 * x[6])),
                    cpu_attention=cpu_attention, prefetch_layers=prefetch_layers, schedule=schedule)
    pred = evaluate(problem.terms, policy, problem.profile)
    over = [t for t in TIERS if pred.peak[t] > pred.budget[t] + 0.5] or ["max_latency"]
    tier = over[0]
    what = f"needs {human_bytes(pred.peak[tier])} but {BUDGET_KEYS[tier]} is {human_bytes(pred.budget[tier])}" \
        if tier in BUDGET_KEYS else "misses max_latency"
    return PlacementError(f"does not fit in whole layers: gpu_batch_size={b} x num_gpu_batches={k} (block "
                          f"{b * k}) fits only with part of a layer on a tier (the runtime places whole layers); "
                          f"{counts[0]}/{counts[1]}/{counts[2]} layers on device/host/disk {what}", tier)


def default_prefetch(profile: HardwareProfile) -> int:
    """Layers to fetch ahead when the caller does not say: 1 where transfers overlap the compute (a GPU's copy
    engine), 0 where they share its cores (profile.overlap false, a NumPy-measured profile): there a prefetch
    thread only competes with the compute and its window holds a layer of device memory for nothing (measured:
    bench/results/offload-2026-11-26.md, prefetch 1 at 0.78-0.90x of prefetch 0 in every pair)."""
    return 1 if profile.overlap else 0


def search_policy(arch: ModelArch, prompt_len: int, gen_len: int, profile: HardwareProfile,
                  max_latency: float | None = None, *, gpu_batch_sizes=None, num_gpu_batches=None,
                  cpu_attention: bool | None = None, schedule: str = "zigzag", prefetch_layers: int | None = None,
                  dtype: str = "float32", fixed: dict | None = None,
                  quant_of=None, kv_format=None) -> tuple[Policy, Prediction, list[tuple[Policy, Prediction]]]:
    """FlexGen's two-level search: every (gpu_batch_size, num_gpu_batches) of the grid, the LP for each.

    gpu_batch_sizes: default powers of two 1 .. 1024 (stopping at the first size that fits in no way, as larger
    ones need more memory still); num_gpu_batches: default 1 .. 16 (FlexGen: "less than 20"); 1 only for the row
    schedule, which gains nothing from more (each GPU batch reloads the weights).
    Returns (best policy, its prediction, every feasible candidate as (policy, prediction), fastest first).
    Raises the PlacementError of the smallest block when nothing fits.
    """
    sizes = list(gpu_batch_sizes) if gpu_batch_sizes is not None else [2**i for i in range(11)]
    counts = list(num_gpu_batches) if num_gpu_batches is not None else list(range(1, 17))
    if schedule == "row" and num_gpu_batches is None:
        counts = [1]
    candidates, first_error = [], None
    for b in sorted(sizes):
        errors = []
        for k in sorted(counts):
            try:
                candidates.append(solve_placement(arch, prompt_len, gen_len, b, k, profile, max_latency,
                                                  cpu_attention=cpu_attention, schedule=schedule,
                                                  prefetch_layers=prefetch_layers, dtype=dtype, fixed=fixed,
                                                  quant_of=quant_of, kv_format=kv_format))
            except PlacementError as exc:
                errors.append(exc)
                first_error = first_error or exc
                if exc.tier != "max_latency":
                    break                              # more GPU batches only need more memory
        if errors and errors[0].tier == "device" and not any(p.gpu_batch_size == b for p, _ in candidates):
            break                                      # b fits in no way: a larger GPU batch needs more still
    if not candidates:
        raise first_error
    candidates.sort(key=lambda c: (-c[1].throughput, c[1].latency_s))
    best_policy, best_prediction = candidates[0]
    return best_policy, best_prediction, candidates


FIXABLE = {"weights_gpu": "wg", "weights_cpu": "wc", "weights_disk": "wd", "cache_gpu": "cg", "cache_cpu": "cc",
           "cache_disk": "cd", "act_gpu": "hg", "act_cpu": "hc", "act_disk": "hd"}


# What the runtime can hold (generate/schedules/zigzag.py): the KV cache and the activations on the device and in host
# memory, no disk share; the row schedule keeps both on the device (config refuses anything else there). The LP
# never places data elsewhere, so a `plan` result runs as printed.
RUNTIME_PINNED = {"cache_disk": 0.0, "act_disk": 0.0}
ROW_PINNED = {"cache_gpu": 100.0, "cache_cpu": 0.0, "act_gpu": 100.0, "act_cpu": 0.0}


def _bounds(fixed: dict, schedule: str = "zigzag") -> list:
    """Bounds of the nine fractions, fixed ones and RUNTIME_PINNED (and ROW_PINNED for the row schedule) pinned;
    ValueError naming an unknown key, a bad percentage, or one the runtime cannot honour."""
    pinned = {**RUNTIME_PINNED, **(ROW_PINNED if schedule == "row" else {})}
    bounds = [(0.0, 1.0)] * NV
    for key, percent in {**pinned, **fixed}.items():
        if key not in FIXABLE:
            raise ValueError(f"cannot fix {key!r}; fixable: {', '.join(FIXABLE)}")
        if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 <= percent <= 100:
            raise ValueError(f"{key} must be a percentage in [0, 100], got {percent!r}")
        if key in pinned and percent != pinned[key]:
            why = ("the row schedule keeps the KV cache and the activations on the device; use schedule zigzag"
                   if key in ROW_PINNED else "the KV cache and the activations have no disk tier")
            raise ValueError(f"{key} = {percent:g}: the runtime holds {key} = {pinned[key]:g} ({why})")
        i = VARIABLES.index(FIXABLE[key])
        bounds[i] = (percent / 100, percent / 100)
    return bounds


def _whole_layer_bounds(bounds: list, num_layers: int) -> list:
    """Pinned weight shares (--fix) moved to the whole layers the runtime would place for them
    (tiers.place_layers), so that the LP plans what runs."""
    L, (g, c, d) = num_layers, GROUPS[0]
    pinned = lambda i: bounds[i][0] == bounds[i][1]
    out = list(bounds)
    if pinned(g):
        n = place_layers(L, round(100 * bounds[g][0], 9), 0).count("device") / L
        out[g] = (n, n)
    if pinned(c):
        if pinned(g):
            n = place_layers(L, round(100 * bounds[g][0], 9), round(100 * bounds[c][0], 9)).count("host") / L
        else:
            n = round(L * bounds[c][0]) / L
        out[c] = (n, n)
    if pinned(d):
        n = round(L * bounds[d][0]) / L
        out[d] = (n, n)
    return out


def _cpu_choices(cpu_attention: bool | None, schedule: str) -> tuple:
    """The cpu_attention values to solve with: both when None (auto); the row schedule has no host cache."""
    if schedule == "row":
        if cpu_attention:
            raise ConfigError("cpu_attention = true with schedule = row: the row schedule keeps the KV cache on the "
                              "device, so there is no host cache to attend; use schedule zigzag")
        return (False,)
    return (False, True) if cpu_attention is None else (bool(cpu_attention),)


def _cases(terms: CostTerms, bounds: list) -> list:
    """The staging cases of the step terms (cost_model.Staging), as (names staged, bounds): for the cache and for
    the activations, either all of it on the device (no staging buffers) or some of it off the device (staging
    counted), each where the bounds allow it; the LP is solved for every combination and the best kept."""
    cases = [(frozenset(), bounds)]
    for part in terms.staging:
        g, offs = VARIABLES.index(part.gpu), [VARIABLES.index(v) for v in part.off_device]
        grown = []
        for staged, case in cases:
            if bounds[g][1] == 1.0 and all(case[i][0] == 0.0 for i in offs):     # all on the device: no buffers
                grown.append((staged, [(1.0, 1.0) if i == g else (0.0, 0.0) if i in offs else b
                                       for i, b in enumerate(case)]))
            if case[g][0] < 1.0 and any(case[i][1] > 0.0 for i in offs):         # rows off the device: staged
                grown.append((staged | {part.part}, case))
        cases = grown
    return cases


# With CPU attention the cache's device share stays below all of it: at cache_gpu = 100 there is nothing to
# delegate (the config refuses it; that is the plain policy, solved with cpu_attention = false).
DELEGATED_CACHE_GPU_MAX = 0.99


def _cache_bounds(bounds: list, cpu_attention: bool) -> list:
    """The bounds to solve with: CPU attention attends each row where it lies, device rows on the device and host
    rows on the host (generate/schedules/zigzag.py), so any split of the cache is its to choose, cache_gpu in [0, 1): the
    device share is capped at DELEGATED_CACHE_GPU_MAX. Where cache_gpu may be 0 the cache wholly on the host is
    solved as a case of its own too (no rows to round, so no rounding slack: _case_problem)."""
    cg = VARIABLES.index("cg")
    if not cpu_attention:
        return [bounds]
    if bounds[cg][0] > DELEGATED_CACHE_GPU_MAX:
        raise ValueError(f"cache_gpu >= {100 * bounds[cg][0]:g} with cpu_attention: CPU attention attends the "
                         f"cache rows in host memory, so it needs cache_gpu < 100 (at most "
                         f"{100 * DELEGATED_CACHE_GPU_MAX:g} here); solve without cpu_attention for a cache on the "
                         f"device")
    split = [[(lo, min(hi, DELEGATED_CACHE_GPU_MAX)) if i == cg else (lo, hi) for i, (lo, hi) in enumerate(bounds)]]
    host = [[(0.0, 0.0) if i == cg else b for i, b in enumerate(bounds)]] if bounds[cg][0] == 0 else []
    return host + split


def _case_problem(terms: CostTerms, profile: HardwareProfile, staged: frozenset, bounds: list) -> "_Problem":
    """The LP of one staging case; a part pinned wholly off the device has no rounding slack (no split rows)."""
    whole = frozenset(p.part for p in terms.staging if bounds[VARIABLES.index(p.gpu)][1] == 0.0)
    return _Problem(terms, profile, bounds, terms.memory_case(staged, whole))


# ---- the linear program ----------------------------------------------------------------------------------------

class _Problem:
    """The LP of one cost model (one block shape, one cpu_attention) and one staging case (its peak memory
    `memory`: tier -> Linear, CostTerms.memory_case), on one machine, some fractions pinned."""

    def __init__(self, terms: CostTerms, profile: HardwareProfile, bounds: list, memory: dict | None = None):
        self.terms, self.profile, self.bounds = terms, profile, bounds
        self.memory = memory if memory is not None else terms.memory_case(frozenset())

    def rows(self, max_latency: float | None, relax: frozenset = frozenset()):
        """A_ub, b_ub, A_eq, b_eq, bounds and the objective (11 variables), the tiers in `relax` dropped."""
        terms, profile = self.terms, self.profile
        L, n = terms.num_layers, terms.gen_len
        a_ub, b_ub = [], []
        for phase, col in ((terms.prefill, NV), (terms.decode, NV + 1)):
            parts = [phase[link] for link in LINKS]
            if not terms.overlap:
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                parts = [total]
            for term in parts:                          # term(x) - T <= 0, scaled to O(1)
                row = np.zeros(NV + 2)
                row[:NV] = term.coef
                row[col] = -1.0
                scale = max(1.0, float(np.abs(row).max()), abs(term.const))
                a_ub.append(row / scale)
                b_ub.append(-term.const / scale)
        for tier in TIERS:
            if tier in relax:
                continue
            mem = self.memory[tier]
            budget = float(getattr(profile, BUDGET_KEYS[tier]))
            row = np.zeros(NV + 2)
            row[:NV] = mem.coef
            scale = max(1.0, budget, float(np.abs(row).max()), abs(mem.const))
            a_ub.append(row / scale)
            b_ub.append((budget - mem.const) / scale)
        objective = np.zeros(NV + 2)
        objective[NV], objective[NV + 1] = L, L * (n - 1)
        if max_latency is not None:
            scale = max(1.0, float(max_latency))
            a_ub.append(objective / scale)
            b_ub.append(float(max_latency) / scale)
        a_eq = np.zeros((3, NV + 2))
        for i, group in enumerate(GROUPS):
            a_eq[i, list(group)] = 1.0
        bounds = list(self.bounds) + [(0.0, None)] * 2
        return np.array(a_ub), np.array(b_ub), a_eq, np.ones(3), bounds, objective

    def solve(self, max_latency: float | None, relax: frozenset = frozenset()) -> np.ndarray | None:
        """The optimal fractions (9,), or None when infeasible. Two stages: least time, then least traffic."""
        a_ub, b_ub, a_eq, b_eq, bounds, objective = self.rows(max_latency, relax)
        first = _linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
        if first.status == 2:
            return None
        if first.status != 0:
            raise RuntimeError(f"linprog failed: {first.message}")
        # Second stage: keep the optimal time (to a relative 1e-7), minimize the sum of all terms.
        terms, tie = self.terms, np.zeros(NV + 2)
        for phase, weight in ((terms.prefill, terms.num_layers),
                              (terms.decode, terms.num_layers * (terms.gen_len - 1))):
            for link in LINKS:
                tie[:NV] += weight * np.asarray(phase[link].coef)
        limit = first.fun * (1 + 1e-7) + 1e-12
        scale = max(1.0, limit)
        second = _linprog(tie, A_ub=np.vstack([a_ub, objective / scale]), b_ub=np.append(b_ub, limit / scale),
                          A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
        x = second.x if second.status == 0 else first.x
        return _clean(x[:NV])

    def least_memory(self, tier: str) -> float:
        """The least `tier` memory any placement needs while the other two tiers keep their budgets."""
        a_ub, b_ub, a_eq, b_eq, bounds, _ = self.rows(None, frozenset({tier}))
        objective = np.zeros(NV + 2)
        objective[:NV] = self.memory[tier].coef
        result = _linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
        return result.fun + self.memory[tier].const if result.status == 0 else math.inf

    def fastest(self) -> float:
        """Seconds per block of the fastest placement that fits, ignoring max_latency (inf: none fits)."""
        a_ub, b_ub, a_eq, b_eq, bounds, objective = self.rows(None)
        result = _linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
        return result.fun if result.status == 0 else math.inf


def _linprog(*args, **kwargs):
    """scipy.optimize.linprog. Every hpcinfer command imports this module (the CLI offers `plan`), only `plan` solves
    an LP, and scipy.optimize takes about 0.3 s to import: so it is imported here, on the first solve."""
    from scipy.optimize import linprog      # lazy: a heavy third-party import that only the planners need

    return linprog(*args, **kwargs)


def _diagnose(problems: list, max_latency: float | None, b: int, k: int) -> PlacementError:
    """Which constraint makes every staging case's LP infeasible: relax each tier's budget in turn (then
    max_latency); the least a tier needs is the least over the cases."""
    profile, memory = problems[0].profile, problems[0].memory
    shape = f"gpu_batch_size={b} x num_gpu_batches={k} (block {b * k})"
    solves = lambda relax: any(p.solve(None, relax) is not None for p in problems)
    if not solves(frozenset()):
        # Tiers whose budget alone stands in the way, the cheapest to grow first: disk, host, device.
        fixes = [t for t in reversed(TIERS) if solves(frozenset({t}))]
        if fixes:
            needs = {t: min(p.least_memory(t) for p in problems) for t in fixes}
            first, others = fixes[0], fixes[1:]
            message = (f"does not fit: the {first} tier needs at least {human_bytes(needs[first])} for {shape} "
                       f"(the rest offloaded as far as the other tiers allow) but {BUDGET_KEYS[first]} is "
                       f"{human_bytes(getattr(profile, BUDGET_KEYS[first]))}")
            if others:
                message += "; or else " + ", ".join(
                    f"{BUDGET_KEYS[t]} >= {human_bytes(needs[t])} (now "
                    f"{human_bytes(getattr(profile, BUDGET_KEYS[t]))})" for t in others)
            return PlacementError(message, first, tuple(fixes))
        zero = {v: 0.0 for v in VARIABLES}
        buffers = sum(memory[t](zero) for t in TIERS)
        data = memory["disk"]({v: (1.0 if v in ("wd", "cd", "hd") else 0.0) for v in VARIABLES})
        budgets = sum(getattr(profile, BUDGET_KEYS[t]) for t in TIERS)
        return PlacementError(
            f"does not fit: the weights, KV cache and activations of {shape} ({human_bytes(data)}) and the "
            f"working buffers ({human_bytes(buffers)}) exceed device + host + disk together "
            f"({human_bytes(budgets)})", "device+host+disk")
    fastest = min(p.fastest() for p in problems)
    return PlacementError(f"max_latency = {max_latency:g} s cannot be met by {shape}: the fastest placement "
                          f"that fits takes {fastest:.4g} s", "max_latency")


def _clean(x: np.ndarray) -> np.ndarray:
    """Clip solver noise and renormalize each triple to sum to 1."""
    x = np.where(np.abs(x) < 1e-9, 0.0, np.clip(x, 0.0, 1.0))
    for group in GROUPS:
        total = x[list(group)].sum()
        x[list(group)] = x[list(group)] / total if total > 0 else (1.0, 0.0, 0.0)
    return x


# ---- rounding to what the runtime holds and printable percentages ------------------------------------------------

def _placed_policy(x: np.ndarray, problem: _Problem, max_latency: float | None, b: int, k: int,
                   cpu_attention: bool, schedule: str, prefetch_layers: int) -> Policy | None:
    """The LP's fractions as a policy the runtime runs: the weights in whole layers (tiers.place_layers), checked
    against the budgets with the exact peak (CostTerms.peak: whole layers, whole rows, staging buffers). When no
    whole-layer split near the LP's fits with its cache and activations, the LP is solved again with the weights
    pinned to each split (the cache and activations free to give way). None: no whole-layer placement of this
    staging case fits."""
    policy = _rounded_policy(x, problem, max_latency, b, k, cpu_attention, schedule, prefetch_layers)
    if policy is not None:
        return policy
    L, best = problem.terms.num_layers, None
    for counts in rounding.layer_splits(x, L):
        bounds = list(problem.bounds)
        for i, n in zip(GROUPS[0], counts):
            if problem.bounds[i][0] <= n / L <= problem.bounds[i][1]:
                bounds[i] = (n / L, n / L)
        pinned = _Problem(problem.terms, problem.profile, bounds, problem.memory)
        y = pinned.solve(max_latency)
        if y is None:
            continue
        policy = _rounded_policy(y, pinned, max_latency, b, k, cpu_attention, schedule, prefetch_layers)
        if policy is not None:
            time = evaluate(problem.terms, policy, problem.profile).total_s
            if best is None or time < best[0] * (1 - 1e-9):
                best = (time, policy)
    return None if best is None else best[1]


def _rounded_policy(x: np.ndarray, problem: _Problem, max_latency: float | None, b: int, k: int,
                    cpu_attention: bool, schedule: str, prefetch_layers: int) -> Policy | None:
    """The weights in whole layers (each split of rounding.layer_splits), the cache and activation percentages as
    coarsely as still fits (and meets max_latency): whole percent, else 0.1, else 0.01, else exact. At each unit: the
    nearest (largest remainder); else the device shares rounded down (the host takes the difference); else the
    device and host shares rounded down (the disk takes it). None when nothing fits."""
    L = problem.terms.num_layers
    splits = [rounding.weight_percents(counts, L) for counts in rounding.layer_splits(x, L)]
    exact = [tuple(100.0 * float(x[i]) for i in group) for group in GROUPS[1:]]
    rules = (rounding.nearest, rounding.floor_gpu, rounding.floor_gpu_cpu)
    tries = [(rule, unit) for unit in (1.0, 0.1, 0.01) for rule in rules]
    for rule, unit in tries + [(None, None)]:
        if rule is None:                                 # exact shares: only trim float noise off the disk part
            triples = [(g, min(c, 100.0 - g), max(0.0, 100.0 - g - c)) for g, c, _ in exact]
        else:
            triples = [tuple(v * unit for v in rule(tuple(p / unit for p in t), round(100 / unit)))
                       for t in exact]
        best = None
        for weights_gpu, weights_cpu in splits:                  # the fastest split that fits (the nearest on a tie)
            policy = Policy(gpu_batch_size=b, num_gpu_batches=k,
                            weights_gpu=rounding.tidy(weights_gpu), weights_cpu=rounding.tidy(weights_cpu),
                            cache_gpu=rounding.tidy(triples[0][0]), cache_cpu=rounding.tidy(triples[0][1]),
                            act_gpu=rounding.tidy(triples[1][0]), act_cpu=rounding.tidy(triples[1][1]),
                            cpu_attention=cpu_attention, prefetch_layers=prefetch_layers, schedule=schedule)
            prediction = evaluate(problem.terms, policy, problem.profile)
            if rounding.keeps_pinned(policy, problem.bounds, L) and prediction.fits and (
                    max_latency is None or prediction.total_s <= max_latency) and (
                    best is None or prediction.total_s < best[0] * (1 - 1e-9)):
                best = (prediction.total_s, policy)
        if best is not None:
            return best[1]
    return None
