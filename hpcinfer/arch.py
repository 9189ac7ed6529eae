"""One decoder architecture, described by features rather than by family.

A family (GPT-2, OPT, GPT-NeoX, Llama) is only a choice of these features; the converters fill them in and the
checkpoint stores them as root attributes (see docs/checkpoint-format.md). It sits at the bottom of the package and
imports nothing of it: checkpoint/, quant/, offload/, perf/ and model/ all describe models with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
GATE_NORMALIZE = ("topk", "none")
NORM_POSITIONS = ("pre", "post")


@dataclass(frozen=True)
class ModelArch:
    family: str                  # informational: gpt2 | opt | gpt_neox | llama | ...
    vocab_size: int              # V
    hidden_size: int             # D
    num_layers: int              # L
    num_heads: int               # H (query heads)
    num_kv_heads: int            # Hkv (== H for multi-head, < H for grouped-query attention)
    head_dim: int                # hd (usually D / H)
    intermediate_size: int       # F (MLP hidden width)
    max_positions: int           # longest sequence the model supports (prompt + generated)
    norm: str = "layernorm"      # layernorm | rmsnorm
    norm_eps: float = 1e-5
    position: str = "learned"    # learned (a [P, D] table) | rotary
    rotary_dim: int = 0          # rotated dims per head (== head_dim for full rotary, less for partial)
    rope_theta: float = 10000.0
    activation: str = "gelu"     # gelu (erf) | gelu_tanh | relu | silu
    gated_mlp: bool = False      # down(act(gate(x)) * up(x)) instead of down(act(up(x)))
    parallel_residual: bool = False  # x + attn(n1(x)) + mlp(n2(x)) instead of sequential
    qkv_bias: bool = False
    out_bias: bool = False       # bias of the attention output projection
    mlp_bias: bool = False
    tied_embeddings: bool = False  # LM head reuses the token embedding
    bos_token_id: int = -1       # -1: none
    eos_token_ids: tuple = field(default=())
    # Mixture of experts: moe_experts[i] experts in layer i (0: a dense layer); empty: a dense model.
    moe_experts: tuple = field(default=())
    moe_top_k: int = 1
    moe_normalize: str = "topk"  # topk: softmax, top-k, renormalize (Mixtral) | none: raw gate probabilities
    moe_capacity_factor: float = 0.0   # > 0: per-expert capacity ceil(T / E * factor), extra tokens dropped
    moe_min_capacity: int = 4
    moe_intermediate_size: int = 0     # expert FFN width; 0: intermediate_size
    moe_residual: bool = False   # PR-MoE: a dense MLP beside the experts, mixed by a learned 2-way coefficient
    # Encoders (BERT family, docs/embed.md): bidirectional attention, no LM head and no final norm.
    causal: bool = True          # false: an encoder (every token sees its whole sequence)
    norm_position: str = "pre"   # pre: x + f(norm(x)) | post: norm(x + f(x)) (BERT)
    type_vocab_size: int = 0     # rows of the token-type table embed.token_types (0: none)
    embed_norm: bool = False     # a LayerNorm (embed.norm) after the summed embeddings
    pooler: bool = False         # pooler.weight [D, D] + bias: tanh(dense(x[CLS]))

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.norm not in NORMS:
            problems.append(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.position not in POSITIONS:
            problems.append(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.position == "rotary" and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            problems.append(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.norm_position not in NORM_POSITIONS:
            problems.append(f"norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}")
        if not self.causal and self.moe_experts:
            problems.append("an encoder (causal = false) has no MoE layers")
        problems += self._moe_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _moe_problems(self) -> list:
        if not self.moe_experts:
            return []
        problems = []
        if len(self.moe_experts) != self.num_layers:
            problems.append(f"moe_experts has {len(self.moe_experts)} entries for {self.num_layers} layers")
        if any(e < 0 for e in self.moe_experts) or not any(self.moe_experts):
            problems.append(f"moe_experts must be >= 0 with at least one MoE layer, got {list(self.moe_experts)}")
        smallest = min((e for e in self.moe_experts if e), default=0)
        if not 1 <= self.moe_top_k <= max(smallest, 1):
            problems.append(f"moe_top_k = {self.moe_top_k} must be in [1, {smallest}] (the fewest experts in a layer)")
        if self.moe_normalize not in GATE_NORMALIZE:
            problems.append(f"moe_normalize must be one of {GATE_NORMALIZE}, got {self.moe_normalize!r}")
        if self.moe_capacity_factor < 0:
            problems.append(f"moe_capacity_factor must be >= 0, got {self.moe_capacity_factor}")
        return problems

    def experts_in(self, layer: int) -> int:
        """Experts of layer `layer` (0: a dense MLP layer)."""
        return self.moe_experts[layer] if self.moe_experts else 0

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_encoder(self) -> bool:
        return not self.causal

    @property
    def has_norm_bias(self) -> bool:
        return self.norm == "layernorm"

    def to_attrs(self) -> dict:
        attrs = dataclasses.asdict(self)
        for name in ("eos_token_ids", "moe_experts"):
            attrs[name] = list(getattr(self, name))
        return attrs

    @classmethod
    def from_attrs(cls, attrs) -> "ModelArch":
        """Build from HDF5 root attributes (numpy scalars and arrays); unknown attributes are ignored."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in attrs:
                continue
            value = attrs[f.name]
            if f.type == "tuple":
                kwargs[f.name] = tuple(int(v) for v in list(value))
            elif f.type == "int":
                kwargs[f.name] = int(value)
            elif f.type == "float":
                kwargs[f.name] = float(value)
            elif f.type == "bool":
                kwargs[f.name] = bool(value)
            else:
                kwargs[f.name] = str(value)
        return cls(**kwargs)

    def param_count(self) -> int:
        """Parameters stored in the checkpoint (the tied LM head counted once)."""
        return sum(_numel(shape) for shape in tensor_shapes(self).values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> stored shape. Each matrix is stored with its tensor-parallel split dimension
    first, so that a shard is a contiguous block of rows: column-parallel [out, in], row-parallel [in, out]."""
    D, F, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed.tokens": (V, D)}
    if arch.position == "learned":
        shapes["embed.positions"] = (arch.max_positions, D)
    shapes.update(_encoder_embedding_shapes(arch))
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        for norm in ("attn_norm", "mlp_norm"):
            shapes[p + norm + ".weight"] = (D,)
            if arch.has_norm_bias:
                shapes[p + norm + ".bias"] = (D,)
        for proj, size in (("q", arch.q_size), ("k", arch.kv_size), ("v", arch.kv_size)):
            shapes[p + f"attn.{proj}.weight"] = (size, D)
            if arch.qkv_bias:
                shapes[p + f"attn.{proj}.bias"] = (size,)
        shapes[p + "attn.o.weight"] = (arch.q_size, D)
        if arch.out_bias:
            shapes[p + "attn.o.bias"] = (D,)
        experts = arch.experts_in(i)
        if not experts or arch.moe_residual:
            shapes.update(_mlp_shapes(arch, p + "mlp.", (), F))
        if experts:
            shapes[p + "moe.router.weight"] = (experts, D)
            shapes.update(_mlp_shapes(arch, p + "moe.experts.", (experts,), arch.expert_size))
            if arch.moe_residual:
                shapes[p + "moe.coef.weight"] = (2, D)
                shapes[p + "moe.coef.bias"] = (2,)
    if arch.is_encoder:
        return shapes                        # no final norm, no LM head (the pooler is an embedding part)
    shapes["final_norm.weight"] = (D,)
    if arch.has_norm_bias:
        shapes["final_norm.bias"] = (D,)
    if not arch.tied_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _encoder_embedding_shapes(arch: ModelArch) -> dict:
    """Token-type table, embedding LayerNorm and pooler (BERT family); empty for decoders."""
    D, shapes = arch.hidden_size, {}
    if arch.type_vocab_size:
        shapes["embed.token_types"] = (arch.type_vocab_size, D)
    if arch.embed_norm:
        shapes["embed.norm.weight"] = (D,)
        shapes["embed.norm.bias"] = (D,)
    if arch.pooler:
        shapes["pooler.weight"] = (D, D)                  # [out, in], replicated
        shapes["pooler.bias"] = (D,)
    return shapes


def _mlp_shapes(arch: ModelArch, prefix: str, lead: tuple, F: int) -> dict:
    """An MLP's tensors (`lead` = (E,) for a stack of experts): up (and gate) [F, D] = [out, in] column-parallel,
    down [F, D] = [in, out] row-parallel."""
    D = arch.hidden_size
    shapes = {}
    for proj in ("gate", "up") if arch.gated_mlp else ("up",):
        shapes[prefix + f"{proj}.weight"] = (*lead, F, D)
        if arch.mlp_bias:
            shapes[prefix + f"{proj}.bias"] = (*lead, F)
    shapes[prefix + "down.weight"] = (*lead, F, D)
    if arch.mlp_bias:
        shapes[prefix + "down.bias"] = (*lead, D)
    return shapes
