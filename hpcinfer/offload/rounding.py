"""Rounding the LP's continuous placement to what the runtime holds and to printable percentages: the weights in
whole layers (offload/tiers.place_layers places the first round(L p / 100) layers on a tier), the cache and
activation shares in whole units summing to 100 (lp._rounded_policy tries whole percent, then 0.1, then 0.01).

x: the LP's fractions in cost_model.VARIABLES order; a triple: (gpu, cpu, disk) shares of one tensor kind."""

from __future__ import annotations

import math

import numpy as np

from .cost_model import VARIABLES, whole_layers
from .policy import Policy
from .tiers import place_layers

WEIGHTS = (0, 1, 2)                       # the weights' (gpu, cpu, disk) fractions in x


def layer_splits(x: np.ndarray, num_layers: int) -> list:
    """Whole-layer (device, host, disk) counts near the LP's weight shares, the nearest first (largest remainder):
    the device count and the device + host count each rounded up, down, or one further down (a layer moved to the
    next tier down when the rounding does not fit)."""
    L = num_layers
    g, gc = float(x[WEIGHTS[0]]) * L, float(x[WEIGHTS[0]] + x[WEIGHTS[1]]) * L
    near = lambda v: (math.ceil(v - 1e-9), math.floor(v + 1e-9), math.floor(v + 1e-9) - 1)
    splits = [nearest(tuple(float(x[i]) * L for i in WEIGHTS), L)]
    for n_dev in near(g):
        for n_cum in near(gc):
            counts = (n_dev, n_cum - n_dev, L - n_cum)
            if 0 <= n_dev <= n_cum <= L and counts not in splits:
                splits.append(counts)
    return splits


def layer_percent(count: int, num_layers: int) -> float:
    """A percentage that places `count` of `num_layers` layers (round(L p / 100) == count, tiers.place_layers):
    the whole percent nearest count / L, else count / L to 2 decimals, else exact."""
    exact = 100 * count / num_layers
    for p in sorted(range(101), key=lambda p: (abs(p - exact), p))[:3]:
        if round(num_layers * p / 100) == count:
            return p
    p = round(exact, 2)
    return p if round(num_layers * p / 100) == count else exact


def weight_percents(counts: tuple, num_layers: int) -> tuple:
    """(weights_gpu, weights_cpu) that tiers.place_layers turns back into `counts` (device, host, disk) layers."""
    g = layer_percent(counts[0], num_layers)
    gc = layer_percent(counts[0] + counts[1], num_layers)
    c = round(gc - g, 9)
    tiers = place_layers(num_layers, g, c)
    if (tiers.count("device"), tiers.count("host")) != counts[:2]:           # float noise in gc - g: exact shares
        g, c = 100 * counts[0] / num_layers, 100 * counts[1] / num_layers
    return g, c


def tidy(percent: float) -> float:
    """A whole percentage as an int (prints as 20, not 20.0); others rounded off float noise."""
    value = round(float(percent), 9)
    return int(value) if value == int(value) else value


def keeps_pinned(policy: Policy, bounds: list, num_layers: int) -> bool:
    """The rounded policy still holds every pinned fraction (the weights' as the layers it places)."""
    x = whole_layers(policy.fractions(), num_layers)
    return all(lo != hi or abs(x[v] - lo) < 1e-9 for v, (lo, hi) in zip(VARIABLES, bounds))


def nearest(triple: tuple, total: int) -> tuple:
    """Whole units summing to `total`, by largest remainder."""
    floors = [math.floor(v + 1e-9) for v in triple]
    order = sorted(range(3), key=lambda i: triple[i] - floors[i], reverse=True)
    for i in order[:max(0, total - sum(floors))]:
        floors[i] += 1
    return tuple(floors)


def floor_gpu(triple: tuple, total: int) -> tuple:
    """The device share rounded down, the disk share to the nearest, the host share the rest."""
    g = math.floor(triple[0] + 1e-9)
    d = min(round(triple[2]), total - g)
    return g, total - g - d, d


def floor_gpu_cpu(triple: tuple, total: int) -> tuple:
    g = math.floor(triple[0] + 1e-9)
    c = min(math.floor(triple[1] + 1e-9), total - g)
    return g, c, total - g - c
