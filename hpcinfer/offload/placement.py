"""Where `[offload]` may put each kind of tensor: the placement rules, stated once for the two places that apply
them, the config check (config._check_offload and the `[offload]` keys' own checks) and the planner's Policy
(offload/policy.py). Each words its errors for its reader (a config key with its file, or a Policy field).

Placement is three pairs of percentages (weights, KV cache, activations), each a share of the whole on the device
and in host memory; the disk tier holds the rest of each pair, so a pair sums to at most 100. The runtime holds the
KV cache and the activations on the device and in host memory only (no disk share: their pairs fill 100): the
config refuses anything else and the placement LP (lp.RUNTIME_PINNED) never proposes it; Policy, FlexGen's
general form, allows it. Imports nothing of hpcinfer, so config.py can use it from below everything.
"""

from __future__ import annotations

PAIRS = (("weights_gpu", "weights_cpu"), ("cache_gpu", "cache_cpu"), ("act_gpu", "act_cpu"))   # (device, host)
PERCENT_KEYS = tuple(key for pair in PAIRS for key in pair)
SCHEDULES = ("row", "zigzag")    # row: ZeRO-Inference / Accelerate; zigzag: FlexGen's block schedule
PERCENT_RULE = "must be a percentage in [0, 100]"
TOLERANCE = 1e-6                 # percent: sums of percentages computed in floating point (the planner's, the LP's)


def is_percent(value) -> bool:
    """A placement percentage: a number (not a bool) in [0, 100]."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= 100


def over_100(device: float, host: float) -> bool:
    """A pair that leaves the disk a negative share."""
    return device + host > 100 + TOLERANCE


def fills_100(device: float, host: float) -> bool:
    """A pair with nothing on disk (what the runtime needs of the KV cache and the activations)."""
    return abs(device + host - 100) <= TOLERANCE
