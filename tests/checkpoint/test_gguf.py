"""GGUF converter: every tensor and every token id against Hugging Face transformers loading the same GGUF file,
a permutation round trip on a tiny synthetic file, and the errors a user can cause.

The real model is SmolLM2-135M-Instruct Q4_1 (TOOLCHAIN.md, "Real weights and text, with no hub"); the tests that
need it are skipped when it is absent. Set HPCINFER_SMOLLM2_GGUF to use a copy elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from pydoc_data.topics import topics  # real English prose in the standard library

gguf = pytest.importorskip("gguf")

from hpcinfer.arch import tensor_shapes  # noqa: E402
from hpcinfer.checkpoint.format import open_checkpoint  # noqa: E402
from hpcinfer.checkpoint.gguf import convert_gguf  # noqa: E402
from hpcinfer.errors import CheckpointError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / os.environ.get("HPCINFER_SMOLLM2_GGUF", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smollm2 = pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"{SMOLLM2} not present (see TOOLCHAIN.md)")

TEXTS = [
    "The capital of France is Paris. It has been the country's largest city since the Middle Ages, isn't it?",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 2024 tabs\t\tand  spaces\n\n",
    "Ünïcödé: naïve café, 東京タワー, Привет мир, emoji 🤖🚀, math ∑∫√, zero-width \u200b joiner",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces, numbers 1234567 3.14159 and <|endoftext|> inline",
]


# ---------------------------------------------------------------------------------------- SmolLM2 vs transformers

@pytest.fixture(scope="module")
def converted(smollm2_float_conversion):
    """convert_gguf's arch and the checkpoint it wrote (once per run: tests/conftest.py)."""
    out, arch = smollm2_float_conversion
    with open_checkpoint(str(out)) as ckpt:
        yield arch, ckpt


@pytest.fixture(scope="module")
def hf_offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def hf_model(hf_offline):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                                              dtype=torch.float32)
    return model


@pytest.fixture(scope="module")
def hf_tokenizer(hf_offline):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)


def _hf_name(name: str) -> tuple[str, bool]:
    """Canonical name -> (transformers Llama parameter name, whether ours is its transpose)."""
    fixed = {"embed.tokens": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name], False
    _, i, rest = name.split(".", 2)
    layer = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
             "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
             "attn.v.weight": "self_attn.v_proj.weight", "attn.o.weight": "self_attn.o_proj.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.down.weight": "mlp.down_proj.weight"}[rest]
    return f"model.layers.{i}.{layer}", rest in ("attn.o.weight", "mlp.down.weight")


@needs_smollm2
def test_architecture_matches_transformers_config(converted, hf_model):
    arch, _ = converted
    cfg = hf_model.config
    assert (arch.family, arch.norm, arch.position, arch.activation, arch.gated_mlp) == \
        ("llama", "rmsnorm", "rotary", "silu", True)
    assert (arch.vocab_size, arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.intermediate_size, arch.max_positions) == \
        (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
         cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == \
        (49152, 576, 30, 9, 3, 64, 1536, 8192)
    assert arch.rotary_dim == arch.head_dim
    assert arch.norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert arch.rope_theta == cfg.rope_parameters["rope_theta"] == 1e5
    assert arch.tied_embeddings and cfg.tie_word_embeddings
    assert not (arch.qkv_bias or arch.out_bias or arch.mlp_bias)
    assert (arch.bos_token_id, arch.eos_token_ids) == (cfg.bos_token_id, (cfg.eos_token_id,))


@needs_smollm2
def test_every_tensor_equals_transformers(converted, hf_model):
    arch, ckpt = converted
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    shapes = tensor_shapes(arch)
    worst = 0.0
    for name, shape in shapes.items():
        hf_name, transposed = _hf_name(name)
        ref = params[hf_name].detach().numpy()
        ref = ref.T if transposed else ref
        ours = ckpt.read(name)
        assert ours.shape == shape == ref.shape, name
        diff = float(np.max(np.abs(ours - ref)))
        assert diff < 1e-6, f"{name}: max abs diff {diff} against {hf_name}"
        worst = max(worst, diff)
    assert len(shapes) == 1 + 30 * 9 + 1  # embedding, 9 per layer, final norm: nothing skipped
    print(f"max abs diff over {len(shapes)} tensors: {worst:.3g}")
    # The tied head really is the embedding in transformers, so comparing embed.tokens covers it.
    assert params["lm_head.weight"].data_ptr() == params["model.embed_tokens.weight"].data_ptr()


@needs_smollm2
def test_smollm2_greedy_continuations_match_transformers(converted, hf_model):
    """The real model end to end: hpcinfer on the converted checkpoint against transformers on the GGUF, on
    plain text, a chat turn and a longer prose prompt, batched together (mixed lengths)."""
    import torch

    from hpcinfer.api import generate, load_model, prompt_logits
    from hpcinfer.generate.tokenizer import TextTokenizer

    _, ckpt = converted
    model = load_model(ckpt.path)
    tok = TextTokenizer.from_checkpoint(ckpt)
    prompts = [tok.encode("The capital of France is"), tok.encode_chat("What is the capital of France?"),
               tok.encode(topics["for"][:400])]
    new = 12
    ours = generate(model, prompts, new)
    hf_model.generation_config.eos_token_id = None           # pure argmax for exactly `new` tokens, as ours
    ref = []
    for p in prompts:
        out = hf_model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    assert ours == ref
    assert tok.decode(ours[0]).startswith(" Paris")
    with torch.inference_mode():
        hf_last = hf_model(torch.tensor([prompts[0]])).logits[0, -1].numpy()
    assert np.abs(prompt_logits(model, prompts[:1])[0] - hf_last).max() < 1e-3


def _dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """ggml block_q8_0: fp16 scale d, then 32 int8 q; x = d * q."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    return (d * blocks[..., 2:].view(np.int8)).reshape(raw.shape[0], -1)


def _dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """ggml block_q4_1: fp16 scale d, fp16 minimum m, 16 bytes of nibbles (low: x0..x15, high: x16..x31)."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[..., 4:] & 0x0F, blocks[..., 4:] >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


@needs_smollm2
def test_dequantization_matches_block_formats(converted):
    """transformers dequantizes llama GGUFs with the same `gguf` package, so check its arithmetic by hand once."""
    _, ckpt = converted
    reader = gguf.GGUFReader(str(SMOLLM2))
    tensors = {t.name: t for t in reader.tensors}
    cases = [("token_embd.weight", "embed.tokens", "Q8_0", _dequantize_q8_0),
             ("blk.3.attn_v.weight", "layers.3.attn.v.weight", "Q4_1", _dequantize_q4_1),
             ("blk.3.ffn_up.weight", "layers.3.mlp.up.weight", "Q4_1", _dequantize_q4_1)]
    for gguf_name, name, qtype, dequantize in cases:
        tensor = tensors[gguf_name]
        assert tensor.tensor_type.name == qtype
        np.testing.assert_allclose(ckpt.read(name), dequantize(np.asarray(tensor.data)), rtol=0, atol=1e-6)


@needs_smollm2
def test_tokenizer_encodes_like_transformers(converted, hf_tokenizer):
    from tokenizers import Tokenizer

    _, ckpt = converted
    ours = Tokenizer.from_str(ckpt.tokenizer_json())
    assert ours.get_vocab_size(with_added_tokens=True) == 49152  # special tokens reuse their ids
    for text in TEXTS:
        ref = hf_tokenizer(text)["input_ids"]
        ids = ours.encode(text).ids
        assert ids == ref, text
        assert ours.decode(ids, skip_special_tokens=False) == text == hf_tokenizer.decode(ref)
    prose = "".join(topics.values())[:100_000]
    assert ours.encode(prose).ids == hf_tokenizer(prose)["input_ids"]
    assert ours.encode("<|im_start|>user\nHi<|im_end|>").ids[0] == 1
    assert ours.encode("<|im_start|>user\nHi<|im_end|>").ids[-1] == 2


@needs_smollm2
def test_tokenizer_attributes(converted, hf_tokenizer):
    _, ckpt = converted
    attrs = ckpt.tokenizer_attrs()
    assert attrs["bos_token"] == hf_tokenizer.bos_token == "<|im_start|>"
    assert attrs["eos_token"] == hf_tokenizer.eos_token == "<|im_end|>"
    assert attrs["chat_template"] == hf_tokenizer.chat_template
    assert "<|im_start|>" in attrs["chat_template"]


# ------------------------------------------------------------------------------------------ synthetic GGUF files

def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF layout -> GGUF layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama(path: Path, arch: str = "llama", embed_dtype=np.float32, extra_tensor: str | None = None):
    """One-layer Llama GGUF with F32 tensors (D=8, 2 heads / 1 KV head, F=16, V=16); returns HF-layout weights."""
    rng = np.random.default_rng(0)
    D, F, V, H, Hkv, hd = 8, 16, 16, 2, 1, 4
    hf = {"token_embd.weight": rng.standard_normal((V, D)), "output_norm.weight": rng.standard_normal(D),
          "blk.0.attn_norm.weight": rng.standard_normal(D), "blk.0.ffn_norm.weight": rng.standard_normal(D),
          "blk.0.attn_q.weight": rng.standard_normal((H * hd, D)),
          "blk.0.attn_k.weight": rng.standard_normal((Hkv * hd, D)),
          "blk.0.attn_v.weight": rng.standard_normal((Hkv * hd, D)),
          "blk.0.attn_output.weight": rng.standard_normal((D, H * hd)),
          "blk.0.ffn_gate.weight": rng.standard_normal((F, D)), "blk.0.ffn_up.weight": rng.standard_normal((F, D)),
          "blk.0.ffn_down.weight": rng.standard_normal((D, F))}
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    for name, value in hf.items():
        if name == "blk.0.attn_q.weight":
            value = _permute_like_llama_cpp(value, H)
        elif name == "blk.0.attn_k.weight":
            value = _permute_like_llama_cpp(value, Hkv)
        elif name == "token_embd.weight":
            value = value.astype(embed_dtype)
        w.add_tensor(name, value)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(D, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tiny_llama_round_trip(tmp_path):
    src, out = tmp_path / "tiny.gguf", tmp_path / "tiny.h5"
    hf = _write_tiny_llama(src)
    arch = convert_gguf(str(src), str(out), dtype="float16")
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.max_positions, arch.rope_theta) == \
        (2, 1, 4, 64, 500000.0)
    assert arch.norm_eps == 1e-6 and arch.tied_embeddings and arch.bos_token_id == -1
    with open_checkpoint(str(out)) as ckpt:
        assert ckpt.dtype == "float16" and ckpt.tokenizer_json() is None
        pairs = {"embed.tokens": "token_embd.weight", "layers.0.attn.q.weight": "blk.0.attn_q.weight",
                 "layers.0.attn.k.weight": "blk.0.attn_k.weight", "layers.0.mlp.up.weight": "blk.0.ffn_up.weight"}
        for name, gguf_name in pairs.items():
            np.testing.assert_array_equal(ckpt.read(name), hf[gguf_name].astype(np.float16))
        np.testing.assert_array_equal(ckpt.read("layers.0.attn.o.weight"),
                                      hf["blk.0.attn_output.weight"].T.astype(np.float16))
        np.testing.assert_array_equal(ckpt.read("layers.0.mlp.down.weight"),
                                      hf["blk.0.ffn_down.weight"].T.astype(np.float16))


# -------------------------------------------------------------------------------------------------------- errors

def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        convert_gguf(str(path), str(tmp_path / "out.h5"))
    assert str(path) in str(info.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04 this is not a gguf file" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF file") as info:
        convert_gguf(str(path), str(tmp_path / "out.h5"))
    assert str(path) in str(info.value)
    assert not (tmp_path / "out.h5").exists()


def test_truncated_gguf_file(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00\x10")
    with pytest.raises(CheckpointError, match="damaged") as info:
        convert_gguf(str(path), str(tmp_path / "out.h5"))
    assert str(path) in str(info.value)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_tiny_llama(path, arch="gpt2")
    with pytest.raises(CheckpointError, match="'gpt2' model; the GGUF converter supports llama") as info:
        convert_gguf(str(path), str(tmp_path / "out.h5"))
    assert str(path) in str(info.value)


def test_unsupported_tensor_type(tmp_path):
    path, out = tmp_path / "f64.gguf", tmp_path / "out.h5"
    _write_tiny_llama(path, embed_dtype=np.float64)
    with pytest.raises(CheckpointError, match="'token_embd.weight' is stored as F64") as info:
        convert_gguf(str(path), str(out))
    assert str(path) in str(info.value)
    assert not out.exists() and not list(tmp_path.glob("out.h5.tmp*"))


def test_unknown_tensor(tmp_path):
    path = tmp_path / "extra.gguf"
    _write_tiny_llama(path, extra_tensor="blk.0.attn_q_norm.weight")
    with pytest.raises(CheckpointError, match="blk.0.attn_q_norm.weight"):
        convert_gguf(str(path), str(tmp_path / "out.h5"))


def test_bad_dtype(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path)
    with pytest.raises(CheckpointError, match="float64"):
        convert_gguf(str(path), str(tmp_path / "out.h5"), dtype="float64")


# ------------------------------------------------------------------------------ synthetic Q4_1 / Q8_0 GGUF, kept

def _write_quantized_llama(path: Path, layer_kind: str = "Q4_1") -> None:
    """One-layer Llama GGUF whose matrices are Q4_1 blocks (or `layer_kind`) and whose embedding is Q8_0 (SmolLM2's
    layout, at D=64, 4 heads / 2 KV heads, F=128, V=64: every tp=2 shard holds whole blocks of 32)."""
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    D, F, V, H, Hkv, hd = 64, 128, 64, 4, 2, 16
    shapes = {"token_embd.weight": (V, D), "blk.0.attn_q.weight": (H * hd, D), "blk.0.attn_k.weight": (Hkv * hd, D),
              "blk.0.attn_v.weight": (Hkv * hd, D), "blk.0.attn_output.weight": (D, H * hd),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D), "blk.0.ffn_down.weight": (D, F)}
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, D),
                       (w.add_feed_forward_length, F), (w.add_head_count, H), (w.add_head_count_kv, Hkv),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10000.0)):
        add(value)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    for name, shape in shapes.items():
        kind = gguf.GGMLQuantizationType[layer_kind if name != "token_embd.weight" else "Q8_0"]
        value = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        w.add_tensor(name, quantize(value, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def kept_tiny(tmp_path_factory):
    """(plain conversion, --keep-quantized conversion) of the synthetic Q4_1 / Q8_0 file, through the CLI."""
    from hpcinfer.cli import main

    root = tmp_path_factory.mktemp("gguf-kept")
    _write_quantized_llama(root / "tiny.gguf")
    assert main(["convert", str(root / "tiny.gguf"), str(root / "plain.h5")]) == 0
    assert main(["convert", str(root / "tiny.gguf"), str(root / "kept.h5"), "--keep-quantized"]) == 0
    return root


def test_keep_quantized_stores_q4_1_and_q8_0_blocks_that_dequantize_to_the_plain_conversion(kept_tiny):
    from hpcinfer.arch import tensor_shapes as shapes_of
    from hpcinfer.quant import storage

    with open_checkpoint(str(kept_tiny / "plain.h5")) as plain, open_checkpoint(str(kept_tiny / "kept.h5")) as kept:
        assert kept.quantization == "gguf" and plain.quantization == "none"
        modes = {name: str(kept.file[f"{name}.q"].attrs["mode"]) for name in shapes_of(kept.arch)
                 if storage.is_stored_quantized(kept.file, name)}
        assert modes.pop("embed.tokens") == "q8_0"
        assert set(modes.values()) == {"q4_1"} and len(modes) == 7
        for name in shapes_of(kept.arch):
            np.testing.assert_array_equal(kept.read(name), plain.read(name), err_msg=name)


def test_kept_checkpoint_gives_identical_tokens_at_tp1_and_tp2(kept_tiny, run_cli, repo_root, tmp_path):
    """The kept Q4_1 / Q8_0 blocks shard for tp=2 like dense weights: the same tokens as one rank, and as the
    plain (dequantized) conversion."""
    import json

    (tmp_path / "p.jsonl").write_text('{"id": 0, "tokens": [1, 2, 3, 4, 5]}\n{"id": 1, "tokens": [60, 7]}\n')
    from cli_helpers import run_job

    outputs = {}
    for key, ckpt, tp in (("kept1", "kept.h5", 1), ("kept2", "kept.h5", 2), ("plain1", "plain.h5", 1)):
        text = run_job(run_cli, repo_root, kept_tiny / ckpt, tmp_path / "p.jsonl", tmp_path / f"{key}.jsonl", tp,
                       [f"parallel.tp={tp}"], 6)
        outputs[key] = [json.loads(line)["output_tokens"] for line in text.splitlines()]
    assert [len(t) for t in outputs["kept1"]] == [6, 6]
    assert outputs["kept2"] == outputs["kept1"] == outputs["plain1"]


def test_keep_quantized_refuses_quantize_and_non_gguf_sources(kept_tiny, tmp_path, capsys):
    """--keep-quantized with --quantize, and on a Hugging Face folder: a clear error, exit 2, no file written."""
    from hpcinfer.cli import main

    out = tmp_path / "x.h5"
    assert main(["convert", str(kept_tiny / "tiny.gguf"), str(out), "--keep-quantized", "--quantize", "int4"]) == 2
    assert "cannot be combined with --quantize" in capsys.readouterr().err
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["convert", str(folder), str(out), "--keep-quantized"]) == 2
    err = capsys.readouterr().err
    assert "--keep-quantized applies to .gguf sources only" in err
    assert not out.exists()


# ------------------------------------------------------------------ issue 22: quantizing follows the source's grid

LAYER_MATRICES = ("layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.attn.v.weight",
                  "layers.0.attn.o.weight", "layers.0.mlp.gate.weight", "layers.0.mlp.up.weight",
                  "layers.0.mlp.down.weight")


def _stored(path) -> dict:
    """tensor name -> (mode, group size) of every matrix a checkpoint stores quantized."""
    from hpcinfer.quant import storage

    with open_checkpoint(str(path)) as ckpt:
        return {name: (str(ckpt.file[f"{name}.q"].attrs["mode"]), int(ckpt.file[f"{name}.q"].attrs["group_size"]))
                for name in tensor_shapes(ckpt.arch) if storage.is_stored_quantized(ckpt.file, name)}


def _same_values(a, b, names) -> None:
    with open_checkpoint(str(a)) as x, open_checkpoint(str(b)) as y:
        for name in names:
            np.testing.assert_array_equal(x.read(name), y.read(name), err_msg=name)


@pytest.fixture
def hpcinfer_log():
    """Lines the "hpcinfer" logger emits (info and up) while a test runs, as (level name, message)."""
    import logging

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))

    logger, handler = logging.getLogger("hpcinfer"), Keep()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_default_int4_conversion_puts_every_group_on_the_q4_1_grid(kept_tiny, tmp_path, capsys):
    """`convert --quantize int4` with no group size, from a Q4_1 source: every layer matrix is int4 in groups of 32
    (the Q4_1 blocks, kept: exactly the plain conversion's values), the Q8_0 embedding keeps its 8-bit blocks, and
    one log line says which groups were chosen and why. `--quantize-embedding same` makes the embedding int4 g32."""
    from hpcinfer.cli import main

    out = tmp_path / "int4.h5"
    assert main(["convert", str(kept_tiny / "tiny.gguf"), str(out), "--quantize", "int4"]) == 0
    err = capsys.readouterr().err
    grid_lines = [line for line in err.splitlines() if "block grid" in line]
    assert grid_lines == ["hpcinfer: int4 in groups of 32, on the source's block grid (Q4_1; no group size given); "
                          "the embedding / LM head at 8 bits (quantize_embedding = \"same\" makes them int4)"]
    assert "warning" not in err
    stored = _stored(out)
    assert stored == {**{name: ("int4", 32) for name in LAYER_MATRICES}, "embed.tokens": ("q8_0", 32)}
    _same_values(out, kept_tiny / "plain.h5", list(stored))                    # no second rounding anywhere

    same = tmp_path / "int4-embed4.h5"
    assert main(["convert", str(kept_tiny / "tiny.gguf"), str(same), "--quantize", "int4",
                 "--quantize-embedding", "same"]) == 0
    assert _stored(same) == {**stored, "embed.tokens": ("int4", 32)}


def test_default_int4_conversion_keeps_q4_0_blocks_as_int4(tmp_path):
    """A Q4_0 source's blocks (x = d (q - 8)) are int4 in groups of 32 already (scale d, minimum -8 d): kept,
    bit-identical to what the gguf package dequantizes."""
    _write_quantized_llama(tmp_path / "q4_0.gguf", layer_kind="Q4_0")
    convert_gguf(str(tmp_path / "q4_0.gguf"), str(tmp_path / "plain.h5"))
    convert_gguf(str(tmp_path / "q4_0.gguf"), str(tmp_path / "int4.h5"), quantize="int4")
    stored = _stored(tmp_path / "int4.h5")
    assert {stored[name] for name in LAYER_MATRICES} == {("int4", 32)}
    _same_values(tmp_path / "int4.h5", tmp_path / "plain.h5", LAYER_MATRICES)


def test_a_group_off_the_source_grid_is_a_warning_naming_the_loss(kept_tiny, tmp_path, capsys):
    """--group-size 64 on Q4_1 blocks of 32 is what was asked (groups of 64, re-quantized), with a warning that
    names the double rounding, its measured cost and the groups that fit; 16 divides the blocks: no warning."""
    from hpcinfer.cli import main

    off = tmp_path / "g64.h5"
    assert main(["convert", str(kept_tiny / "tiny.gguf"), str(off), "--quantize", "int4", "--group-size", "64"]) == 0
    err = capsys.readouterr().err
    assert ("hpcinfer: warning: --group-size 64 does not divide into the source's Q4_1 blocks of 32: int4 rounds "
            "every weight a second time") in err
    assert "1.26x float32 perplexity" in err and "use 32 or a divisor of it" in err
    assert {_stored(off)[name] for name in LAYER_MATRICES} == {("int4", 64)}

    assert main(["convert", str(kept_tiny / "tiny.gguf"), str(tmp_path / "g16.h5"), "--quantize", "int4",
                 "--group-size", "16"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert {_stored(tmp_path / "g16.h5")[name] for name in LAYER_MATRICES} == {("int4", 16)}


def test_quantize_at_load_follows_the_grid_a_float_conversion_recorded(kept_tiny, hpcinfer_log):
    """The plain conversion records each tensor's GGUF grid; `[model] quantize = "int4"` with quantize_group unset
    (or 0) then uses groups of 32 and logs it, a given 64 is a logged warning, and a Hugging Face-like float
    checkpoint with no grid keeps the default 64."""
    from hpcinfer.quant import storage

    with open_checkpoint(str(kept_tiny / "plain.h5")) as ckpt:
        assert storage.source_grid(ckpt.file, "layers.0.attn.q.weight") == ("Q4_1", 32, 4)
        for unset in (None, 0):
            quant = storage.load_quant(ckpt, "int4", unset)
            assert (quant.group_size, quant.group_given) == (32, False)
        assert hpcinfer_log[-1] == ("INFO", "int4 in groups of 32, on the source's block grid (Q4_1; no group size "
                                            "given); the embedding / LM head at 8 bits (quantize_embedding = "
                                            "\"same\" makes them int4)")
        modes = storage.quant_of(ckpt, storage.load_quant(ckpt, "int4"))
        assert modes("layers.0.mlp.down.weight") == ("int4", 32) and modes("embed.tokens")[0] == "int8"
        assert storage.load_quant(ckpt, "int4", 64).group_size == 64
        level, line = hpcinfer_log[-1]
        assert level == "WARNING" and line.startswith("[model] quantize_group 64 does not divide into the "
                                                      "source's Q4_1 blocks of 32")
        embed4 = storage.load_quant(ckpt, "int4", None, "same")
        assert storage.quant_of(ckpt, embed4)("embed.tokens") == ("int4", 32)
        with pytest.raises(Exception, match=r"quantize_embedding = 'int2' is not allowed; choose one of int8, same"):
            storage.load_quant(ckpt, "int4", None, "int2")


def test_quantize_at_load_of_a_kept_checkpoint_keeps_its_blocks(kept_tiny, hpcinfer_log):
    """A --keep-quantized checkpoint takes `[model] quantize = "int4"` now: its Q4_1 blocks already are 4 bits, so
    they are read as they are (as int4 g32), and so is the Q8_0 embedding (8 bits, the default); with
    quantize_embedding = "same" the embedding is re-quantized to int4 g32, and a given group of 64 re-quantizes
    the layers too (asked), with the warning."""
    from hpcinfer.quant import storage
    from hpcinfer.quant.formats import dequantize

    with open_checkpoint(str(kept_tiny / "kept.h5")) as ckpt:
        storage.configure(ckpt, "int4")
        q = storage.load_matrix(ckpt, "layers.0.attn.q.weight")
        stored = storage.read_quantized(ckpt.file, "layers.0.attn.q.weight")
        assert (q.mode, q.group_size, stored.mode) == ("int4", 32, "q4_1")
        np.testing.assert_array_equal(q.q, stored.q)
        np.testing.assert_array_equal(q.scale, stored.scale)
        assert storage.load_matrix(ckpt, "embed.tokens").mode == "q8_0"
        assert storage.quant_of(ckpt)("layers.0.mlp.up.weight") == ("int4", 32)

        storage.configure(ckpt, "int4", None, "same")
        embed = storage.load_matrix(ckpt, "embed.tokens")
        assert (embed.mode, embed.group_size) == ("int4", 32)
        storage.configure(ckpt, "int4", 64)
        assert hpcinfer_log[-1][0] == "WARNING"
        down = storage.load_matrix(ckpt, "layers.0.mlp.down.weight", cols=slice(0, 128))     # all F = 128 inputs
        assert (down.mode, down.group_size) == ("int4", 64)
        np.testing.assert_allclose(dequantize(down), dequantize(storage.read_quantized(
            ckpt.file, "layers.0.mlp.down.weight")), atol=float(down.scale.max()) / 2 + 1e-7)


def test_inspect_shows_each_tensors_format_group_and_bytes_per_parameter(kept_tiny, tmp_path, capsys):
    from hpcinfer.cli import main

    out = tmp_path / "int4.h5"
    assert main(["convert", str(kept_tiny / "tiny.gguf"), str(out), "--quantize", "int4"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line.split("]", 1)[1].split() for line in text.splitlines() if line.startswith("  ") and "]" in line}
    assert rows["layers.0.attn.q.weight"] == ["int4", "g32", "0.7500"]           # 0.5 + 2 x 4 bytes / 32
    assert rows["embed.tokens"] == ["q8_0", "g32", "1.1250"]                     # 1 + 4 bytes / 32
    assert rows["final_norm.weight"] == ["float32", "4.0000"]
    with open_checkpoint(str(out)) as ckpt:
        total = sum(int(ds.nbytes) for ds in ckpt.file.values() if hasattr(ds, "nbytes") and
                    not ds.name.startswith("/tokenizer") and not ds.name.startswith("/_"))
        params = sum(int(np.prod(shape)) for shape in tensor_shapes(ckpt.arch).values())
    assert f"bytes: {total:,} for all tensors, {total / params:.4f} bytes per parameter" in text
    plain = main(["inspect", str(kept_tiny / "plain.h5")])
    assert plain == 0 and "float32 (source Q4_1 g32)" in capsys.readouterr().out
