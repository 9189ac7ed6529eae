"""Presets: the papers' model shapes with random weights, made on each rank on demand (docs/presets.md).

`[model] preset = "ds-moe-1.3b-128"` (instead of `checkpoint`) opens a `PresetSource`: the reading interface of
`checkpoint.format.Checkpoint` (arch, dtype, path, read, read_slab, shape, tokenizer_json, tokenizer_attrs, close)
over weights that exist nowhere. A rank draws only the elements of its own shard, so a 175B or a 2T-parameter
model costs each rank only its share, and no file is read.

Every element has one value, whatever slice asks for it, so ranks of different layouts agree (tp = 2 and tp = 8
hold the same model): a tensor is one stream of the PCG64 generator seeded by (seed, tensor name), its element at
flat index p is the p-th int16 of that stream (four per 64-bit draw), and a read jumps to its first element with
PCG64.advance (O(log p)), then draws exactly the elements it returns (plus at most 3 skipped).

Values: a random matrix is uniform with mean 0 and standard deviation `std` (several times cheaper to draw than a
normal: about 1 ns a value against 13): std = 1 / sqrt(fan_in) for projections (q, k, v, o, up, gate, down,
router, the PR-MoE coefficient, an untied LM head), so that activations keep their scale through any number of
layers; 0.02 for the token and position embeddings (GPT-2's init); norm weights are ones and every bias is zero.
For scaling and throughput runs only: the tokens are meaningless.
"""

from __future__ import annotations

import json
import math

import numpy as np

from ..arch import ModelArch, tensor_shapes
from ..errors import ConfigError

EMBED_STD = 0.02
_DRAWS_PER_BLOCK = 1 << 18          # 64-bit draws per block (1 Mi values): bounds the scratch memory of a read


# ---- the presets ---------------------------------------------------------------------------------------------

def _gpt2_like(vocab: int, hidden: int, layers: int, heads: int, positions: int, family: str = "gpt2",
               **features) -> ModelArch:
    """GPT-2 / GPT-3 style: learned positions, LayerNorm, GELU (tanh), biases everywhere, tied LM head, F = 4D."""
    base = dict(family=family, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=4 * hidden, max_positions=positions,
                norm="layernorm", position="learned", activation="gelu_tanh", qkv_bias=True, out_bias=True,
                mlp_bias=True, tied_embeddings=True)
    base.update(features)
    return ModelArch(**base)


def _every_other(layers: int, experts: int) -> tuple:
    """DeepSpeed-MoE's expert_interval = 2: layers 2, 4, ... counting from 1 (0-based odd layers) are MoE."""
    return tuple(experts if i % 2 == 1 else 0 for i in range(layers))


def _pyramid(layers: int, small: int, large: int, large_layers: int = 2) -> tuple:
    """PR-MoE's pyramid as DeepSpeed-MoE runs it (`--num-experts 64 64 64 64 64 64 64 64 64 64 128 128` for
    1.3B+PR-MoE-64/128): every other layer is MoE, the last `large_layers` MoE layers with `large` experts, the
    others with `small`."""
    moe_layers = [i for i in range(layers) if i % 2 == 1]
    big = set(moe_layers[-large_layers:])
    return tuple((large if i in big else small) if i in moe_layers else 0 for i in range(layers))


def _ds_moe(hidden: int, layers: int, heads: int, experts: tuple, residual: bool = False,
            vocab: int = 50257, positions: int = 2048) -> ModelArch:
    """DeepSpeed-MoE GPT (Megatron-DeepSpeed): GPT-3 style base with erf GELU, top-1 gating with the raw gate
    probability, capacity factor 1.0 (min capacity 4, DeepSpeed's default); PR-MoE adds the residual MLP."""
    return _gpt2_like(vocab, hidden, layers, heads, positions, family="deepspeed_moe", activation="gelu",
                      moe_experts=experts, moe_top_k=1, moe_normalize="none", moe_capacity_factor=1.0,
                      moe_min_capacity=4, moe_residual=residual)


def _build_presets() -> dict[str, ModelArch]:
    p: dict[str, ModelArch] = {}
    # DeepSpeed Inference, Table I (dense): layers, hidden and heads from the table; features from each family.
    p["gpt2-1.5b"] = _gpt2_like(50257, 1600, 48, 25, 1024)
    p["gpt-neo-2.7b"] = _gpt2_like(50257, 2560, 32, 20, 2048, family="gpt_neo", qkv_bias=False)
    p["gpt-j-6b"] = _gpt2_like(50400, 4096, 28, 32, 2048, family="gptj", position="rotary", rotary_dim=64,
                               parallel_residual=True, qkv_bias=False, out_bias=False, tied_embeddings=False)
    p["gpt-13b"] = _gpt2_like(50257, 5120, 40, 40, 2048)
    p["gpt-neox-20b"] = _gpt2_like(50432, 6144, 44, 64, 2048, family="gpt_neox", position="rotary",
                                   rotary_dim=96 // 4, parallel_residual=True, activation="gelu",
                                   tied_embeddings=False)
    p["gpt-50b"] = _gpt2_like(50257, 8192, 62, 64, 2048)
    p["gpt-87b"] = _gpt2_like(50257, 12288, 48, 96, 2048)
    p["lm-175b"] = _gpt2_like(50257, 12288, 96, 96, 2048)
    p["lm-530b"] = _gpt2_like(50257, 20480, 105, 128, 2048)
    # DeepSpeed-MoE Table 1 (the bases of the MoE models): 350M+MoE-128 and its PR-MoE-32/64.
    p["ds-moe-350m-128"] = _ds_moe(1024, 24, 16, _every_other(24, 128))
    p["ds-prmoe-350m-32-64"] = _ds_moe(1024, 24, 16, _pyramid(24, 32, 64), residual=True)
    # DeepSpeed Inference, Table II (sparse) = DeepSpeed-MoE Table 6; 128 experts in every other layer. The table
    # prints 30 layers for 8B and 40 for 24B: swapped, as the nominal sizes show (docs/presets.md).
    for size, hidden, layers, heads in (("1.3b", 2048, 24, 16), ("2.4b", 3584, 16, 28), ("8b", 4096, 40, 32),
                                        ("24b", 8192, 30, 64), ("47b", 8192, 58, 64)):
        p[f"ds-moe-{size}-128"] = _ds_moe(hidden, layers, heads, _every_other(layers, 128))
        p[f"ds-prmoe-{size}-64-128"] = _ds_moe(hidden, layers, heads, _pyramid(layers, 64, 128), residual=True)
    # Tiny shapes for tests and demos (vocabulary 256, 128 positions).
    p["tiny-dense"] = _gpt2_like(256, 64, 4, 4, 128, family="tiny")
    p["tiny-moe"] = _ds_moe(64, 4, 4, _every_other(4, 8), vocab=256, positions=128)
    p["tiny-prmoe"] = _ds_moe(64, 4, 4, (0, 4, 0, 8), residual=True, vocab=256, positions=128)
    # tiny-moe with 256 positions: DeepSpeed Inference's MoE latency setting (prompt 128 + 100 generated) fits.
    p["tiny-moe-256"] = _ds_moe(64, 4, 4, _every_other(4, 8), vocab=256, positions=256)
    # Small shapes that run on a 2-core machine in minutes: GPT-2 small, and a DeepSpeed-MoE GPT of 8 layers of 512
    # with 8 experts in every other layer (the layout planner's check against measurements, docs/planner.md).
    p["gpt2-124m"] = _gpt2_like(50257, 768, 12, 12, 1024)
    p["moe-small-8"] = _ds_moe(512, 8, 8, _every_other(8, 8), vocab=8192, positions=256)
    return p


PRESETS: dict[str, ModelArch] = _build_presets()

# Where each preset comes from: (source, nominal size in billions of parameters, or None).
SOURCES: dict[str, tuple[str, float | None]] = {
    "gpt2-1.5b": ("DS-Inference Table I: GPT-2", 1.5),
    "gpt-neo-2.7b": ("DS-Inference Table I: GPT-Neo", 2.7),
    "gpt-j-6b": ("DS-Inference Table I: GPT-J", 6.0),
    "gpt-13b": ("DS-Inference Table I: GPT-13B", 13.0),
    "gpt-neox-20b": ("DS-Inference Table I: GPT-NeoX", 20.0),
    "gpt-50b": ("DS-Inference Table I: GPT-50B", 50.0),
    "gpt-87b": ("DS-Inference Table I: GPT-87B", 87.0),
    "lm-175b": ("DS-Inference Table I: LM-175B", 175.0),
    "lm-530b": ("DS-Inference Table I: LM-530B", 530.0),
    "ds-moe-350m-128": ("DS-MoE Table 1: 350M+MoE-128", 13.0),
    "ds-prmoe-350m-32-64": ("DS-MoE Table 1: 350M+PR-MoE-32/64", 4.0),
    "ds-moe-1.3b-128": ("DS-Inference Table II: 1.3B+MoE-128", 52.0),
    "ds-prmoe-1.3b-64-128": ("DS-MoE Table 1: 1.3B+PR-MoE-64/128", 31.0),
    "ds-moe-2.4b-128": ("DS-Inference Table II: 2.4B+MoE-128", 107.7),
    "ds-prmoe-2.4b-64-128": ("PR-MoE-64/128 of 2.4B+MoE-128 (assumed)", None),
    "ds-moe-8b-128": ("DS-Inference Table II: 8B+MoE-128", 349.0),
    "ds-prmoe-8b-64-128": ("PR-MoE-64/128 of 8B+MoE-128 (assumed)", None),
    "ds-moe-24b-128": ("DS-Inference Table II: 24B+MoE-128", 1064.9),
    "ds-prmoe-24b-64-128": ("PR-MoE-64/128 of 24B+MoE-128 (assumed)", None),
    "ds-moe-47b-128": ("DS-Inference Table II: 47B+MoE-128", 2024.0),
    "ds-prmoe-47b-64-128": ("PR-MoE-64/128 of 47B+MoE-128 (assumed)", None),
    "tiny-dense": ("tests and demos", None),
    "tiny-moe": ("tests and demos", None),
    "tiny-prmoe": ("tests and demos", None),
    "tiny-moe-256": ("the bench's MoE latency suite at prompt 128 + 100 generated", None),
    "gpt2-124m": ("GPT-2 small; the planner check", None),
    "moe-small-8": ("a small DeepSpeed-MoE GPT; the planner check", None),
}


def preset_table() -> str:
    """The Markdown table of docs/presets.md (name, layers, hidden, heads, experts, parameters, source)."""
    lines = ["| preset | layers | hidden | heads | experts per MoE layer | parameters | source (nominal) |",
             "|---|---|---|---|---|---|---|"]
    for name, arch in PRESETS.items():
        counts = sorted({e for e in arch.moe_experts if e})
        moe = [e for e in arch.moe_experts if e]
        if not counts:
            experts = "-"
        elif len(counts) == 1:
            experts = f"{counts[0]} x {len(moe)} layers"
        else:
            experts = " + ".join(f"{c} x {moe.count(c)}" for c in counts) + " layers"
        if arch.moe_residual:
            experts += ", residual"
        source, nominal = SOURCES[name]
        lines.append(f"| `{name}` | {arch.num_layers} | {arch.hidden_size} | {arch.num_heads} | {experts} | "
                     f"{_human(arch.param_count())} | {source}" + (f" ({nominal:g}B)" if nominal else "") + " |")
    return "\n".join(lines)


def _human(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K"


# ---- the weights ---------------------------------------------------------------------------------------------

def init_of(arch: ModelArch, name: str) -> float | str:
    """How tensor `name` is filled: "zeros", "ones", or the standard deviation of its random values."""
    if name.endswith(".bias"):
        return "zeros"
    if name.endswith("norm.weight"):                   # attn_norm, mlp_norm, final_norm
        return "ones"
    if name.startswith("embed."):
        return EMBED_STD
    if name.endswith(("attn.o.weight", "down.weight")):  # row-parallel, stored [in, out] (experts: [E, in, out])
        fan_in = arch.q_size if name.endswith("attn.o.weight") else (
            arch.expert_size if ".moe.experts." in name else arch.intermediate_size)
        return 1.0 / math.sqrt(fan_in)
    return 1.0 / math.sqrt(arch.hidden_size)            # [out, D]: q, k, v, up, gate, router, coef, lm_head


class PresetSource:
    """A preset's random weights behind the Checkpoint reading interface (made on demand, never stored)."""

    def __init__(self, name: str, arch: ModelArch, seed: int = 0):
        self.name, self.arch, self.seed = name, arch, int(seed)
        self.dtype = "float32"
        self.path = f"preset:{name}"
        self._shapes = tensor_shapes(arch)
        self._generators: dict[str, tuple] = {}         # tensor name -> (its generator, the generator's first state)
        self.values_drawn = 0                           # random values generated so far (for tests and curiosity)

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return self._shapes[name]
        except KeyError:
            raise KeyError(f"preset '{self.name}' has no tensor '{name}'") from None

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A tensor, or only a block of its leading rows."""
        return self._make(name, () if rows is None else (rows,))

    def read_slab(self, name: str, index: tuple) -> np.ndarray:
        """A hyperslab: one slice per leading dimension, e.g. (experts, rows) of an [E, F, D] expert stack."""
        return self._make(name, tuple(index))

    def tokenizer_json(self) -> None:
        return None

    def tokenizer_attrs(self) -> dict:
        return {}

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"PresetSource({self.name!r}, seed={self.seed})"

    # -- making the values --

    def _make(self, name: str, index: tuple) -> np.ndarray:
        shape = self.shape(name)
        if len(index) > len(shape):
            raise IndexError(f"{len(index)} slices for tensor '{name}' of shape {shape}")
        ranges = []
        for dim, size in enumerate(shape):
            s = index[dim] if dim < len(index) else slice(None)
            if not isinstance(s, slice):
                raise TypeError(f"tensor '{name}': index {s!r} is not a slice")
            start, stop, step = s.indices(size)
            if step != 1:
                raise ValueError(f"tensor '{name}': slices with a step are not supported ({s!r})")
            ranges.append((start, max(start, stop)))
        out_shape = tuple(b - a for a, b in ranges)
        init = init_of(self.arch, name)
        if init == "zeros":
            return np.zeros(out_shape, np.float32)
        if init == "ones":
            return np.ones(out_shape, np.float32)
        out = np.empty(out_shape, np.float32)
        if out.size:
            self._fill(name, shape, ranges, out.reshape(-1), float(init))
        return out

    def _fill(self, name: str, shape: tuple, ranges: list, flat_out: np.ndarray, std: float) -> None:
        """Fill `flat_out` with the elements of the hyperslab `ranges`, as contiguous runs of the tensor: the dims
        from `j` on are whole, dim j - 1 is a range, dims before it are looped over."""
        j = len(shape)
        while j > 0 and ranges[j - 1] == (0, shape[j - 1]):
            j -= 1
        strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
        if j == 0:
            runs = [(0, int(np.prod(shape, dtype=np.int64)))]
        else:
            a, b = ranges[j - 1]
            run = (b - a) * strides[j - 1]
            runs = []
            for lead in np.ndindex(*[hi - lo for lo, hi in ranges[:j - 1]]):
                start = sum((lo + i) * strides[d] for d, ((lo, _), i) in enumerate(zip(ranges, lead)))
                runs.append((start + a * strides[j - 1], run))
        scale = np.float32(std * math.sqrt(3.0) / 32768.0)    # int16 uniform on [-32768, 32768) -> std `std`
        at = 0
        for start, length in runs:
            self._draw(name, start, flat_out[at:at + length], scale)
            at += length

    def _generator(self, name: str) -> np.random.PCG64:
        """The tensor's generator, rewound to the start of its stream (seeded once per tensor: ~0.1 ms)."""
        cached = self._generators.get(name)
        if cached is None:
            key = name.encode("utf-8")
            gen = np.random.PCG64(np.random.SeedSequence([self.seed, len(key), *key]))
            cached = self._generators[name] = (gen, gen.state)
        gen, state = cached
        gen.state = state
        return gen

    def _draw(self, name: str, start: int, out: np.ndarray, scale: np.float32) -> None:
        """out[i] = int16 number start + i of the tensor's stream, times `scale`."""
        gen = self._generator(name)
        gen.advance(start // 4)
        skip, length = start % 4, len(out)
        first = 0                                           # stream index (relative to 4 * (start // 4))
        while first < skip + length:
            draws = min(_DRAWS_PER_BLOCK, (skip + length - first + 3) // 4)
            values = gen.random_raw(draws).astype("<u8", copy=False).view("<i2")   # the same on any endianness
            lo, hi = max(skip, first), min(skip + length, first + len(values))
            np.multiply(values[lo - first:hi - first], scale, out=out[lo - skip:hi - skip])
            first += len(values)
        self.values_drawn += length


def write_token_prompts(path: str, count: int, length: int, vocab: int, seed: int = 0) -> None:
    """A JSON Lines prompt file of `count` prompts of `length` random token ids below `vocab` (presets have no
    tokenizer): the batch of a scaling run, e.g. jobs/moe-1.3b-128.slurm."""
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"p{i}", "tokens": rng.integers(0, vocab, size=length).tolist()}) + "\n")


def open_preset(name: str, seed: int = 0) -> PresetSource:
    """The random weights of preset `name` (docs/presets.md); ConfigError, listing the presets, if unknown."""
    arch = PRESETS.get(name)
    if arch is None:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return PresetSource(name, arch, seed)
