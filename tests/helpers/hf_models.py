"""Tiny random-weight Hugging Face models, built offline, and the reference answers `transformers` gives for them.

A helper module for tests (not a test file). Every family is small enough to build, save and run in well under a
second. Its weights are re-drawn from a fixed seed at scales where the logits spread out (std ~8 over the
vocabulary) and the layers, not the token's own embedding, decide the next token, so greedy tokens vary and are
never near-ties; biases and norm weights are far from their trivial values (0 and 1), so a wrong mapping of any
tensor shows up in the logits.

    folder = save_tiny_model("llama", tmp_path / "llama")
    logits = hf_reference_logits(folder, [[1, 2, 3], [4, 5]])   # [2, V] float32, last position of each prompt
    tokens = hf_greedy(folder, [1, 2, 3], 8)                     # 8 generated ids (eos does not stop it)

Sizes (V=vocab D=hidden L=layers H=heads Hkv=KV heads F=MLP width P=max positions):
    gpt2       V=257 D=64 L=2 H=4  Hkv=4 F=128 P=64   learned positions, gelu_tanh, tied head
    opt        V=250 D=64 L=2 H=4  Hkv=4 F=96  P=64   learned positions (table offset 2), relu, tied head
    gpt_neox   V=300 D=64 L=2 H=4  Hkv=4 F=128 P=128  rotary on half of each head, parallel residual, untied
    llama      V=256 D=64 L=3 H=4  Hkv=2 F=96  P=128  rmsnorm, GQA, rope_theta 5e5, silu gated MLP, untied
    llama_mha  V=256 D=64 L=2 H=4  Hkv=4 F=96  P=128  as llama but multi-head, tied head, attention and MLP biases
    mixtral    V=256 D=64 L=2 H=4  Hkv=2 F=96  P=128  llama attention (GQA), every layer a top-2 MoE of 8 SiLU-gated
                                                      experts (E=8, expert width F); router re-drawn at ROUTER_GAIN
Every family runs at tp=2; all but llama and mixtral (2 KV heads) also at tp=4. mixtral is in MOE_VARIANTS, not
in VARIANTS (the dense-model suites iterate VARIANTS).
"""

from __future__ import annotations

import math
import os

import numpy as np

FAMILIES = ("gpt2", "opt", "gpt_neox", "llama")
VARIANTS = FAMILIES + ("llama_mha",)
MOE_VARIANTS = ("mixtral",)
SEED = 1234
EMBED_STD = 1.0       # token/position tables and an untied LM head: logits std ~ EMBED_STD * sqrt(D) = 8
LINEAR_GAIN = 2.5     # projections ~ N(0, (gain / sqrt(fan_in))^2): the layers, not the embedding, pick the token
NORM_STD = 0.2        # norm weights ~ 1 + N(0, NORM_STD)
BIAS_STD = 0.1
ROUTER_GAIN = 4.0     # MoE router ~ N(0, (gain / sqrt(D))^2): logits of spread ~4, so the top-k is decisive


def _config(family: str):
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MixtralConfig, OPTConfig

    common = dict(attn_implementation="eager")
    if family == "gpt2":
        return GPT2Config(vocab_size=257, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64,
                          activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=0,
                          eos_token_id=0, **common)
    if family == "opt":
        return OPTConfig(vocab_size=250, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
                         max_position_embeddings=64, word_embed_proj_dim=64, activation_function="relu",
                         pad_token_id=1, bos_token_id=2, eos_token_id=2, **common)
    if family == "gpt_neox":
        return GPTNeoXConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=128, hidden_act="gelu",
                             rotary_pct=0.5, rotary_emb_base=20000, use_parallel_residual=True,
                             tie_word_embeddings=False, layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
                             **common)
    if family in ("llama", "llama_mha"):
        mha = family == "llama_mha"
        return LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2 if mha else 3,
                           num_attention_heads=4, num_key_value_heads=4 if mha else 2, intermediate_size=96,
                           max_position_embeddings=128, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                           tie_word_embeddings=mha, attention_bias=mha, mlp_bias=mha,
                           bos_token_id=1, eos_token_id=2, **common)
    if family == "mixtral":
        return MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=128, rms_norm_eps=1e-6, router_jitter_noise=0.0,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **common)
    raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(VARIANTS + MOE_VARIANTS)}")


def _rescale(model) -> None:
    """Re-draw every parameter (tied ones once) from the current torch seed at test-friendly scales."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)
            if p.ndim == 1 and name.endswith("bias"):
                p.normal_(0.0, BIAS_STD)
            elif p.ndim == 1:                                     # a norm's weight
                p.normal_(1.0, NORM_STD)
            elif "embed" in name or "wte" in name or "wpe" in name or name.startswith("lm_head"):
                p.normal_(0.0, EMBED_STD)
            elif name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                p.normal_(0.0, ROUTER_GAIN / math.sqrt(p.shape[1]))  # Mixtral's router [E, D]
            elif p.ndim == 3:
                # a fused expert stack (transformers 5 Mixtral: gate_up_proj [E, 2F, D], down_proj [E, D, F]):
                # each expert is an [out, in] matrix
                p.normal_(0.0, LINEAR_GAIN / math.sqrt(p.shape[2]))
            else:
                # nn.Linear stores [out, in]; GPT-2's Conv1D (c_attn, c_proj, c_fc) stores [in, out]
                conv1d = leaf[-2] in ("c_attn", "c_proj", "c_fc")
                fan_in = p.shape[0] if conv1d else p.shape[1]
                p.normal_(0.0, LINEAR_GAIN / math.sqrt(fan_in))


def save_tiny_model(family: str, folder, num_layers: int | None = None) -> str:
    """Build a tiny random float32 model of `family` (one of VARIANTS), save it as safetensors, return the folder.
    `num_layers` overrides the variant's layer count (deeper models for pipeline tests)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(family)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    _rescale(model)
    folder = os.fspath(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def load_hf_model(folder):
    """The saved model back in float32 with eager attention, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(folder), dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def hf_reference_logits(folder, prompts: list[list[int]]) -> np.ndarray:
    """Logits at the last position of each prompt, each prompt run alone (no padding): [len(prompts), V] float32."""
    import torch

    model = load_hf_model(folder)
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits   # [1, T, V]
            rows.append(logits[0, -1].to(torch.float32).numpy())
    return np.stack(rows)


def hf_greedy(folder, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from `model.generate` (do_sample False), returning only the generated ids.

    End-of-sequence never stops it and is never masked: eos_token_id is cleared instead of using min_new_tokens,
    because min_new_tokens would set the eos logit to -inf and so change the argmax whenever eos is the best token.
    """
    import torch
    from transformers import GenerationConfig

    model = load_hf_model(folder)
    gen = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=0, bos_token_id=None)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    generated = out[0, ids.shape[1]:].tolist()
    if len(generated) != n:
        raise RuntimeError(f"generate returned {len(generated)} tokens, expected {n}")
    return generated
