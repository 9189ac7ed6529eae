"""Tiny random DeepSpeed-MoE GPT and PR-MoE checkpoints, written directly with CheckpointWriter (no Hugging Face
model exists for them). A helper module for tests (not a test file).

Both are GPT-2 shaped: learned positions, layernorm, erf GELU, biases everywhere, tied embeddings; MoE in every
other layer, top-1 routing on the raw softmax probability (moe_normalize "none", DeepSpeed's top1gating), a
capacity factor with DeepSpeed's token-order dropping. PR-MoE has more experts in later layers and a residual
dense MLP mixed in by a learned 2-way coefficient (DeepSpeed's use_residual).

    arch = write_ds_moe(tmp_path / "ds.h5", capacity_factor=1.0)    # experts (0, 8, 0, 8)
    arch = write_pr_moe(tmp_path / "pr.h5")                          # experts (0, 4, 0, 8), residual MLP
    arch = write_dense_gpt(tmp_path / "dense.h5")                    # the same GPT without experts

Weights are drawn from a fixed seed at the scales of tests/helpers/hf_models.py (logits std ~8, the layers and not the
token's own embedding pick the next token, no greedy near-ties); the router at ROUTER_GAIN so routing is decisive.

Sizes: V=256 D=64 L=4 H=4 (Hkv=4, hd=16) F=128 (dense / residual MLP) Fe=96 (expert width) P=64.
Every model runs at tp in {1, 2, 4}, expert_tp in {1, 2} and ep in {1, 2, 4} (DS-MoE also ep=8).
"""

from __future__ import annotations

import math
import os

import numpy as np

from hpcinfer.arch import ModelArch, tensor_shapes
from hpcinfer.checkpoint.writer import CheckpointWriter

VOCAB, HIDDEN, LAYERS, HEADS, MLP_WIDTH, EXPERT_WIDTH, POSITIONS = 256, 64, 4, 4, 128, 96, 64
DS_EXPERTS = (0, 8, 0, 8)          # MoE every other layer
PR_EXPERTS = (0, 4, 0, 8)          # pyramid: more experts in the later MoE layer
SEED = 4321
EMBED_STD = 1.0                    # as tests/helpers/hf_models.py
LINEAR_GAIN = 2.5
NORM_STD = 0.2
BIAS_STD = 0.1
ROUTER_GAIN = 4.0                  # router logits of spread ~4: the chosen expert is well ahead of the next
COEF_GAIN = 1.0                    # PR-MoE coefficient logits of spread ~1: both branches count
ROW_PARALLEL = ("attn.o.weight", "down.weight")     # stored [in, out] (the others [out, in])


def moe_arch(experts: tuple = DS_EXPERTS, residual: bool = False, capacity_factor: float = 1.0,
             min_capacity: int = 1, top_k: int = 1, family: str = "ds_moe") -> ModelArch:
    """A GPT-2 shaped MoE arch; experts=() makes the dense GPT."""
    return ModelArch(family=family, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=len(experts) or LAYERS,
                     num_heads=HEADS, num_kv_heads=HEADS, head_dim=HIDDEN // HEADS, intermediate_size=MLP_WIDTH,
                     max_positions=POSITIONS, norm="layernorm", norm_eps=1e-5, position="learned",
                     activation="gelu", qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=True,
                     bos_token_id=0, eos_token_ids=(0,), moe_experts=tuple(experts), moe_top_k=top_k,
                     moe_normalize="none", moe_capacity_factor=capacity_factor, moe_min_capacity=min_capacity,
                     moe_intermediate_size=EXPERT_WIDTH if experts else 0, moe_residual=residual)


def random_tensor(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """One tensor at the test-friendly scale its role asks for (see the module docstring)."""
    if name.endswith(".bias"):
        std, mean = BIAS_STD, 0.0
    elif len(shape) == 1:                                       # a norm's weight
        std, mean = NORM_STD, 1.0
    elif name.startswith("embed."):
        std, mean = EMBED_STD, 0.0
    elif name.endswith("moe.router.weight"):                    # [E, D]
        std, mean = ROUTER_GAIN / math.sqrt(shape[-1]), 0.0
    elif name.endswith("moe.coef.weight"):                      # [2, D]
        std, mean = COEF_GAIN / math.sqrt(shape[-1]), 0.0
    else:                                                       # [.., out, in] or [.., in, out] (row-parallel)
        fan_in = shape[-2] if name.endswith(ROW_PARALLEL) else shape[-1]
        std, mean = LINEAR_GAIN / math.sqrt(fan_in), 0.0
    return (mean + std * rng.standard_normal(shape)).astype(np.float32)


def write_checkpoint(path, arch: ModelArch, seed: int = SEED) -> ModelArch:
    """Every tensor of `arch` (tensor_shapes order), drawn from `seed`, into an hpcinfer float32 checkpoint."""
    rng = np.random.default_rng(seed)
    with CheckpointWriter(os.fspath(path), arch, "float32") as writer:
        for name, shape in tensor_shapes(arch).items():
            writer.add(name, random_tensor(name, shape, rng))
    return arch


def write_ds_moe(path, residual: bool = False, capacity_factor: float = 1.0, min_capacity: int = 1,
                 experts: tuple = DS_EXPERTS) -> ModelArch:
    """DeepSpeed-MoE GPT: (0, 8, 0, 8) experts, top-1, capacity ceil(T / E * factor) (at least min_capacity)."""
    return write_checkpoint(path, moe_arch(experts, residual, capacity_factor, min_capacity,
                                           family="pr_moe" if residual else "ds_moe"))


def write_pr_moe(path, capacity_factor: float = 1.0, min_capacity: int = 1,
                 experts: tuple = PR_EXPERTS) -> ModelArch:
    """PR-MoE: (0, 4, 0, 8) experts and a residual dense MLP, out = moe * coef[0] + mlp * coef[1]."""
    return write_ds_moe(path, residual=True, capacity_factor=capacity_factor, min_capacity=min_capacity,
                        experts=experts)


def write_dense_gpt(path) -> ModelArch:
    """The same GPT with no experts (a dense model)."""
    return write_checkpoint(path, moe_arch(experts=(), family="gpt2"))
