"""FlexGen's analytical cost model (Section 4.3 and Appendix A.3), per layer and per token step.

Notation (FlexGen Table 6, our names):  L = layers, s = prompt_len, n = gen_len, b = gpu_batch_size,
k = num_gpu_batches, B = b * k = block size (bls), isz = bytes per element of the dtype,
W = one layer's weight bytes, kv = bytes of one token's K and V in one layer, act = bytes of one token's hidden
state (D * isz), q = bytes of one token's query (the attention output has the same size).
Placement fractions (the LP's variables): wg wc wd (weights), cg cc cd (KV cache), hg hc hd (activations).
The cache fractions are of every GPU batch's (sequence, KV head) rows, as offload/zigzag.py holds them; the
runtime has no cache disk tier and keeps activations on the device, so lp.py pins cd = hd = hc = 0.

Every cost term is a `Linear` function of the nine fractions, so the same expressions give the prediction for a
policy (`predict`) and the rows of the linear program (lp.py). Per layer, for the whole block (FlexGen A.3):

  prefill, one layer, all B sequences of s tokens (Ap = B s act, Cp = B s kv):
    host_to_device  (wc + wd) W r + (hc + hd) Ap                 weights in, stored activations back
    device_to_host  (cc + cd) Cp + (hc + hd) Ap                  the new cache and the layer's output out
    disk_to_host    wd W r + hd Ap
    host_to_disk    cd Cp + hd Ap
    compute         k max(b (s f + f_head / L) / F_dev, W / BW_dev) + B 4 q' s^2 / F_dev
  decode, one layer, one token of all B sequences, averaged over the n - 1 steps: the cache holds s + n/2
  tokens on average (FlexGen's (s + n/2)); Ag = B act, Cg = B (s + n/2) kv, Cn = B kv, Q = B q:
    host_to_device  (wc + wd) W r + (hc + hd) Ag + (cc + cd) Cg   [no CPU attention: the host cache comes in]
                                                 + (cc + cd) Q    [CPU attention: the attention output comes in]
    device_to_host  (cc + cd) Cn + (hc + hd) Ag [+ (cc + cd) Q, CPU attention: the query goes out]
    disk_to_host    wd W r + hd Ag + cd Cg
    host_to_disk    cd Cn + hd Ag
    compute         k max(b (f + f_head / L) / F_dev, W / BW_dev)          linear layers, roofline per GPU batch
                    + (cg [+ cc + cd without CPU attention]) att_dev + [CPU attention] (cc + cd) att_host
                    att_dev = max(Cg / BW_dev, B (s + n/2) 4 q' / F_dev), att_host likewise with the host rates
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
    device  E + wg W L + (1 - wg) W (p + 1) + cg KV + hg A + (1 - hg) nb b s act
            + [no CPU attention] (1 - cg) nb b (s + n) kv + work(b)
    host    wc W L + wd W (p + 1) + cc KV + hc A + hd nb b s act + cd nb b (s + n) kv + [CPU attention] scores
    disk    wd W L + cd KV + hd A
  KV = B (s + n) kv L (zig-zag allocates the whole block's cache, FlexGen A.2), A = B s act (one layer boundary
  of the block); the row schedule finishes one GPU batch before starting the next, so there B = b in KV and A.
  p = prefetch_layers (streamed layers resident: current + prefetched), nb = 2 buffers of a GPU batch's streamed
  activations/cache (current and next) with prefetch, 1 without; work(b) = one GPU batch's transient tensors
  (qkv, scores or the MLP intermediate, the logits), FlexGen's qkv/att/mlp peak terms.
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

from ..model.arch import ModelArch, tensor_shapes
from .policy import Policy
from .sizes import kv_token_bytes, layer_bytes, table_bytes
from .profile import HardwareProfile

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
    kv_bytes: int                # K and V of one token in one layer (at the dtype, or the KV format's bytes)
    act_bytes: int               # one token's hidden state
    query_bytes: int             # one token's query (= its attention output)
    query_width: int             # H * hd
    heads: int
    flops_per_token: float       # f: matmul FLOPs of one token through the average layer
    head_flops: float            # f_head: the LM head for one token
    intermediate: int            # MLP width (gated MLPs count gate and up)
    vocab: int
    itemsize: int

    @classmethod
    def of(cls, arch: ModelArch, dtype: str = "float32", quant_of=None, kv_format=None) -> "ModelSizes":
        """Bytes as the runtime holds them on one rank (offload/sizes.py, the budget check's rule too); quant_of:
        which tensors are quantized (quant.storage.quant_of), so that the quantized bytes are what moves;
        kv_format: the quantized KV cache's quant.kv.KVFormat (None: K and V rows at the dtype, FlexGen's)."""
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
        layers = sum(layer_bytes(arch, i, isz, 1, quant_of) for i in range(L))
        tables = table_bytes(arch, True, True, isz, 1, quant_of)
        return cls(num_layers=L, layer_weight_bytes=layers / L, total_weight_bytes=layers + tables,
                   table_bytes=tables, kv_bytes=kv_token_bytes(arch, 1, kv_format, isz),
                   act_bytes=arch.hidden_size * isz, query_bytes=arch.q_size * isz, query_width=arch.q_size, heads=arch.num_heads,
                   flops_per_token=layer_flops / L, head_flops=2.0 * arch.vocab_size * arch.hidden_size,
                   intermediate=arch.intermediate_size * (2 if arch.gated_mlp else 1), vocab=arch.vocab_size,
                   itemsize=isz)


@dataclass(frozen=True)
class CostTerms:
    """The cost model of one (gpu_batch_size, num_gpu_batches, cpu_attention, schedule, prefetch) choice: every
    term linear in the placement fractions."""

    prefill: dict                # link -> Linear: seconds per layer for the block's prompts
    decode: dict                 # link -> Linear: seconds per layer for one token step of the block (average)
    memory: dict                 # tier -> Linear: peak bytes
    overlap: bool                # True: a layer costs its slowest term; False: the sum of its terms
    num_layers: int
    gen_len: int
    block_size: int

    def layer_time(self, terms: dict, fractions: dict) -> float:
        values = [terms[link](fractions) for link in LINKS]
        return max(values) if self.overlap else sum(values)


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
        return all(self.peak[t] <= self.budget[t] * (1 + 1e-6) + 1 for t in TIERS)    # the LP's tolerance

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
        Ap, Cp = B * s * z.act_bytes, B * s * z.kv_bytes
        linear_p = k * max(b * (s * z.flops_per_token + z.head_flops / L) / hw.device_flops,
                           W / hw.device_bandwidth)
        attn_p = B * 4.0 * z.query_width * s * s / hw.device_flops
        prefill = {
            "compute": lin(linear_p + attn_p),
            "host_to_device": lin(wc=W * reloads / hw.host_to_device, wd=W * reloads / hw.host_to_device,
                                  hc=Ap / hw.host_to_device, hd=Ap / hw.host_to_device),
            "device_to_host": lin(cc=Cp / hw.device_to_host, cd=Cp / hw.device_to_host,
                                  hc=Ap / hw.device_to_host, hd=Ap / hw.device_to_host),
            "disk_to_host": lin(wd=W * reloads / hw.disk_to_host, hd=Ap / hw.disk_to_host),
            "host_to_disk": lin(cd=Cp / hw.host_to_disk, hd=Ap / hw.host_to_disk),
        }

        # Decode: one layer, one token of each of the B sequences, the cache at its average length s + n/2.
        avg_len = s + n / 2
        Ag, Cg, Cn, Q = B * z.act_bytes, B * avg_len * z.kv_bytes, B * z.kv_bytes, B * z.query_bytes
        linear_g = k * max(b * (z.flops_per_token + z.head_flops / L) / hw.device_flops, W / hw.device_bandwidth)
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
        return CostTerms(prefill=prefill, decode=decode,
                         memory=self._memory(b, k, cpu_attention, prefetch_layers, schedule),
                         overlap=prefetch_layers >= 1, num_layers=L, gen_len=n, block_size=B)

    def _memory(self, b: int, k: int, cpu_attention: bool, prefetch_layers: int, schedule: str) -> dict:
        z, s, n = self.sizes, self.prompt_len, self.gen_len
        L, W = z.num_layers, z.layer_weight_bytes
        B = b if schedule == "row" else b * k                       # row: one GPU batch's cache and activations
        Wt, KV, A = W * L, B * (s + n) * z.kv_bytes * L, B * s * z.act_bytes      # Wt: the decoder layers
        resident = prefetch_layers + 1                              # streamed layers on the device at once
        buffers = 2 if prefetch_layers >= 1 else 1                  # a GPU batch's streamed inputs: now, next
        batch_act = buffers * b * s * z.act_bytes
        batch_cache = buffers * b * (s + n) * z.kv_bytes
        qkv = b * s * (2 * z.act_bytes + z.query_bytes + z.kv_bytes)
        widest = b * max(z.heads * s * s, s * z.intermediate) * z.itemsize
        work = qkv + widest + b * z.vocab * 4                       # + float32 logits of the GPU batch
        scores = b * z.heads * (s + n) * 4 if cpu_attention else 0  # host attention scratch (float32)
        lin = Linear.of
        device = lin(z.table_bytes + W * resident + batch_act + work + (0 if cpu_attention else batch_cache),
                     wg=Wt - W * resident, cg=KV - (0 if cpu_attention else batch_cache), hg=A - batch_act)
        host = lin(scores, wc=Wt, wd=W * resident, cc=KV, cd=batch_cache, hc=A, hd=batch_act)
        disk = lin(wd=Wt, cd=KV, hd=A)
        return {"device": device, "host": host, "disk": disk}

    def predict(self, policy: Policy) -> Prediction:
        """Time, throughput, latency and peak memory per tier of running one block under `policy`."""
        terms = self.terms(policy.gpu_batch_size, policy.num_gpu_batches, policy.cpu_attention,
                           policy.schedule, policy.prefetch_layers)
        return evaluate(terms, policy, self.profile)


def evaluate(terms: CostTerms, policy: Policy, profile: HardwareProfile) -> Prediction:
    x = policy.fractions()
    L, n = terms.num_layers, terms.gen_len
    return Prediction(
        policy=policy,
        prefill_s=L * terms.layer_time(terms.prefill, x),
        decode_s=L * (n - 1) * terms.layer_time(terms.decode, x),
        peak={tier: terms.memory[tier](x) for tier in TIERS},
        budget={"device": profile.device_memory, "host": profile.host_memory, "disk": profile.disk_memory},
        prefill_terms={link: terms.prefill[link](x) for link in LINKS},
        decode_terms={link: terms.decode[link](x) for link in LINKS},
        gen_len=n)
