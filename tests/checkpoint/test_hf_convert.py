"""Hugging Face folder -> hpcinfer checkpoint: every tensor, the architecture, dtypes, file layouts, tokenizer, errors.

The tiny models come from hf_models.py. Two independent checks of the layout mapping: each canonical tensor
against the HF module's parameter (mapped here by module attribute, not by file name), and a plain NumPy forward
pass over the converted checkpoint against transformers' logits at every position.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from hf_models import VARIANTS, load_hf_model, save_tiny_model  # noqa: E402
from hpcinfer.arch import tensor_shapes  # noqa: E402
from hpcinfer.checkpoint.format import bfloat16_dtype, open_checkpoint  # noqa: E402
from hpcinfer.checkpoint.hf import convert_hf  # noqa: E402
from hpcinfer.errors import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (folder, HF model in eval mode), built once per module."""
    root = tmp_path_factory.mktemp("hf")
    made = {}

    def get(family):
        if family not in made:
            folder = save_tiny_model(family, root / family)
            made[family] = (folder, load_hf_model(folder))
        return made[family]

    return get


def _np(t) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def _expected(family: str, model) -> dict[str, np.ndarray]:
    """Canonical name -> the HF parameter in the stored layout, found through the module tree."""
    out = {}
    if family == "gpt2":
        base = model.transformer
        D = model.config.n_embd
        out["embed.tokens"], out["embed.positions"] = _np(base.wte.weight), _np(base.wpe.weight)
        for i, blk in enumerate(base.h):
            p = f"layers.{i}."
            w, b = _np(blk.attn.c_attn.weight), _np(blk.attn.c_attn.bias)      # Conv1D [D, 3D]
            for j, proj in enumerate("qkv"):
                out[p + f"attn.{proj}.weight"] = w[:, j * D:(j + 1) * D].T
                out[p + f"attn.{proj}.bias"] = b[j * D:(j + 1) * D]
            _put_linear(out, p + "attn.o", blk.attn.c_proj, conv1d=True, row=True)
            _put_linear(out, p + "mlp.up", blk.mlp.c_fc, conv1d=True)
            _put_linear(out, p + "mlp.down", blk.mlp.c_proj, conv1d=True, row=True)
            _put_norm(out, p + "attn_norm", blk.ln_1)
            _put_norm(out, p + "mlp_norm", blk.ln_2)
        _put_norm(out, "final_norm", base.ln_f)
    elif family == "opt":
        base = model.model.decoder
        out["embed.tokens"] = _np(base.embed_tokens.weight)
        out["embed.positions"] = _np(base.embed_positions.weight)[2:]          # row p + 2 serves position p
        for i, blk in enumerate(base.layers):
            p = f"layers.{i}."
            for proj in "qkv":
                _put_linear(out, p + f"attn.{proj}", getattr(blk.self_attn, f"{proj}_proj"))
            _put_linear(out, p + "attn.o", blk.self_attn.out_proj, row=True)
            _put_linear(out, p + "mlp.up", blk.fc1)
            _put_linear(out, p + "mlp.down", blk.fc2, row=True)
            _put_norm(out, p + "attn_norm", blk.self_attn_layer_norm)
            _put_norm(out, p + "mlp_norm", blk.final_layer_norm)
        _put_norm(out, "final_norm", base.final_layer_norm)
    elif family == "gpt_neox":
        base = model.gpt_neox
        H = model.config.num_attention_heads
        out["embed.tokens"] = _np(base.embed_in.weight)
        for i, blk in enumerate(base.layers):
            p = f"layers.{i}."
            qkv = blk.attention.query_key_value
            w, b = _np(qkv.weight), _np(qkv.bias)                               # rows [H, 3, hd]
            hd = w.shape[0] // (3 * H)
            for j, proj in enumerate("qkv"):
                rows = np.concatenate([np.arange(h * 3 * hd + j * hd, h * 3 * hd + (j + 1) * hd) for h in range(H)])
                out[p + f"attn.{proj}.weight"], out[p + f"attn.{proj}.bias"] = w[rows], b[rows]
            _put_linear(out, p + "attn.o", blk.attention.dense, row=True)
            _put_linear(out, p + "mlp.up", blk.mlp.dense_h_to_4h)
            _put_linear(out, p + "mlp.down", blk.mlp.dense_4h_to_h, row=True)
            _put_norm(out, p + "attn_norm", blk.input_layernorm)
            _put_norm(out, p + "mlp_norm", blk.post_attention_layernorm)
        _put_norm(out, "final_norm", base.final_layer_norm)
        out["lm_head.weight"] = _np(model.get_output_embeddings().weight)
    else:                                                                          # llama, llama_mha
        base = model.model
        out["embed.tokens"] = _np(base.embed_tokens.weight)
        for i, blk in enumerate(base.layers):
            p = f"layers.{i}."
            for proj in "qkv":
                _put_linear(out, p + f"attn.{proj}", getattr(blk.self_attn, f"{proj}_proj"))
            _put_linear(out, p + "attn.o", blk.self_attn.o_proj, row=True)
            for proj in ("gate", "up"):
                _put_linear(out, p + f"mlp.{proj}", getattr(blk.mlp, f"{proj}_proj"))
            _put_linear(out, p + "mlp.down", blk.mlp.down_proj, row=True)
            _put_norm(out, p + "attn_norm", blk.input_layernorm)
            _put_norm(out, p + "mlp_norm", blk.post_attention_layernorm)
        _put_norm(out, "final_norm", base.norm)
        if not model.config.tie_word_embeddings:
            out["lm_head.weight"] = _np(model.lm_head.weight)
    return out


def _put_linear(out, name, module, conv1d=False, row=False):
    """nn.Linear holds [out, in] and Conv1D [in, out]; column-parallel stores [out, in], row-parallel [in, out]."""
    w = _np(module.weight)
    out_in = w.T if conv1d else w
    out[name + ".weight"] = out_in.T if row else out_in
    if module.bias is not None:
        out[name + ".bias"] = _np(module.bias)


def _put_norm(out, name, module):
    out[name + ".weight"] = _np(module.weight)
    if getattr(module, "bias", None) is not None:
        out[name + ".bias"] = _np(module.bias)


# -------------------------------------------------------------------------------------- a plain NumPy reference

def _numpy_logits(ckpt, ids: list[int]) -> np.ndarray:
    """The decoder the checkpoint's features describe, in float64, no cache: [T, V] logits."""
    a = ckpt.arch
    W = lambda name: ckpt.read(name).astype(np.float64)                                  # noqa: E731
    T, H, Hkv, hd = len(ids), a.num_heads, a.num_kv_heads, a.head_dim
    pos = np.arange(T)
    x = W("embed.tokens")[ids]                                                          # [T, D]
    if a.position == "learned":
        x = x + W("embed.positions")[pos]

    def norm(h, name):
        if a.norm == "layernorm":
            c = h - h.mean(-1, keepdims=True)
            return c / np.sqrt((c * c).mean(-1, keepdims=True) + a.norm_eps) * W(name + ".weight") + W(name + ".bias")
        return h / np.sqrt((h * h).mean(-1, keepdims=True) + a.norm_eps) * W(name + ".weight")

    def linear(h, name, bias, row=False):                   # row-parallel stored [in, out], column [out, in]
        y = h @ W(name + ".weight") if row else h @ W(name + ".weight").T
        return y + W(name + ".bias") if bias else y

    def act(h):
        if a.activation == "gelu":
            return 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
        if a.activation == "gelu_tanh":
            return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        if a.activation == "relu":
            return np.maximum(h, 0)
        return h / (1 + np.exp(-h))

    def rope(t):                                                                        # [T, heads, hd]
        r = a.rotary_dim
        angle = pos[:, None] / a.rope_theta ** (np.arange(0, r, 2) / r)                 # [T, r/2]
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        t1, t2 = t[..., :r // 2], t[..., r // 2:r]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin, t[..., r:]], axis=-1)

    def attention(h, p):
        q = linear(h, p + "attn.q", a.qkv_bias).reshape(T, H, hd)
        k = linear(h, p + "attn.k", a.qkv_bias).reshape(T, Hkv, hd)
        v = linear(h, p + "attn.v", a.qkv_bias).reshape(T, Hkv, hd)
        if a.position == "rotary":
            q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)          # [T, H, hd]
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        prob = np.exp(s - s.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", prob, v).reshape(T, H * hd)
        return linear(o, p + "attn.o", a.out_bias, row=True)

    def mlp(h, p):
        up = linear(h, p + "mlp.up", a.mlp_bias)
        u = act(linear(h, p + "mlp.gate", a.mlp_bias)) * up if a.gated_mlp else act(up)
        return linear(u, p + "mlp.down", a.mlp_bias, row=True)

    for i in range(a.num_layers):
        p = f"layers.{i}."
        if a.parallel_residual:
            x = x + attention(norm(x, p + "attn_norm"), p) + mlp(norm(x, p + "mlp_norm"), p)
        else:
            x = x + attention(norm(x, p + "attn_norm"), p)
            x = x + mlp(norm(x, p + "mlp_norm"), p)
    x = norm(x, "final_norm")
    return x @ W("embed.tokens" if a.tied_embeddings else "lm_head.weight").T


# ------------------------------------------------------------------------------------------------------- tests

ARCH_EXPECTED = {
    "gpt2": dict(norm="layernorm", position="learned", activation="gelu_tanh", qkv_bias=True, out_bias=True,
                 mlp_bias=True, tied_embeddings=True, parallel_residual=False, max_positions=64, vocab_size=257),
    "opt": dict(norm="layernorm", position="learned", activation="relu", qkv_bias=True, tied_embeddings=True,
                max_positions=64, vocab_size=250, intermediate_size=96, bos_token_id=2, eos_token_ids=(2,)),
    "gpt_neox": dict(norm="layernorm", position="rotary", rotary_dim=8, rope_theta=20000.0, activation="gelu",
                     parallel_residual=True, qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=False),
    "llama": dict(norm="rmsnorm", norm_eps=1e-6, position="rotary", rotary_dim=16, rope_theta=5e5,
                  activation="silu", gated_mlp=True, num_heads=4, num_kv_heads=2, qkv_bias=False, mlp_bias=False,
                  tied_embeddings=False, num_layers=3, bos_token_id=1, eos_token_ids=(2,)),
    "llama_mha": dict(family="llama", num_kv_heads=4, qkv_bias=True, out_bias=True, mlp_bias=True,
                      tied_embeddings=True),
}


@pytest.mark.parametrize("family", VARIANTS)
def test_every_tensor_matches_hf(family, tiny, tmp_path):
    folder, model = tiny(family)
    arch = convert_hf(folder, str(tmp_path / "m.h5"))
    for key, value in ARCH_EXPECTED[family].items():
        assert getattr(arch, key) == value, key
    expected = _expected(family, model)
    with open_checkpoint(str(tmp_path / "m.h5")) as ckpt:
        assert ckpt.arch == arch and ckpt.dtype == "float32"
        assert set(expected) == set(tensor_shapes(arch))
        for name, want in expected.items():
            got = ckpt.read(name)
            assert got.shape == want.shape, name
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("family", VARIANTS)
def test_numpy_forward_of_checkpoint_matches_hf_logits(family, tiny, tmp_path):
    folder, model = tiny(family)
    convert_hf(folder, str(tmp_path / "m.h5"))
    rng = np.random.default_rng(7)
    with open_checkpoint(str(tmp_path / "m.h5")) as ckpt:
        n = ckpt.arch.max_positions                       # every position row and rotary angle in use
        ids = [int(i) for i in rng.integers(0, ckpt.arch.vocab_size, size=n)]
        ours = _numpy_logits(ckpt, ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() < 1e-4 * np.abs(theirs).max()     # float32 HF vs float64 here


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_storage(family, dtype, tiny, tmp_path):
    folder, model = tiny(family)
    convert_hf(folder, str(tmp_path / "m.h5"), dtype=dtype)
    expected = _expected(family, model)
    with open_checkpoint(str(tmp_path / "m.h5")) as ckpt:
        assert ckpt.dtype == dtype
        for name, want in expected.items():
            ds = ckpt.file[name]
            got = ckpt.read(name)
            if dtype == "float16":
                assert ds.dtype == np.float16
                np.testing.assert_array_equal(got, want.astype(np.float16), err_msg=name)
            else:
                assert ds.dtype == np.uint16 and ds.attrs["dtype"] == "bfloat16"
                assert got.dtype == bfloat16_dtype()
                np.testing.assert_array_equal(got, want.astype(bfloat16_dtype()), err_msg=name)
            tol = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8                   # half an ulp, relative
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_source_without_torch(source_dtype, tmp_path, monkeypatch):
    """bf16/fp16 safetensors are widened exactly to float32 and reading them never imports torch."""
    save_tiny_model("llama", tmp_path / "f32")
    model = load_hf_model(tmp_path / "f32").to(source_dtype)
    model.save_pretrained(tmp_path / "half")
    expected = _expected("llama", model)
    monkeypatch.setitem(sys.modules, "torch", None)          # `import torch` now raises ImportError
    convert_hf(str(tmp_path / "half"), str(tmp_path / "m.h5"))
    with open_checkpoint(str(tmp_path / "m.h5")) as ckpt:
        for name, want in expected.items():
            np.testing.assert_array_equal(ckpt.read(name), want, err_msg=name)


def _all_tensors(path) -> dict[str, np.ndarray]:
    with open_checkpoint(str(path)) as ckpt:
        return {name: ckpt.read(name) for name in tensor_shapes(ckpt.arch)}


def test_sharded_safetensors_and_pytorch_bin(tiny, tmp_path):
    folder, model = tiny("gpt_neox")
    convert_hf(folder, str(tmp_path / "single.h5"))
    single = _all_tensors(tmp_path / "single.h5")

    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    convert_hf(str(tmp_path / "sharded"), str(tmp_path / "sharded.h5"))

    os.makedirs(tmp_path / "bin")
    state = model.state_dict()
    state["embed_out.weight"] = state.pop("lm_head.weight")          # the name hub checkpoints use
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    with open(os.path.join(folder, "config.json")) as f:
        config = f.read()
    (tmp_path / "bin" / "config.json").write_text(config)
    convert_hf(str(tmp_path / "bin"), str(tmp_path / "bin.h5"))

    for other in ("sharded.h5", "bin.h5"):
        got = _all_tensors(tmp_path / other)
        for name, want in single.items():
            np.testing.assert_array_equal(got[name], want, err_msg=f"{other}: {name}")


def test_pytorch_bin_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    save_tiny_model("opt", tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(CheckpointError, match="needs torch"):
        convert_hf(str(tmp_path), str(tmp_path / "m.h5"))


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok.to_str()


def test_tokenizer_chat_template_and_eos_list(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    text = _tiny_tokenizer_json()
    (tmp_path / "m" / "tokenizer.json").write_text(text)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>", "special": True}}))
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [4, 2]}))

    arch = convert_hf(folder, str(tmp_path / "a.h5"))
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (4, 2)
    with open_checkpoint(str(tmp_path / "a.h5")) as ckpt:
        assert ckpt.tokenizer_json() == text
        # eos string: not in tokenizer_config.json, so looked up by the first eos id in tokenizer.json
        assert ckpt.tokenizer_attrs() == {"chat_template": template, "bos_token": "<s>", "eos_token": "world"}

    (tmp_path / "m" / "chat_template.jinja").write_text("jinja file wins")
    convert_hf(folder, str(tmp_path / "b.h5"))
    with open_checkpoint(str(tmp_path / "b.h5")) as ckpt:
        assert ckpt.tokenizer_attrs()["chat_template"] == "jinja file wins"

    os.remove(tmp_path / "m" / "tokenizer.json")
    convert_hf(folder, str(tmp_path / "c.h5"))
    with open_checkpoint(str(tmp_path / "c.h5")) as ckpt:
        assert ckpt.tokenizer_json() is None


def test_tokenizer_from_vocab_and_merges(tmp_path):
    """A folder with only vocab.json + merges.txt (as facebook/opt-125m) gets its tokenizer.json from transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = save_tiny_model("opt", tmp_path / "m")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["hello world, this is a test"] * 4,
                            trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "<pad>", "</s>", "<unk>"]))
    bpe.model.save(folder)                                                    # vocab.json, merges.txt
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>"}))
    convert_hf(folder, str(tmp_path / "m.h5"))
    with open_checkpoint(str(tmp_path / "m.h5")) as ckpt:
        stored = Tokenizer.from_str(ckpt.tokenizer_json())
        assert ckpt.tokenizer_attrs() == {"bos_token": "</s>", "eos_token": "</s>"}
    assert stored.encode("hello world").ids == bpe.encode("hello world").ids


# ------------------------------------------------------------------------------------------------------ errors

def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_hf(str(tmp_path / "nope"), str(tmp_path / "m.h5"))
    with pytest.raises(CheckpointError, match="no config.json"):
        convert_hf(str(tmp_path), str(tmp_path / "m.h5"))
    save_tiny_model("gpt2", tmp_path / "m")
    os.remove(tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match="has no weights"):
        convert_hf(str(tmp_path / "m"), str(tmp_path / "m.h5"))
    with pytest.raises(CheckpointError, match="not allowed"):
        convert_hf(str(tmp_path / "m"), str(tmp_path / "m.h5"), dtype="int8")


def test_unsupported_model_type(tmp_path):
    save_tiny_model("gpt2", tmp_path)
    _edit_config(tmp_path, model_type="t5")
    with pytest.raises(CheckpointError, match=r"'t5' is not supported.*gpt2, opt, gpt_neox, llama"):
        convert_hf(str(tmp_path), str(tmp_path / "m.h5"))


def test_missing_tensor_is_named_and_leaves_no_file(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_tiny_model("llama", tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    out = tmp_path / "m.h5"
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        convert_hf(str(tmp_path), str(out))
    assert not os.path.exists(out) and not [f for f in os.listdir(tmp_path) if f.startswith("m.h5")]


@pytest.mark.parametrize("family, changes, message", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "RoPE type 'llama3'"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim"),
    ("opt", {"_remove_final_layer_norm": True}, "_remove_final_layer_norm"),
    ("gpt2", {"activation_function": "quick_gelu"}, "activation_function = 'quick_gelu'"),
    ("llama", {"hidden_size": None}, "no 'hidden_size'"),
])
def test_unsupported_variants_are_refused(family, changes, message, tmp_path):
    save_tiny_model(family, tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        convert_hf(str(tmp_path), str(tmp_path / "m.h5"))


def test_legacy_config_keys(tmp_path):
    """transformers 4.x configs: rope_theta / rotary_emb_base / rotary_pct at the top level, no rope_parameters."""
    save_tiny_model("gpt_neox", tmp_path / "neox")
    _edit_config(tmp_path / "neox", rope_parameters=None, rotary_pct=0.25, rotary_emb_base=12345)
    arch = convert_hf(str(tmp_path / "neox"), str(tmp_path / "neox.h5"))
    assert arch.rotary_dim == 4 and arch.rope_theta == 12345.0
    save_tiny_model("llama", tmp_path / "llama")
    _edit_config(tmp_path / "llama", rope_parameters=None, rope_theta=2e5, rope_scaling=None)
    assert convert_hf(str(tmp_path / "llama"), str(tmp_path / "llama.h5")).rope_theta == 2e5
