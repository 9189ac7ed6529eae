"""FlexGen's analytical cost model (Section 4.3 and Appendix A.3), per layer and per token step.

Notation (FlexGen Table 6, our names):  L = layers, s = prompt_len, n = gen_len, b = gpu_batch_size,
k = num_gpu_batches, B = b * k = block size (bls), isz = bytes per element of the dtype,
W = one layer's weight bytes, kv = bytes of one token's K and V in one layer, act = bytes of one token's hidden
state (D * 4: float32, as the runtime computes it whatever the dtype), q = bytes of one token's query (the
attention output has the same size).
Placement fractions (the LP's variables): wg wc wd (weights), cg cc cd (KV cache), hg hc hd (activations).
The cache fractions are of every GPU batch's (sequence, KV head) rows, the activation fractions of its hidden-
state rows (tokens), as generate/schedules/zigzag.py holds them; the runtime has no disk tier for either, so lp.py pins
cd = hd = 0 (and, for the row schedule, the cache and the activations on the device).

Every cost term is a `Linear` function of the nine fractions, so the same expressions give the prediction for a
policy (`predict`) and the rows of the linear program (lp.py). Per layer, for the whole block (FlexGen A.3):

  prefill, one layer, all B sequences of s tokens (Ap = B s act (L + 1) / L, Cp = B s kv, Qp = B s q):
    host_to_device  (wc + wd) W r + (hc + hd) Ap                 weights in, stored activations back
                                 [+ (cc + cd) Qp, CPU attention: the host rows' outputs come in]
    device_to_host  (cc + cd) Cp + (hc + hd) Ap                  the new cache and the layer's output out
                                 [+ (cc + cd) Qp, CPU attention: the host rows' queries go out]
    disk_to_host    wd W r + hd Ap
    host_to_disk    cd Cp + hd Ap
    compute         k max(b (s f + f_head / L) / F_dev, W / BW_dev) + cg B 4 q' s^2 / F_dev
                    + (cc + cd) B 4 q' s^2 / F_host [CPU attention; F_dev without]
  decode, one layer, one token of all B sequences, averaged over the n - 1 steps: the cache holds s + n/2
  tokens on average (FlexGen's (s + n/2)); Ag = B act (L + 1) / L, Cg = B (s + n/2) kv, Cn = B kv, Q = B q
  (host activation rows are stored after and loaded before each of the L + 1 boundaries of a step: the embedding
  output, every layer's output; spread over the L layers):
    host_to_device  (wc + wd) W r + (hc + hd) Ag + (cc + cd) Cg   [no CPU attention: the host cache comes in]
                                                 + (cc + cd) Q    [CPU attention: the attention output comes in]
    device_to_host  (cc + cd) Cn + (hc + hd) Ag [+ (cc + cd) Q, CPU attention: the query goes out]
    disk_to_host    wd W r + hd Ag + cd Cg
    host_to_disk    cd Cn + hd Ag
    compute         k max(b (f + f_head / L) / F_dev, W / BW_dec)          linear layers, roofline per GPU batch
                    + (cg [+ cc + cd without CPU attention]) att_dev + [CPU attention] (cc + cd) att_host
                    att_dev = max(Cg / BW_dev, B (s + n/2) 4 q' / F_dev), att_host likewise with the host rates
  BW_dec = profile.decode_bandwidth: min(gemv_bandwidth, BW_dev), the weight-read rate of decode-shaped matmuls
  x [b, D] @ W that `hpcinfer profile` measures (BW_dev when the profile has none: presets, older files); a
  token step's linear layers are such matmuls, prefill's are not (they stay at BW_dev).
  r = 1 for the zig-zag block schedule (each layer's weights loaded once per block, FlexGen Section 4.2), r = k
  for the row schedule (ZeRO-Inference, Accelerate: loaded again for every GPU batch).
  f = FLOPs of one token through one layer's matmuls (2 per weight a token touches: MoE experts by top_k / E),
  f_head = 2 V D (the LM head, once per sequence per step, spread over the layers), q' = query width (H hd).

Overlap (FlexGen's T_pre = max(ctog, gtoc, dtoc, ctod, comp), Algorithm 1 with its six logical threads): with
prefetch_layers >= 1 a layer costs the slowest of the five terms; with prefetch_layers = 0 (no overlap) their sum.
Totals (FlexGen Section 4.3): time = L T_pre + L (n - 1) T_gen for the block; throughput = B n / time
(generated tokens over prefill + decode time, FlexGen's metric); latency = time (every sequence of the block
finishes with the last step).

Peak memory per tier (FlexGen A.3's "home" plus working-set terms; the prefill peak, which is the larger):
    device  E + wg W L + (1 - wg) W (p + 1) + cg KV + hg A + work(b)
            + [cc + cd > 0, no CPU attention] 2 b (s + n) kv + [hc + hd > 0] 2 b s act      (staging: a step)
    host    wc W L + wd W (p + 1) + cc KV + hc A + hd 2 b s act + cd 2 b (s + n) kv
            + [CPU attention] (cc + cd) scores   (host attention scratch: b (s + n) (H 4 [+ Hkv 2 hd 4, quantized]))
    disk    wd W L + cd KV + hd A
  KV = B (s + n) kv L (zig-zag allocates the whole block's cache, FlexGen A.2), A = B s act (one layer boundary
  of the block); the row schedule finishes one GPU batch before starting the next, so there B = b in KV and A.
  p = prefetch_layers (streamed layers resident: current + prefetched); work(b) = one GPU batch's transient
  tensors (qkv, scores or the MLP intermediate, the logits), FlexGen's qkv/att/mlp peak terms.
  With CPU attention the cache may be split too: every row attends where it lies (device rows on the device,
  host rows on the host), so each attention term above goes with its share, cg at the device's rates and
  cc + cd at the host's, and only the host share's q and outputs cross: all linear in the fractions.
  Staging (`Staging`, what generate/schedules/zigzag.py allocates): as soon as ANY cache row of a GPU batch is off the device
  (and attention is not delegated) the runtime holds two device buffers of one layer of a GPU batch's cache (one loading while the other
  computes), whatever the prefetch depth, and likewise two [b s, D] buffers for the activations; none while that
  part is wholly on the device. A step function, not linear: `CostTerms.peak` (the prediction) counts it exactly,
  with each share rounded to whole rows per GPU batch as sizes.device_rows rounds it, and lp.py solves the LP on
  each side of each step (`CostTerms.memory_case`, which adds half a row per GPU batch as a bound on the rounding).
Weights at layer granularity: W is the average decoder layer; E, the embedding tables (token and position
tables, final norm, LM head), stays on the device, as the runtime keeps it (offload/sizes.py counts both the
same way as the budget check). Quantized weights (quant_of) count, and move, their quantized bytes; so does a
quantized KV cache (kv_format, `[model] kv_cache`): kv is then offload/sizes.kv_token_bytes, the packed values +
float16 scale and minimum per group of each K and V row (int4 at head_dim 64: 36 bytes a row instead of 128 at
float16), and every cache term above (traffic, attention reads, peak memory) shrinks with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..arch import ModelArch, tensor_shapes
from .policy import Policy
from .profile import HardwareProfile
from .sizes import ACT_ITEMSIZE, device_rows, kv_token_bytes, layer_bytes, table_bytes
from .tiers import place_layers

VARIABLES = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")
LINKS = ("compute", "host_to_device", "device_to_host", "disk_to_host", "host_to_disk")
TIERS = ("device", "host", "disk")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Linear:
    """const + sum(coef[i] * x[i]) over the nine placement fractions (VARIABLES order)."""

    coef: tuple = (0.0,) * len(VARIABLES)
    const: float = 0.0

    @classmethod
    def of(cls, const: float = 0.0, **coef: float) -> "Linear":
        unknown = set(coef) - set(VARIABLES)
        if unknown:
            raise KeyError(f"not placement variables: {sorted(unknown)}")
        return cls(tuple(float(coef.get(v, 0.0)) for v in VARIABLES), float(const))

    def __add__(self, other: "Linear") -> "Linear":
        return Linear(tuple(a + b for a, b in zip(self.coef, other.coef)), self.const + other.const)

    def __mul__(self, scale: float) -> "Linear":
        return Linear(tuple(a * scale for a in self.coef), self.const * scale)

    __rmul__ = __mul__

    def __call__(self, fractions: dict) -> float:
        return self.const + sum(c * fractions[v] for c, v in zip(self.coef, VARIABLES))


@dataclass(frozen=True)
class ModelSizes:
    """What the cost model needs of an architecture, in bytes and FLOPs (per layer: the average layer)."""

    num_layers: int
    layer_weight_bytes: float    # W: weights of the average decoder layer (what streams)
    total_weight_bytes: int      # every weight: the layers and the embedding tables
    table_bytes: int             # token and position tables, final norm, LM head: always on the device
    kv_bytes: int                # K and V of one token in one layer as the runtime holds them: float32 rows
                                 # whatever the weights' dtype (generate/kv_cache.py, both backends), or the KV
                                 # format's bytes (sizes.kv_token_bytes, the budget check's rule)
    act_bytes: int               # one token's hidden state, float32 as the runtime computes it (sizes.ACT_ITEMSIZE)
    query_bytes: int             # one token's query (= its attention output), float32 likewise
    query_width: int             # H * hd
    heads: int
    flops_per_token: float       # f: matmul FLOPs of one token through the average layer
    head_flops: float            # f_head: the LM head for one token
    intermediate: int            # MLP width (gated MLPs count gate and up)
    vocab: int
    itemsize: int
    kv_heads: int = 1            # Hkv: a GPU batch's cache is b Hkv rows (sequence, KV head) per layer
    kv_dequant_bytes: int = 0    # a quantized cache: float32 K and V of one token and KV head, which host
                                 # attention dequantizes into scratch (2 hd 4); 0 for a float32 cache
    layers: tuple = ()           # bytes of each decoder layer (the exact peak places whole layers: tiers.place_layers)

    @classmethod
    def of(cls, arch: ModelArch, dtype: str = "float32", quant_of=None, kv_format=None) -> "ModelSizes":
        """Bytes as the runtime holds them on one rank (offload/sizes.py, the budget check's rule too); quant_of:
        which tensors are quantized (quant.storage.quant_of), so that the quantized bytes are what moves;
        kv_format: the quantized KV cache's quant.kv.KVFormat (None: float32 K and V rows, as the runtime allocates
        them whatever `dtype` is; FlexGen counts its fp16 cache at the dtype, which the runtime does not hold)."""
        if dtype not in ITEMSIZE:
            raise ValueError(f"dtype must be one of {', '.join(ITEMSIZE)}, got {dtype!r}")
        isz = ITEMSIZE[dtype]
        layer_flops = 0.0
        for name, shape in tensor_shapes(arch).items():
            if name.startswith("layers."):
                numel = math.prod(shape)
                if ".moe.experts." in name:             # a token visits top_k of the layer's experts
                    numel = numel * arch.moe_top_k / shape[0]
                layer_flops += 2.0 * numel
        L = arch.num_layers
        each = tuple(layer_bytes(arch, i, isz, 1, quant_of) for i in range(L))
        layers = sum(each)
        tables = table_bytes(arch, True, True, isz, 1, quant_of)
        return cls(num_layers=L, layer_weight_bytes=layers / L, total_weight_bytes=layers + tables,
                   table_bytes=tables, kv_bytes=kv_token_bytes(arch, 1, kv_format),
                   act_bytes=arch.hidden_size * ACT_ITEMSIZE, query_bytes=arch.q_size * ACT_ITEMSIZE,
                   query_width=arch.q_size, heads=arch.num_heads,
                   flops_per_token=layer_flops / L, head_flops=2.0 * arch.vocab_size * arch.hidden_size,
                   intermediate=arch.intermediate_size * (2 if arch.gated_mlp else 1), vocab=arch.vocab_size,
                   itemsize=isz, kv_heads=arch.num_kv_heads, layers=each,
                   kv_dequant_bytes=0 if kv_format is None else 2 * arch.head_dim * ACT_ITEMSIZE)


@dataclass(frozen=True)
class Staging:
    """The step term of one kind of tensor placed by rows (the KV cache, the activations), as generate/schedules/zigzag.py
    holds it: of each of the `groups` GPU batches' `rows` rows, device_rows(rows, gpu %) stay on the device (the
    nearest whole row) and the rest live in host memory; as soon as ANY row is off the device the runtime holds
    two device staging buffers of one GPU batch's rows (`buffers` bytes: 0 when CPU attention reads the host cache
    in place). A step function of the placement, so the LP solves the two sides as separate cases (lp.py)."""

    part: str                    # "cache" | "act"
    gpu: str                     # its device fraction: "cg" | "hg"
    off_device: tuple            # its other fractions: ("cc", "cd") | ("hc", "hd")
    rows: int                    # rows of one GPU batch: b Hkv (cache) | b s (activations of the prefill step)
    groups: int                  # GPU batches holding their own rows: k (zig-zag) | 1 (row)
    row_bytes: float             # bytes of one row: all layers of a (sequence, KV head) | one token's hidden state
    buffers: float               # device bytes of the two staging buffers

    def staged(self, x: dict) -> bool:
        """Any row off the device: the staging buffers exist."""
        return any(x[v] > 0 for v in self.off_device)

    @property
    def slack(self) -> float:
        """Half a row in every GPU batch: how far the nearest whole row can be from a fraction's share (the LP,
        which solves with fractions, counts it on the device and on the host while staged)."""
        return 0.5 * self.groups * self.row_bytes

    def whole_rows(self, x: dict) -> dict:
        """x with this part's device share rounded to whole rows as the runtime rounds it (sizes.device_rows);
        the off-device fractions share the rest in their proportions."""
        if self.rows < 1:
            return x
        gpu = device_rows(self.rows, round(100 * x[self.gpu], 9)) / self.rows
        off = sum(x[v] for v in self.off_device)
        rest = {v: (1 - gpu) * (x[v] / off if off > 0 else (1.0 if i == 0 else 0.0))
                for i, v in enumerate(self.off_device)}
        return {**x, self.gpu: gpu, **rest}


def whole_layers(x: dict, num_layers: int) -> dict:
    """x with the weight shares rounded to whole layers exactly as the runtime places them (tiers.place_layers:
    round(L wg) layers on the device, then round(L (wg + wc)) - that in host memory, the rest on disk)."""
    tiers = layer_tiers(x, num_layers)
    return {**x, "wg": tiers.count("device") / num_layers, "wc": tiers.count("host") / num_layers,
            "wd": tiers.count("disk") / num_layers}


def layer_tiers(x: dict, num_layers: int) -> list:
    """The tier of each decoder layer under the weight shares of x (tiers.place_layers)."""
    return place_layers(num_layers, round(100 * x["wg"], 9), round(100 * x["wc"], 9))


@dataclass(frozen=True)
class CostTerms:
    """The cost model of one (gpu_batch_size, num_gpu_batches, cpu_attention, schedule, prefetch) choice: every
    term linear in the placement fractions, but for the staging buffers (`staging`), a step function."""

    prefill: dict                # link -> Linear: seconds per layer for the block's prompts
    decode: dict                 # link -> Linear: seconds per layer for one token step of the block (average)
    memory: dict                 # tier -> Linear: peak bytes, without the staging buffers
    overlap: bool                # True: a layer costs its slowest term; False: the sum of its terms
    num_layers: int
    gen_len: int
    block_size: int
    staging: tuple = ()          # Staging of the cache and of the activations
    weights: dict = field(default_factory=dict)    # tier -> Linear: the weights' part of `memory` (average layer)
    layers: tuple = ()           # bytes of each decoder layer: the exact weights of `peak` (whole layers)
    resident: int = 1            # streamed layers on the device at once (prefetch_layers + 1)
    transient: dict = field(default_factory=dict)  # tier -> bytes of `peak` the runtime's budget check does not
                                                   # count (work(b); disk: see peak)

    def layer_time(self, terms: dict, fractions: dict) -> float:
        values = [terms[link](fractions) for link in LINKS]
        return max(values) if self.overlap else sum(values)

    def uncounted(self, fractions: dict) -> dict:
        """tier -> bytes of `peak` that budget.plan_bytes does not count: `transient`, and on the host the streaming
        window of disk layers (`resident` copies of the largest). peak - uncounted is the runtime's plan."""
        x = self.placed(fractions)
        disk = [b for b, t in zip(self.layers, layer_tiers(x, self.num_layers)) if t == "disk"]
        out = {tier: self.transient.get(tier, 0) for tier in TIERS}
        out["host"] += self.resident * max(disk, default=0)
        return out

    def placed(self, fractions: dict) -> dict:
        """The fractions as the runtime holds them: weights in whole layers (tiers.place_layers), the cache and
        the activations in whole rows per GPU batch (sizes.device_rows)."""
        x = whole_layers(fractions, self.num_layers)
        for part in self.staging:
            x = part.whole_rows(x)
        return x

    def peak(self, fractions: dict) -> dict:
        """Peak bytes per tier exactly as the runtime holds them: whole layers (their own bytes: the first
        round(L wg) layers resident, a window of `resident` copies of the largest streamed layer), whole rows per
        GPU batch, and the staging buffers of each part with any row off the device. The device and host figures
        are budget.plan_bytes' plus `transient` (budget.check_budgets does not count it); the host's includes the
        `resident` largest disk layers staged through host memory (transient too)."""
        x = self.placed(fractions)
        peak = {tier: self.memory[tier](x) for tier in TIERS}
        if self.layers and self.weights:
            tiers = layer_tiers(x, self.num_layers)
            on = lambda tier: [b for b, t in zip(self.layers, tiers) if t == tier]
            streamed, disk = on("host") + on("disk"), on("disk")
            exact = {"device": sum(on("device")) + self.resident * max(streamed, default=0),
                     "host": sum(on("host")) + self.resident * max(disk, default=0), "disk": sum(disk)}
            for tier in TIERS:
                peak[tier] += exact[tier] - self.weights[tier](x)
        peak["device"] += sum(part.buffers for part in self.staging if part.staged(x))
        return peak

    def device_bytes(self, part: str, fractions: dict) -> float:
        """Device bytes of the cache ("cache") or the activations ("act") under `fractions`: the rows the runtime
        keeps there and, with any row off the device, its staging buffers (what budget.kv_plan_bytes counts)."""
        stage = next(s for s in self.staging if s.part == part)
        x = stage.whole_rows(fractions)
        coef = self.memory["device"].coef[VARIABLES.index(stage.gpu)]
        return coef * x[stage.gpu] + (stage.buffers if stage.staged(x) else 0.0)

    def memory_case(self, staged: frozenset, whole: frozenset = frozenset()) -> dict:
        """tier -> Linear for the LP case where the parts named in `staged` have rows off the device (the others
        all on it): their staging buffers on the device, and half a row per GPU batch on the device and on the
        host (an upper bound on the runtime's rounding to whole rows) unless the part is in `whole` (pinned
        wholly off the device: no rows to round)."""
        extra = {tier: 0.0 for tier in TIERS}
        for part in self.staging:
            if part.part in staged:
                slack = 0.0 if part.part in whole else part.slack
                extra["device"] += part.buffers + slack
                extra["host"] += slack
        return {tier: self.memory[tier] + Linear.of(extra[tier]) for tier in TIERS}


@dataclass(frozen=True)
class Prediction:
    """The cost model's answer for one policy."""

    policy: Policy
    prefill_s: float             # L T_pre
    decode_s: float              # L (n - 1) T_gen
    peak: dict                   # tier -> bytes
    budget: dict                 # tier -> bytes available
    prefill_terms: dict = field(repr=False)      # link -> seconds per layer
    decode_terms: dict = field(repr=False)
    gen_len: int = 0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def latency_s(self) -> float:
        """Every sequence of the block finishes with the block's last step."""
        return self.total_s

    @property
    def throughput(self) -> float:
        """Generated tokens per second: B n / (prefill + decode), FlexGen's metric."""
        return self.policy.block_size * self.gen_len / self.total_s if self.total_s > 0 else float("inf")

    @property
    def fits(self) -> bool:
        return all(self.peak[t] <= self.budget[t] + 0.5 for t in TIERS)     # the runtime: whole bytes, no slack

    @property
    def bottleneck(self) -> str:
        """The slowest term of the phase that takes longer, e.g. 'decode: disk_to_host'."""
        phase, terms = ("prefill", self.prefill_terms) if self.prefill_s >= self.decode_s else \
            ("decode", self.decode_terms)
        return f"{phase}: {max(terms, key=terms.get)}"


class CostModel:
    """FlexGen's cost model for one model, workload and machine."""

    def __init__(self, arch: ModelArch, prompt_len: int, gen_len: int, profile: HardwareProfile,
                 dtype: str = "float32", quant_of=None, kv_format=None):
        if prompt_len < 1 or gen_len < 1:
            raise ValueError(f"prompt_len and gen_len must be >= 1, got {prompt_len} and {gen_len}")
        self.arch, self.prompt_len, self.gen_len, self.profile = arch, prompt_len, gen_len, profile
        self.sizes = ModelSizes.of(arch, dtype, quant_of, kv_format)
        self.dtype = dtype

    def terms(self, gpu_batch_size: int, num_gpu_batches: int, cpu_attention: bool = False,
              schedule: str = "zigzag", prefetch_layers: int = 1) -> CostTerms:
        z, hw = self.sizes, self.profile
        s, n, b, k = self.prompt_len, self.gen_len, gpu_batch_size, num_gpu_batches
        B, L, W = b * k, z.num_layers, z.layer_weight_bytes
        reloads = k if schedule == "row" else 1                       # r: weight loads per layer per step
        cpu = 1.0 if cpu_attention else 0.0
        lin = Linear.of

        # Prefill: one layer, the B prompts of s tokens.
        boundaries = (L + 1) / L        # hidden states stored and loaded a step: the embedding output, each layer's
        Ap, Cp = B * s * z.act_bytes * boundaries, B * s * z.kv_bytes
        linear_p = k * max(b * (s * z.flops_per_token + z.head_flops / L) / hw.device_flops,
                           W / hw.device_bandwidth)
        attn_p = B * 4.0 * z.query_width * s * s / hw.device_flops
        attn_p_host = B * 4.0 * z.query_width * s * s / hw.host_flops if cpu_attention else attn_p
        Qp = cpu * B * s * z.query_bytes                      # CPU attention: host rows' q down, outputs up
        prefill = {
            "compute": lin(linear_p, cg=attn_p, cc=attn_p_host, cd=attn_p_host),
            "host_to_device": lin(wc=W * reloads / hw.host_to_device, wd=W * reloads / hw.host_to_device,
                                  hc=Ap / hw.host_to_device, hd=Ap / hw.host_to_device,
                                  cc=Qp / hw.host_to_device, cd=Qp / hw.host_to_device),
            "device_to_host": lin(cc=(Cp + Qp) / hw.device_to_host, cd=(Cp + Qp) / hw.device_to_host,
                                  hc=Ap / hw.device_to_host, hd=Ap / hw.device_to_host),
            "disk_to_host": lin(wd=W * reloads / hw.disk_to_host, hd=Ap / hw.disk_to_host),
            "host_to_disk": lin(cd=Cp / hw.host_to_disk, hd=Ap / hw.host_to_disk),
        }

        # Decode: one layer, one token of each of the B sequences, the cache at its average length s + n/2.
        avg_len = s + n / 2
        Ag, Cg, Cn, Q = B * z.act_bytes * boundaries, B * avg_len * z.kv_bytes, B * z.kv_bytes, B * z.query_bytes
        # a token step's matmuls are x [b, D] @ W: small-batch, their weights read at the profile's decode rate
        linear_g = k * max(b * (z.flops_per_token + z.head_flops / L) / hw.device_flops, W / hw.decode_bandwidth)
        attn_flops = B * avg_len * 4.0 * z.query_width
        att_dev = max(Cg / hw.device_bandwidth, attn_flops / hw.device_flops)
        att_host = max(Cg / hw.host_bandwidth, attn_flops / hw.host_flops)
        host_cache_in = Q if cpu_attention else Cg                    # what crosses the link per host-cache byte
        decode = {
            "compute": lin(linear_g, cg=att_dev, cc=att_host if cpu_attention else att_dev,
                           cd=att_host if cpu_attention else att_dev),
            "host_to_device": lin(wc=W * reloads / hw.host_to_device, wd=W * reloads / hw.host_to_device,
                                  hc=Ag / hw.host_to_device, hd=Ag / hw.host_to_device,
                                  cc=host_cache_in / hw.host_to_device, cd=host_cache_in / hw.host_to_device),
            "device_to_host": lin(cc=(Cn + cpu * Q) / hw.device_to_host, cd=(Cn + cpu * Q) / hw.device_to_host,
                                  hc=Ag / hw.device_to_host, hd=Ag / hw.device_to_host),
            "disk_to_host": lin(wd=W * reloads / hw.disk_to_host, hd=Ag / hw.disk_to_host,
                                cd=Cg / hw.disk_to_host),
            "host_to_disk": lin(cd=Cn / hw.host_to_disk, hd=Ag / hw.host_to_disk),
        }
        memory, staging, weights, transient = self._memory(b, k, cpu_attention, prefetch_layers, schedule)
        # Overlap needs both a prefetch window and a machine whose transfers run beside its compute (a GPU's copy
        # engine); on the NumPy backend a transfer is a memcpy on the compute cores and the KV / activation
        # copies are synchronous, so the terms add (HardwareProfile.overlap False).
        return CostTerms(prefill=prefill, decode=decode, memory=memory,
                         overlap=prefetch_layers >= 1 and hw.overlap, num_layers=L, gen_len=n, block_size=B,
                         staging=staging, weights=weights, layers=z.layers, resident=prefetch_layers + 1,
                         transient=transient)

    def _memory(self, b: int, k: int, cpu_attention: bool, prefetch_layers: int, schedule: str) -> tuple:
        """(tier -> Linear peak bytes without the staging buffers, (the cache's and the activations' Staging),
        tier -> Linear: the weights' part of the peak, tier -> bytes the runtime's budget does not count)."""
        z, s, n = self.sizes, self.prompt_len, self.gen_len
        L, W = z.num_layers, z.layer_weight_bytes
        groups = 1 if schedule == "row" else k                      # row: one GPU batch's cache and activations
        B = b * groups
        Wt, KV, A = W * L, B * (s + n) * z.kv_bytes * L, B * s * z.act_bytes      # Wt: the decoder layers
        resident = prefetch_layers + 1                              # streamed layers on the device at once
        batch_act = 2 * b * s * z.act_bytes                         # two staging buffers [b s, D] (zigzag.py)
        batch_cache = 2 * b * (s + n) * z.kv_bytes                  # two of one layer's b Hkv rows (HostKV)
        qkv = b * s * (2 * z.act_bytes + z.query_bytes + z.kv_bytes)
        widest = b * max(z.heads * s * s, s * z.intermediate) * ACT_ITEMSIZE    # float32, as computed
        work = qkv + widest + b * z.vocab * 4                       # + float32 logits of the GPU batch
        # host attention scratch (budget.host_attention_bytes): float32 scores of a GPU batch's host rows and, for a
        # quantized cache, their dequantized K and V: in proportion to the host share of the rows
        scores = b * (s + n) * (z.heads * 4 + z.kv_heads * z.kv_dequant_bytes) if cpu_attention else 0
        lin = Linear.of
        Wmax = max(z.layers, default=W)                             # the streaming window holds the largest
        weights = {"device": lin(Wmax * resident, wg=Wt - Wmax * resident), "host": lin(wc=Wt, wd=Wmax * resident),
                   "disk": lin(wd=Wt)}
        device = weights["device"] + lin(z.table_bytes + work, cg=KV, hg=A)
        host = weights["host"] + lin(cc=KV + scores, cd=batch_cache + scores, hc=A, hd=batch_act)
        disk = weights["disk"] + lin(cd=KV, hd=A)
        staging = (Staging("cache", "cg", ("cc", "cd"), rows=b * z.kv_heads, groups=groups,
                           row_bytes=(s + n) * z.kv_bytes * L / z.kv_heads,
                           buffers=0.0 if cpu_attention else batch_cache),
                   Staging("act", "hg", ("hc", "hd"), rows=b * s, groups=groups, row_bytes=z.act_bytes,
                           buffers=batch_act))
        transient = {"device": work, "host": 0, "disk": 0}
        return {"device": device, "host": host, "disk": disk}, staging, weights, transient

    def predict(self, policy: Policy) -> Prediction:
        """Time, throughput, latency and peak memory per tier of running one block under `policy`."""
        terms = self.terms(policy.gpu_batch_size, policy.num_gpu_batches, policy.cpu_attention,
                           policy.schedule, policy.prefetch_layers)
        return evaluate(terms, policy, self.profile)


def evaluate(terms: CostTerms, policy: Policy, profile: HardwareProfile) -> Prediction:
    """The prediction for `policy` as the runtime holds it: its weights in whole layers (tiers.place_layers) for
    the times and the peaks alike, its cache and activations in whole rows for the peaks."""
    x = whole_layers(policy.fractions(), terms.num_layers)
    L, n = terms.num_layers, terms.gen_len
    return Prediction(
        policy=policy,
        prefill_s=L * terms.layer_time(terms.prefill, x),
        decode_s=L * (n - 1) * terms.layer_time(terms.decode, x),
        peak=terms.peak(x),
        budget={"device": profile.device_memory, "host": profile.host_memory, "disk": profile.disk_memory},
        prefill_terms={link: terms.prefill[link](x) for link in LINKS},
        decode_terms={link: terms.decode[link](x) for link in LINKS},
        gen_len=n)
