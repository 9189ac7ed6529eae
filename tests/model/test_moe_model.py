"""MoE models on one rank, end to end.

- Mixtral against Hugging Face transformers (tests/helpers/hf_models.py's tiny random model): last-position logits of a
  packed batch of mixed-length prompts within 1e-4, identical greedy tokens.
- DeepSpeed-MoE GPT and PR-MoE (tests/helpers/moe_models.py, no HF model exists) against `Reference` below: a
  straightforward float64 forward with loops over layers and over experts, the gating written out (softmax, top-1 =
  the gate probability, capacity ceil(T / E * factor) per forward step, tokens kept in token order), within 1e-4
  at logits of order 10 (see `tolerance`). Capacity is taken over a step's tokens, so prompts are compared one per
  step (and, for the packed case and batched decoding, the reference packs the same step).

Shape legend: T=tokens of a step, S=sequences, D=hidden, H=heads, hd=head dim, E=experts, F=MLP width, V=vocab.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hpcinfer.api import generate, load_model, prompt_logits
from hpcinfer.arch import tensor_shapes
from hpcinfer.backend import moe_ops
from hpcinfer.backend.interface import StepLayout
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.generate.kv_cache import KVCache
from moe_models import DS_EXPERTS, PR_EXPERTS, write_ds_moe, write_pr_moe
from moe_reference import einsum_moe, moe_loop

MIXTRAL_TOLERANCE = 1e-4     # float32 against float32 (transformers)


def tolerance(expect: np.ndarray) -> float:
    """1e-4 for logits of order 10. hpcinfer computes in float32 and the reference in float64, so the error is all
    of float32's, and grows with the logits: these models reach |logit| ~ 30, observed 1.06e-4 at |logit| 21
    (a 40-token prompt, 4 layers), as test_mpi_pipeline.check_layout allows."""
    return 1e-5 * max(10.0, float(np.abs(expect).max()))
NEW_TOKENS = 8
_erf = np.vectorize(math.erf, otypes=[np.float64])


# ---- the float64 reference ------------------------------------------------------------------------------------
class Reference:
    """A GPT-2 shaped decoder with DeepSpeed-MoE / PR-MoE layers in float64, as the math reads. `step` runs one
    forward step of several sequences packed together (each with its own KV cache), like the engine does; the
    MoE layers see all T tokens of the step, so capacity is computed over them. Every MoE layer's gate logits of
    the last step are kept in `gate_logits` (layer -> [T, E]) and its dropped tokens in `dropped` (layer -> [T])."""

    def __init__(self, path: str):
        with open_checkpoint(path) as ckpt:
            self.arch = ckpt.arch
            self.w = {name: ckpt.read(name).astype(np.float64) for name in tensor_shapes(ckpt.arch)}
        a = self.arch
        assert (a.norm, a.position, a.activation, a.tied_embeddings, a.moe_top_k, a.moe_normalize) == \
            ("layernorm", "learned", "gelu", True, 1, "none"), "the reference covers the DS-MoE GPT only"
        self.cache: dict = {}                   # sequence id -> per layer [keys [n, H, hd], values [n, H, hd]]
        self.gate_logits: dict = {}
        self.dropped: dict = {}
        self.moe_io: dict = {}                  # layer -> (MoE input [T, D], expert branch output [T, D])

    def step(self, sequences: list) -> np.ndarray:
        """sequences: [(id, new token ids)] -> logits [S, V] at each sequence's last new token."""
        arch, w = self.arch, self.w
        pieces = []
        for seq, tokens in sequences:
            start = len(self.cache[seq][0][0]) if seq in self.cache else 0
            pos = np.arange(start, start + len(tokens))
            pieces.append(w["embed.tokens"][np.asarray(tokens)] + w["embed.positions"][pos])   # [n, D]
            self.cache.setdefault(seq, [[np.zeros((0, arch.num_heads, arch.head_dim))] * 2
                                        for _ in range(arch.num_layers)])
        x = np.concatenate(pieces)                                                            # [T, D]
        bounds = np.cumsum([0] + [len(t) for _, t in sequences])
        for layer in range(arch.num_layers):
            p = f"layers.{layer}."
            h = x + self.attention(layer, self.layernorm(x, p + "attn_norm"), sequences, bounds)
            x = h + self.mlp_or_moe(layer, self.layernorm(h, p + "mlp_norm"))
        last = x[bounds[1:] - 1]                                                              # [S, D]
        return self.layernorm(last, "final_norm") @ w["embed.tokens"].T                       # [S, V]

    def layernorm(self, x, name):
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.arch.norm_eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def attention(self, layer, x, sequences, bounds):                       # x [T, D] -> [T, D]
        w, a, p = self.w, self.arch, f"layers.{layer}.attn."
        H, hd = a.num_heads, a.head_dim
        proj = {n: (x @ w[p + f"{n}.weight"].T + w[p + f"{n}.bias"]).reshape(-1, H, hd) for n in "qkv"}  # [T, H, hd]
        out = np.zeros((x.shape[0], H * hd))
        for s, (seq, _) in enumerate(sequences):
            lo, hi = bounds[s], bounds[s + 1]
            keys, values = self.cache[seq][layer]
            keys = np.concatenate([keys, proj["k"][lo:hi]])                  # [n, H, hd]
            values = np.concatenate([values, proj["v"][lo:hi]])
            self.cache[seq][layer] = [keys, values]
            past = len(keys) - (hi - lo)
            for t in range(hi - lo):                                         # token t sees positions <= past + t
                q = proj["q"][lo + t]                                        # [H, hd]
                scores = np.einsum("hd,nhd->hn", q, keys[:past + t + 1]) / math.sqrt(hd)
                probs = np.exp(scores - scores.max(axis=1, keepdims=True))
                probs /= probs.sum(axis=1, keepdims=True)
                out[lo + t] = np.einsum("hn,nhd->hd", probs, values[:past + t + 1]).reshape(-1)
        return out @ w[p + "o.weight"] + w[p + "o.bias"]                     # o is stored [in, out]

    def ffn(self, x, prefix, e=None):                                        # x [n, D] -> [n, D]
        w = self.w
        pick = (lambda name: w[name]) if e is None else (lambda name: w[name][e])
        up = x @ pick(prefix + "up.weight").T + pick(prefix + "up.bias")                      # [n, F]
        act = 0.5 * up * (1.0 + _erf(up / math.sqrt(2.0)))
        return act @ pick(prefix + "down.weight") + pick(prefix + "down.bias")              # down stored [F, D]

    def mlp_or_moe(self, layer, x):                                          # x [T, D] -> [T, D]
        a, w, p = self.arch, self.w, f"layers.{layer}."
        E = a.experts_in(layer)
        if not E:
            return self.ffn(x, p + "mlp.")
        T = x.shape[0]
        logits = x @ w[p + "moe.router.weight"].T                            # [T, E]
        self.gate_logits[layer] = logits
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)                            # softmax
        chosen = np.argmax(probs, axis=1)                                    # [T] top-1 (lowest index on ties)
        gate = probs[np.arange(T), chosen]                                   # [T] the raw gate probability
        factor = a.moe_capacity_factor
        capacity = max(math.ceil(T / E * factor), a.moe_min_capacity) if factor > 0 else T
        moe = np.zeros_like(x)
        dropped = np.ones(T, dtype=bool)
        for e in range(E):
            mine = np.flatnonzero(chosen == e)[:capacity]                    # earlier tokens keep their place
            if len(mine):
                moe[mine] = gate[mine, None] * self.ffn(x[mine], p + "moe.experts.", e)
                dropped[mine] = False
        self.dropped[layer] = dropped
        self.moe_io[layer] = (x, moe)
        if not a.moe_residual:
            return moe
        coef = x @ w[p + "moe.coef.weight"].T + w[p + "moe.coef.bias"]       # [T, 2]
        coef = np.exp(coef - coef.max(axis=1, keepdims=True))
        coef /= coef.sum(axis=1, keepdims=True)
        return moe * coef[:, 0:1] + self.ffn(x, p + "mlp.") * coef[:, 1:2]

    def greedy(self, prompt: list, n: int) -> tuple[list, list]:
        """n greedy tokens of one prompt, a step per token: (tokens, logits [V] of every step)."""
        self.cache.clear()
        logits = self.step([(0, prompt)])[0]
        tokens, steps = [int(np.argmax(logits))], [logits]
        while len(tokens) < n:
            logits = self.step([(0, [tokens[-1]])])[0]
            tokens.append(int(np.argmax(logits)))
            steps.append(logits)
        return tokens, steps

    def prompt_logits(self, prompt: list) -> np.ndarray:
        self.cache.clear()
        return self.step([(0, prompt)])[0]


def hpcinfer_drops(ref: Reference, capacity_factor: float, min_capacity: int) -> dict:
    """Dropped tokens per MoE layer of the reference's last step, counted by hpcinfer's own routing
    (moe_ops.top_k_gating + route) on the reference's gate logits."""
    counts = {}
    for layer, logits in ref.gate_logits.items():
        experts, weights = moe_ops.top_k_gating(logits.astype(np.float32), 1, "none")
        capacity = moe_ops.capacity_for(len(logits), logits.shape[1], capacity_factor, min_capacity)
        counts[layer] = int(moe_ops.route(experts, weights, logits.shape[1], capacity).dropped.sum())
    return counts


# ---- DeepSpeed-MoE GPT and PR-MoE ------------------------------------------------------------------------------
# id: (writer, capacity factor, min capacity)
MODELS = {
    "ds-moe": (write_ds_moe, 1.0, 1),
    "ds-moe-no-limit": (write_ds_moe, 0.0, 1),
    "pr-moe": (write_pr_moe, 1.0, 1),
    "pr-moe-cf2": (write_pr_moe, 2.0, 2),
}
PROMPT_LENGTHS = (1, 3, 8, 21, 40)


@pytest.fixture(scope="module", params=MODELS.keys())
def moe(request, tmp_path_factory):
    write, factor, minimum = MODELS[request.param]
    path = str(tmp_path_factory.mktemp(request.param) / "model.h5")
    arch = write(path, capacity_factor=factor, min_capacity=minimum)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, arch.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    return request.param, load_model(path), Reference(path), prompts


def test_the_checkpoints_have_the_asked_layout(moe):
    name, model, _, _ = moe
    arch = model.arch
    assert arch.moe_experts == (PR_EXPERTS if name.startswith("pr") else DS_EXPERTS)
    assert arch.moe_residual == name.startswith("pr") and arch.moe_top_k == 1 and arch.moe_normalize == "none"
    assert arch.tied_embeddings and arch.position == "learned" and arch.mlp_bias and arch.qkv_bias


def test_prompt_logits_match_the_float64_reference_one_prompt_at_a_time(moe):
    name, model, ref, prompts = moe
    for prompt in prompts:
        ours = prompt_logits(model, [prompt])[0]
        expect = ref.prompt_logits(prompt)
        assert np.abs(ours - expect).max() < tolerance(expect), (name, len(prompt), np.abs(ours - expect).max())
        assert expect.std() > 3.0                                # the logits do spread
        drops = hpcinfer_drops(ref, model.arch.moe_capacity_factor, model.arch.moe_min_capacity)
        assert drops == {layer: int(d.sum()) for layer, d in ref.dropped.items()}   # the two routings agree


def test_long_prompts_drop_tokens_and_still_match(moe):
    """With capacity factor 1 (min 1) a 40-token prompt overflows some experts: those tokens skip the experts (and
    keep only the residual MLP in PR-MoE), and hpcinfer agrees. Without a limit nothing is dropped."""
    name, model, ref, prompts = moe
    prompt = prompts[-1]
    ours = prompt_logits(model, [prompt])[0]
    expect = ref.prompt_logits(prompt)
    assert np.abs(ours - expect).max() < tolerance(expect)
    drops = hpcinfer_drops(ref, model.arch.moe_capacity_factor, model.arch.moe_min_capacity)
    assert sorted(drops) == [1, 3]                                # the MoE layers
    if model.arch.moe_capacity_factor == 0:
        assert sum(drops.values()) == 0
    elif model.arch.moe_capacity_factor == 1.0:
        assert sum(drops.values()) > 0, drops
        # the drops matter: with no capacity limit the logits differ
        ref.arch = dataclasses.replace(model.arch, moe_capacity_factor=0.0)
        try:
            unlimited = ref.prompt_logits(prompt)
        finally:
            ref.arch = model.arch
        assert np.abs(unlimited - ours).max() > 1e-2


def test_the_reference_expert_branch_is_the_one_hot_einsum_and_loop_references(moe):
    """The reference's MoE branch of the long prompt against tests/helpers/moe_reference.py's GShard / DeepSpeed one-hot
    einsum (float32 gating) and its plain token loop, on the same layer input and experts."""
    name, model, ref, prompts = moe
    ref.prompt_logits(prompts[-1])
    arch = model.arch
    for layer, (x, branch) in ref.moe_io.items():
        E = arch.experts_in(layer)
        capacity = (moe_ops.capacity_for(len(x), E, arch.moe_capacity_factor, arch.moe_min_capacity)
                    if arch.moe_capacity_factor > 0 else None)

        def expert(e, rows, prefix=f"layers.{layer}.moe.experts."):
            return ref.ffn(rows, prefix, e)

        router = ref.w[f"layers.{layer}.moe.router.weight"]
        for other in (einsum_moe(x, router, expert, 1, "none", capacity),
                      moe_loop(x, router, expert, 1, "none", capacity)):
            assert np.abs(other - branch).max() < 1e-4 * max(1.0, float(np.abs(branch).max())), (name, layer)


def test_packed_prompts_share_one_capacity(moe):
    """A packed prefill is one step: capacity is ceil(T / E * factor) over all its tokens, in packing order."""
    name, model, ref, prompts = moe
    ours = prompt_logits(model, prompts)
    ref.cache.clear()
    expect = ref.step(list(enumerate(prompts)))
    assert np.abs(ours - expect).max() < tolerance(expect), (name, np.abs(ours - expect).max())


def test_greedy_generation_follows_the_reference_step_by_step(moe):
    """One prompt: the prompt step (T = prompt length), then decode steps of T = 1 token (capacity
    max(ceil(1 / E * factor), min) >= 1: never a drop). hpcinfer's tokens are the reference's greedy tokens, and
    its logits at every step (the engine's own KV cache, driven by hand) are the reference's."""
    name, model, ref, prompts = moe
    for prompt in prompts[1:4]:
        tokens, steps = ref.greedy(prompt, NEW_TOKENS)
        assert generate(model, [prompt], NEW_TOKENS) == [tokens]
        arch = model.arch
        cache = KVCache(model.ops, arch.num_layers, 1, model.kv_heads_local, len(prompt) + NEW_TOKENS,
                        arch.head_dim)
        feed, start = list(prompt), 0
        for k, expect in enumerate(steps):
            step = StepLayout.build([0], [start], [len(feed)])
            ours = model.ops.to_host(model.forward(np.asarray(feed, dtype=np.int64), step, cache))[0]
            assert np.abs(ours - expect).max() < tolerance(expect), (name, len(prompt), k,
                                                                     np.abs(ours - expect).max())
            start, feed = start + len(feed), [tokens[k]]
    assert len({tuple(generate(model, [p], NEW_TOKENS)[0]) for p in prompts}) > 1     # continuations vary


def test_batched_decode_steps_match_the_reference(moe):
    """Several prompts decoded together: every decode step is one MoE step of T = batch tokens, with its own
    capacity; hpcinfer's generate gives the tokens of the reference stepping the same batch."""
    name, model, ref, prompts = moe
    batch = prompts[:4]
    ref.cache.clear()
    logits = ref.step(list(enumerate(batch)))
    tokens = [[int(np.argmax(row))] for row in logits]
    for _ in range(NEW_TOKENS - 1):
        logits = ref.step([(s, [t[-1]]) for s, t in enumerate(tokens)])
        for s, row in enumerate(logits):
            tokens[s].append(int(np.argmax(row)))
    assert generate(model, batch, NEW_TOKENS) == tokens


# ---- Mixtral against transformers --------------------------------------------------------------------------------
MIXTRAL_LENGTHS = (5, 17, 1, 30)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from converted_models import converted_tiny_model

    return converted_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral"), MIXTRAL_LENGTHS)


def test_mixtral_converts_with_every_layer_moe(mixtral):
    _, model, _ = mixtral
    arch = model.arch
    assert (arch.family, arch.moe_experts, arch.moe_top_k, arch.moe_normalize) == ("mixtral", (8, 8), 2, "topk")
    assert (arch.num_kv_heads, arch.activation, arch.gated_mlp, arch.moe_capacity_factor) == (2, "silu", True, 0.0)


def test_mixtral_logits_match_transformers(mixtral):
    from hf_models import hf_reference_logits

    folder, model, prompts = mixtral
    ours = prompt_logits(model, prompts)
    ref = hf_reference_logits(folder, prompts)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < MIXTRAL_TOLERANCE, np.abs(ours - ref).max()


def test_mixtral_greedy_generation_matches_transformers(mixtral):
    from hf_models import hf_greedy

    folder, model, prompts = mixtral
    ours = generate(model, prompts, NEW_TOKENS)
    assert ours == [hf_greedy(folder, p, NEW_TOKENS) for p in prompts]
    assert len({tuple(t) for t in ours}) == len(ours)
