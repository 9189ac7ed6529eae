"""The analytic model of one inference step: a prompt step and a token step of a layout on a machine.

Per layer and micro-batch on one rank (m sequences of a replica, T new tokens each, attending to c positions):
  compute   = max(FLOPs / device_flops, bytes / device_bandwidth)        roofline: the slower of the two, no sum
      FLOPs = 2 t (dense params / tp) + 4 t c q / tp  [+ experts]        t = m T tokens, q = H hd
      bytes = isz (dense params / tp) + m c kv_bytes / tp  [+ experts]   weights read once per micro-batch
              a token step's weights (its matmuls are x [m, D] @ W) count device_bandwidth / decode_bandwidth
              bytes each: read at the profile's small-batch rate (offload/profile.HardwareProfile.decode_bandwidth)
              (quantized matrices and a quantized KV cache at their packed bytes: Workload.quant_of, kv_format)
      experts (MoE layer): N = token-choices reaching the stage's experts = dp t k (PCC) or dp tp t k (flat and
      hierarchical send every tp rank's replicated tokens); a rank computes N / ep of them on its 1 / expert_tp
      slice and reads the weights of the experts that get at least one token: (E / ep)(1 - (1 - 1 / E)^N).
  comm      = tp all-reduces of t D isz bytes (after attention, after a dense MLP) + the MoE dispatch and combine
              (comm_cost.all_to_all, message counts from comm/all_to_all.message_stats)
A stage costs the sum over its layers (parallel/stages.partition_layers; the LM head on the last stage); the
pipeline runs at the pace of the slowest stage, plus one send of t D isz bytes to the next stage.
Schedule (tests/helpers/pipeline_schedule.py, DeepSpeed Inference Fig. 3): prompt = (prompt_mb + pp - 1) stage steps; a token
step = max(gen_mb, pp) stage steps (fewer micro-batches than stages leave the pipeline idle: the bubble).

t=tokens  m=sequences per micro-batch  c=context  D=hidden  E=experts  k=top-k  isz=bytes per element
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

from ..arch import ModelArch, tensor_shapes
from ..offload.sizes import kv_token_bytes, tensor_bytes
from ..parallel.stages import layer_params
from ..quant.storage import is_quantizable
from .comm_cost import Links, all_reduce, all_to_all
from .layout import Layout, stages_of

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Workload:
    batch: int                   # B: sequences in flight over the whole job (split over the dp replicas)
    prompt_len: int              # P
    gen_len: int                 # G: tokens generated per sequence
    dtype: str = "float16"
    # tensor name -> (mode, group) for the weights held quantized (quant.storage.quant_of: `--quantize`, or a
    # quantized checkpoint's own), None when every weight is at the dtype
    quant_of: object = field(default=None, compare=False)
    kv_format: object = None     # quant.kv.KVFormat of a quantized KV cache (`--kv-cache`), None: K, V at the dtype

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def per_replica(self, dp: int) -> int:
        return math.ceil(self.batch / dp)

    def kv_token_bytes(self, arch, tp: int) -> float:
        """K and V of one token in one layer on one rank: 2 kv isz / tp, or the KV format's packed rows."""
        if self.kv_format is None:
            return 2 * arch.kv_size * self.itemsize / tp
        return kv_token_bytes(arch, tp, self.kv_format, self.itemsize)


def quantized_delta(arch, names: tuple, tp: int, work: Workload) -> float:
    """Bytes a rank holds of the quantized matrices among `names` less what it would hold of them at the dtype
    (isz numel / tp): <= 0, and 0 without quantization. What the runtime holds quantized is offload/sizes.py's
    rule (q, scale and min of each tp shard); norms, biases, routers and expert stacks stay float."""
    if work.quant_of is None:
        return 0.0
    return _quantized_delta(arch, names, tp, work.itemsize, work.quant_of)


@functools.lru_cache(maxsize=4096)
def _quantized_delta(arch, names: tuple, tp: int, isz: int, quant_of) -> float:
    shapes, delta = tensor_shapes(arch), 0.0
    for name in names:
        if is_quantizable(name) and quant_of(name) is not None:
            delta += tensor_bytes(arch, name, shapes[name], isz, tp, quant_of) - isz * math.prod(shapes[name]) / tp
    return delta


@functools.lru_cache(maxsize=1024)
def layer_matrices(arch, layer: int) -> tuple:
    """Names of layer `layer`'s tensors (quantized_delta picks the quantizable ones)."""
    return tuple(name for name in tensor_shapes(arch) if name.startswith(f"layers.{layer}."))


def head_bytes(arch, tp: int, work: Workload) -> float:
    """Bytes a rank reads of the LM head (its own, or the tied token table)."""
    name = "embed.tokens" if arch.tied_embeddings else "lm_head.weight"
    return work.itemsize * arch.vocab_size * arch.hidden_size / tp + quantized_delta(arch, (name,), tp, work)


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    prompt_s: float              # the whole batch's prompt phase (first token of every sequence)
    token_s: float               # one token step: time between two tokens of a sequence
    throughput: float            # generated tokens/s over the run: B G / (prompt + (G - 1) token step)
    bubble: float                # idle fraction of a stage during the token phase
    stage_compute_s: float       # a token step's slowest stage: compute (roofline) part
    stage_comm_s: float          # ... and its communication part
    memory: int = 0              # bytes on the fullest rank (memory.py; offloaded: the device peak of the plan)
    offload: object = None       # perf.offload.OffloadPlan when the layout streams weights (or KV) from the host


def _roofline(flops: float, nbytes: float, hw) -> float:
    return max(flops / hw.device_flops, nbytes / hw.device_bandwidth)


def weight_scale(hw, decode: bool) -> float:
    """Streaming-equivalent bytes per weight byte: device_bandwidth / decode_bandwidth in a token step (its
    matmuls are x [m, D] @ W, read at the profile's small-batch rate), 1 in a prompt step and without a
    gemv_bandwidth (exactly 1.0 then, so the roofline is the old one bit for bit)."""
    return hw.device_bandwidth / hw.decode_bandwidth if decode else 1.0


def dense_layer_params(arch: ModelArch, layer: int) -> int:
    """Matrix parameters of layer `layer` outside the experts (attention, a dense or PR-MoE residual MLP)."""
    experts = arch.experts_in(layer)
    mats = 3 if arch.gated_mlp else 2
    expert_params = experts * (arch.hidden_size * arch.expert_size * mats + arch.hidden_size) if experts else 0
    return layer_params(arch, layer) - expert_params


def experts_hit(local: float, experts: int, choices: float) -> float:
    """Expected experts of a rank's `local` ones that receive at least one of `choices` uniform token-choices."""
    return local * (1.0 - (1.0 - 1.0 / experts) ** choices)


def layer_time(arch, layer: int, layout: Layout, t: int, m: int, c: float, work: Workload, hw,
               links: Links, decode: bool = False) -> tuple[float, float]:
    """(compute s, comm s) of one layer for one micro-batch: t tokens of m sequences attending to c positions
    (decode: a token step, whose weights are read at hw.decode_bandwidth)."""
    D, tp, k, isz = arch.hidden_size, layout.tp, arch.moe_top_k, work.itemsize
    scale = weight_scale(hw, decode)                                                # weight byte -> streamed bytes
    dense = dense_layer_params(arch, layer) / tp
    flops = 2.0 * t * dense + 4.0 * t * c * arch.q_size / tp
    weights = isz * dense + quantized_delta(arch, layer_matrices(arch, layer), tp, work)
    nbytes = weights * scale + m * c * work.kv_token_bytes(arch, tp)                # weights + K, V read
    comm = all_reduce(t * D * isz, tp, links.intra)                                   # attention output
    experts = arch.experts_in(layer)
    if not experts or arch.moe_residual:
        comm += all_reduce(t * D * isz, tp, links.intra)                              # dense MLP output
    if experts:
        pcc = layout.all_to_all.startswith("pcc")
        choices = layout.dp * t * k * (1 if pcc else tp)                              # N
        expert = D * arch.expert_size * (3 if arch.gated_mlp else 2) / layout.expert_tp
        flops += 2.0 * choices / layout.ep * expert + 2.0 * t * D * experts
        nbytes += isz * expert * experts_hit(experts / layout.ep, experts, choices) * scale
        p = layout.stage_ranks
        rows_per_pair = t * k * layout.expert_tp / p                                  # flat model: rows a peer
        comm += all_to_all(layout.all_to_all, p, layout.stage_ranks_per_node, tp, rows_per_pair, D * isz, links)
    return _roofline(flops, nbytes, hw), comm


def stage_time(arch, layout: Layout, layers: range, last: bool, t: int, m: int, c: float, work: Workload, hw,
               links: Links, decode: bool = False) -> tuple[float, float]:
    """(compute s, comm s) of one pipeline stage for one micro-batch (the LM head on the last stage, for the m
    sequences' last positions)."""
    compute = comm = 0.0
    kinds = Counter(arch.experts_in(layer) for layer in layers)       # layers of one expert count cost the same
    for experts, count in kinds.items():
        layer = next(i for i in layers if arch.experts_in(i) == experts)
        a, b = layer_time(arch, layer, layout, t, m, c, work, hw, links, decode)
        compute, comm = compute + count * a, comm + count * b
    if last:
        head = arch.vocab_size * arch.hidden_size / layout.tp
        compute += _roofline(2.0 * m * head, head_bytes(arch, layout.tp, work) * weight_scale(hw, decode), hw)
    return compute, comm


def slowest_stage(arch, layout: Layout, t: int, m: int, c: float, work: Workload, hw, links: Links,
                  decode: bool = False) -> tuple:
    """(compute s, comm s) of the stage with the largest total, plus the send to the next stage."""
    isz = work.itemsize
    stages = stages_of(arch, layout.pp)
    times = [stage_time(arch, layout, s.layers, s.is_last, t, m, c, work, hw, links, decode) for s in stages]
    compute, comm = max(times, key=sum)
    if layout.pp > 1:
        comm += links.pick(layout.stage_ranks >= layout.ranks_per_node).send(t * arch.hidden_size * isz)
    return compute, comm


def predict(arch: ModelArch, layout: Layout, work: Workload, hw) -> Prediction:
    """Prompt phase, token step and throughput of `layout` (docs/planner.md)."""
    links = Links.of(hw)
    b = work.per_replica(layout.dp)
    pmb, gmb, pp = layout.prompt_micro_batches, layout.gen_micro_batches, layout.pp
    mp, mg = math.ceil(b / pmb), math.ceil(b / gmb)                                    # sequences a micro-batch
    prompt = sum(slowest_stage(arch, layout, mp * work.prompt_len, mp, work.prompt_len, work, hw, links))
    context = work.prompt_len + work.gen_len / 2                                       # the cache's average length
    g_compute, g_comm = slowest_stage(arch, layout, mg, mg, context, work, hw, links, decode=True)
    prompt_s = (pmb + pp - 1) * prompt
    token_s = max(gmb, pp) * (g_compute + g_comm)
    total = prompt_s + (work.gen_len - 1) * token_s
    return Prediction(layout=layout, prompt_s=prompt_s, token_s=token_s,
                      throughput=work.batch * work.gen_len / total, bubble=1.0 - gmb / max(gmb, pp),
                      stage_compute_s=g_compute, stage_comm_s=g_comm)
