"""Ops.bidirectional_attention against a plain per-sequence, per-head softmax(q k^T) v, for packed batches of
equal and ragged lengths; the CuPy twin against it when a GPU is visible. Post-norm blocks and encoder tensor
shapes (hpcinfer/arch.py); a tiny BERT on the emulated CupyOps against NumPy."""

import numpy as np
import pytest

from hpcinfer.arch import ModelArch, tensor_shapes
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.model.encoder import encoder_layout


def reference(q, k, v, lengths, scale):
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (a[start:start + n].astype(np.float64) for a in (q, k, v))      # [n, H, hd]
        scores = np.einsum("ihd,jhd->hij", qs, ks) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out.append(np.einsum("hij,jhd->ihd", probs, vs).reshape(n, -1))
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [1, 9, 4, 2], [3, 1]])
def test_bidirectional_attention_matches_the_plain_formula(lengths):
    rng = np.random.default_rng(len(lengths))
    T, H, hd = sum(lengths), 3, 8
    qkv = rng.standard_normal((T, 3 * H * hd)).astype(np.float32)                   # strided views, as the model
    q, k, v = (qkv[:, i * H * hd:(i + 1) * H * hd].reshape(T, H, hd) for i in range(3))
    got = NumpyOps().bidirectional_attention(q, k, v, encoder_layout(lengths), 0.3)
    assert got.shape == (T, H * hd) and got.dtype == np.float32
    assert np.abs(got - reference(q, k, v, lengths, 0.3)).max() < 1e-5


def test_cupy_bidirectional_attention_matches_numpy():
    from hpcinfer.backend.cupy_ops import gpu_available

    if not gpu_available():
        pytest.skip("needs a CUDA GPU visible to cupy")
    from hpcinfer.backend.cupy_ops import CupyOps

    ops, rng, lengths = CupyOps(0), np.random.default_rng(0), [1, 9, 4, 2]
    q, k, v = (rng.standard_normal((16, 3, 8)).astype(np.float32) for _ in range(3))
    got = ops.to_host(ops.bidirectional_attention(*(ops.asarray(a) for a in (q, k, v)), encoder_layout(lengths), 0.3))
    assert np.abs(got - reference(q, k, v, lengths, 0.3)).max() < 1e-5


def test_encoder_tensor_shapes_have_no_lm_head_and_the_bert_parts():
    arch = ModelArch(family="bert", vocab_size=30, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=4, intermediate_size=16, max_positions=12, qkv_bias=True, out_bias=True, mlp_bias=True,
                     causal=False, norm_position="post", type_vocab_size=2, embed_norm=True, pooler=True)
    shapes = tensor_shapes(arch)
    assert shapes["embed.token_types"] == (2, 8) and shapes["pooler.weight"] == (8, 8)
    assert "embed.norm.bias" in shapes and "final_norm.weight" not in shapes and "lm_head.weight" not in shapes
    assert ModelArch.from_attrs(arch.to_attrs()) == arch
    with pytest.raises(ValueError, match="norm_position"):
        ModelArch(**{**arch.__dict__, "norm_position": "middle"})


def test_encoder_on_emulated_cupy_matches_numpy(emu_cupy, tmp_path):
    """A whole tiny BERT (post-LN blocks, GELU, ragged bidirectional attention, pooler) on CupyOps over the CPU
    stand-in for cupy, kernels included, against the NumPy backend: per-token hidden states within 1e-4."""
    from encoder_models import save_tiny_encoder
    from hpcinfer.checkpoint.hf import convert_hf
    from hpcinfer.embed.api import hidden_states, load_encoder

    h5 = str(tmp_path / "bert.h5")
    convert_hf(save_tiny_encoder("bert", tmp_path / "hf"), h5)
    ours, _ = load_encoder(h5)
    gpu, _ = load_encoder(h5, backend="cupy")
    assert type(gpu.ops).__name__ == "CupyOps"
    sequences = [[2, *range(10, 10 + n), 3] for n in (0, 7, 30, 12)]                # ragged, in one batch
    want, got = hidden_states(ours, sequences), hidden_states(gpu, sequences)
    assert all(g.shape == w.shape for g, w in zip(got, want))
    assert max(np.abs(g - w).max() for g, w in zip(got, want)) < 1e-4
