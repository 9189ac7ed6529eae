"""Weight quantization (docs/quantization.md): formats, checkpoint storage, quantized layers, end to end."""

import os
from pathlib import Path

import numpy as np
import pytest

from hf_models import save_tiny_model
from hpcinfer.api import generate, load_model, prompt_logits
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.comm.group import Groups
from hpcinfer.errors import CheckpointError, ConfigError
from hpcinfer.model.transformer import Decoder
from hpcinfer.parallel.layers import ColumnParallelLinear, RowParallelLinear
from hpcinfer.quant import storage
from hpcinfer.quant.formats import (QuantError, dequantize, pack4, quantize, slice_cols, slice_rows, unpack4)

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / os.environ.get("HPCINFER_SMOLLM2_GGUF", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def _weights(rows=12, cols=256, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.1, 3, (rows, 1))).astype(np.float32)


def float32_matmul_bound(x, w, bias=None):
    """Elementwise bound on |fl32(x @ w.T + bias) - (x @ w.T + bias)| (exact, i.e. in float64), for x [T, n] and
    w [O, n] float32 (a dequantized weight: the same float32 values both sides). Each output is n products summed
    in some order and one bias add, all in float32 (unit roundoff u = 2^-24): whatever order or blocking the BLAS
    uses, the error is at most gamma_(n+1) (|x| @ |w|.T + |bias|), gamma_k = k u / (1 - k u) <= (k + 1) u here
    (Higham, Accuracy and Stability, 3.1). The float64 reference's own error (n 2^-53 relative) is 2^-29 of that
    and covered by the + 1 in n + 2; + 1e-30 for outputs that are exactly 0."""
    x64, w64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    n = x64.shape[-1]
    magnitude = x64 @ w64.T + (0.0 if bias is None else np.abs(np.asarray(bias, np.float64)))
    return (n + 2) * 2.0 ** -24 * magnitude + 1e-30


# ---- formats --------------------------------------------------------------------------------------------------
def test_int8_symmetric_round_trip_within_half_a_step():
    w = _weights()
    qt = quantize(w, "int8")
    assert qt.q.dtype == np.int8 and qt.scale.shape == (12, 1) and qt.min is None
    err = np.abs(dequantize(qt) - w)
    assert np.all(err <= qt.scale / 2 * (1 + 1e-5) + 1e-7)
    assert np.allclose(qt.scale[:, 0], np.abs(w).max(axis=1) / 127)


@pytest.mark.parametrize("mode,bits,group", [("int4", 4, 64), ("int4", 4, 32), ("asym8", 8, 64)])
def test_asymmetric_round_trip_within_half_a_step_per_group(mode, bits, group):
    w = _weights()
    qt = quantize(w, mode, group)
    groups = w.reshape(12, -1, group)
    step = (groups.max(-1) - groups.min(-1)) / (2 ** bits - 1)                  # [O, G]
    err = np.abs(dequantize(qt) - w).reshape(12, -1, group)
    assert np.all(err <= step[..., None] / 2 * (1 + 1e-5) + 1e-6)
    assert qt.scale.shape == (12, 256 // group) and qt.min.shape == qt.scale.shape
    assert qt.q.shape == ((12, 128) if bits == 4 else (12, 256))


def test_4bit_packing_is_low_nibble_first():
    values = np.array([[1, 2, 15, 0, 7, 9]], dtype=np.uint8)
    packed = pack4(values)
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert np.array_equal(unpack4(packed), values)


def test_constant_group_dequantizes_exactly():
    w = np.full((2, 64), 0.75, dtype=np.float32)
    assert np.array_equal(dequantize(quantize(w, "int4")), w)
    assert np.array_equal(dequantize(quantize(np.zeros((2, 64), np.float32), "int8")), np.zeros((2, 64)))


@pytest.mark.parametrize("mode", ["int8", "int4", "asym8", "q8_0", "q4_1"])
def test_tp2_shards_equal_shards_of_the_dequantized_weight(mode):
    w = _weights(8, 256)
    full = dequantize(quantize(w, mode, 64))
    for rank in (0, 1):
        rows, cols = slice(4 * rank, 4 * rank + 4), slice(128 * rank, 128 * rank + 128)
        assert np.array_equal(dequantize(slice_rows(quantize(w, mode, 64), rows)), full[rows])
        assert np.array_equal(dequantize(slice_cols(quantize(w, mode, 64), cols)), full[:, cols])


@pytest.mark.parametrize("mode", ["int4", "q4_1"])
def test_tp3_shards_equal_shards_of_the_dequantized_weight(mode):
    """tp = 3 (SmolLM2's degree: 9 heads) without the model: 576 input columns, 192 per shard, so int4 g64 puts
    3 groups and q4_1 (g32) 6 in each row-parallel shard and the shard edges 192 and 384 fall on group edges
    inside the row; each shard's q, scale and min are the columns' own, and dequantize to the whole weight's."""
    w = _weights(9, 576, seed=3)
    whole = quantize(w, mode, 64)
    full = dequantize(whole)
    g = whole.group_size
    for rank in range(3):
        rows, cols = slice(3 * rank, 3 * rank + 3), slice(192 * rank, 192 * rank + 192)
        shard = slice_cols(whole, cols)
        assert shard.scale.shape == (9, 192 // g) and shard.q.shape == (9, 96)
        own = quantize(w[:, cols], mode, 64)                     # quantizing the shard alone: the same arrays
        for part in ("q", "scale", "min"):
            assert np.array_equal(getattr(shard, part), getattr(own, part)), (mode, rank, part)
        assert np.array_equal(dequantize(shard), full[:, cols])
        assert np.array_equal(dequantize(slice_rows(whole, rows)), full[rows])


def test_shard_that_splits_a_group_is_refused():
    with pytest.raises(QuantError, match=r"group size 64 .* 96:192"):
        slice_cols(quantize(_weights(4, 192), "int4", 64), slice(96, 192))
    # tp = 3 of 384 input columns: 128 per shard, which g64 divides but g = 96 would not (it divides 384): the
    # first shard's edge 128 falls inside the second group.
    with pytest.raises(QuantError, match=r"group size 96 .* 0:128"):
        slice_cols(quantize(_weights(3, 384), "int4", 96), slice(0, 128))
    with pytest.raises(QuantError, match=r"group size 96 does not divide the input dimension 128"):
        quantize(_weights(3, 384)[:, :128], "int4", 96)          # quantized at load: each rank its own shard


@pytest.mark.parametrize("mode", ["int8", "int4", "asym8", "q4_1", "q8_0"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_quantized_matmul_matches_dequantize_then_matmul_in_float64(mode, tokens):
    w = _weights(300, 128)
    qt = quantize(w, mode, 64)
    x = np.random.default_rng(1).standard_normal((tokens, 128)).astype(np.float32)
    bias = np.linspace(-1, 1, 300).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(qt).astype(np.float64).T + bias
    ops = NumpyOps()
    import hpcinfer.backend.numpy_ops as numpy_ops
    old, numpy_ops.QUANT_TILE = numpy_ops.QUANT_TILE, 128                        # several tiles, one partial
    try:
        got = ops.linear_q(x, qt, bias)
    finally:
        numpy_ops.QUANT_TILE = old
    assert np.all(np.abs(got - want) <= float32_matmul_bound(x, dequantize(qt), bias))
    ids = np.array([3, 299, 3, 0])
    assert np.array_equal(ops.embedding_q(qt, ids), dequantize(qt)[ids])


def test_bad_group_size_and_unknown_mode():
    with pytest.raises(QuantError, match=r"group size 48 does not divide the input dimension 64"):
        quantize(_weights(2, 64), "int4", 48)
    with pytest.raises(QuantError, match="unknown quantization mode 'int3'"):
        quantize(_weights(2, 64), "int3")


# ---- checkpoints and layers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    folder = save_tiny_model("llama", root / "hf")
    paths = {"float32": str(root / "f32.h5")}
    convert_hf(folder, paths["float32"])
    for mode in ("int8", "int4"):
        paths[mode] = str(root / f"{mode}.h5")
        convert_hf(folder, paths[mode], quantize=mode, group_size=16)
    return paths


def test_quantized_checkpoint_stores_q_scale_min_and_opens(llama):
    with open_checkpoint(llama["int4"]) as ckpt:
        assert ckpt.quantization == "int4" and ckpt.file.attrs["format_version"] == 2
        f = ckpt.file
        assert "layers.0.mlp.down.weight" not in f and f["layers.0.mlp.down.weight.q"].dtype == np.uint8
        attrs = f["layers.0.mlp.down.weight.q"].attrs
        assert (attrs["mode"], attrs["bits"], attrs["group_size"], bool(attrs["transposed"])) == ("int4", 4, 16, True)
        assert ckpt.shape("layers.0.mlp.down.weight") == (96, 64)          # stored float layout [in, out]
        assert ckpt.read("layers.0.mlp.down.weight").shape == (96, 64)
        assert "layers.0.mlp.down.weight.min" in f and "layers.0.attn_norm.weight" in f
    with open_checkpoint(llama["int8"]) as ckpt:
        assert ckpt.file["embed.tokens.q"].dtype == np.int8 and "embed.tokens.min" not in ckpt.file


def test_version_1_checkpoint_still_opens(llama, tmp_path):
    import h5py
    import shutil

    old = tmp_path / "v1.h5"
    shutil.copy(llama["float32"], old)
    with h5py.File(old, "r+") as f:
        f.attrs["format_version"] = 1
        del f.attrs["quantization"]
    with open_checkpoint(str(old)) as ckpt:
        assert ckpt.quantization == "none"


class LoadOnlyGroup:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("source", ["stored", "load"])
def test_tp2_quantized_layers_hold_shards_of_the_dequantized_weight(llama, source):
    """Column- and row-parallel shards (and the vocabulary shard) of a quantized weight, dequantized, equal the
    same shards of the whole dequantized weight, whether quantized at convert or at load."""
    path = llama["int4"] if source == "stored" else llama["float32"]
    with open_checkpoint(path) as ckpt:
        if source == "load":
            storage.configure(ckpt, "int4", 16)
        full = {n: ckpt.read(n) if source == "stored" else None for n in ("layers.0.mlp.gate.weight",
                                                                          "layers.0.mlp.down.weight")}
        if source == "load":
            full = {n: dequantize(quantize(ckpt.read(n).T if n.endswith("down.weight") else ckpt.read(n),
                                           "int4", 16)) for n in full}
            full["layers.0.mlp.down.weight"] = full["layers.0.mlp.down.weight"].T
        for rank in (0, 1):
            model = Decoder(NumpyOps(), Groups(tp=LoadOnlyGroup(2, rank)), ckpt.arch).load(ckpt)
            up, down = model.blocks[0].mlp.up, model.blocks[0].mlp.down
            assert isinstance(up, ColumnParallelLinear) and isinstance(down, RowParallelLinear)
            assert up.w is None and down.w is None
            gate_rows = dequantize(up.qw)[:48]                                  # gate part of the fused [gate, up]
            assert np.array_equal(gate_rows, full["layers.0.mlp.gate.weight"][48 * rank:48 * rank + 48])
            assert np.array_equal(dequantize(down.qw), full["layers.0.mlp.down.weight"][48 * rank:48 * rank + 48].T)


@pytest.fixture(scope="module")
def reference(llama):
    model = load_model(llama["float32"])
    return prompt_logits(model, PROMPTS), generate(model, PROMPTS, 6)


def test_int8_logits_close_to_float32(llama, reference):
    """int8 per-channel on the tiny llama (random weights at gain 2.5, which amplify errors layer by layer): RMS
    logit error <= 8% of the logits' std (measured 5.1%), max error <= 25% of it (measured 19%), the same prompt
    argmax and the same first 3 greedy tokens."""
    logits, tokens = reference
    for model in (load_model(llama["int8"]), load_model(llama["float32"], quantize="int8")):
        got = prompt_logits(model, PROMPTS)
        assert np.sqrt(np.mean((got - logits) ** 2)) <= 0.08 * logits.std()
        assert np.abs(got - logits).max() <= 0.25 * logits.std()
        assert np.array_equal(got.argmax(-1), logits.argmax(-1))
        assert [t[:3] for t in generate(model, PROMPTS, 6)] == [t[:3] for t in tokens]
    stored, on_load = load_model(llama["int8"]), load_model(llama["float32"], quantize="int8")
    assert np.array_equal(prompt_logits(stored, PROMPTS), prompt_logits(on_load, PROMPTS))


def test_int4_greedy_runs(llama, reference):
    model = load_model(llama["int4"])
    logits = prompt_logits(model, PROMPTS)
    assert np.all(np.isfinite(logits)) and np.corrcoef(logits.ravel(), reference[0].ravel())[0, 1] > 0.8
    tokens = generate(model, PROMPTS, 6)
    assert [len(t) for t in tokens] == [6, 6]
    held = sum(b.mlp.up.qw.nbytes for b in model.blocks)
    assert held == sum(b.mlp.up.qw.shape[0] * b.mlp.up.qw.shape[1] for b in model.blocks)  # g16: 1 byte/weight


def test_conflicting_quantize_setting(llama):
    with open_checkpoint(llama["int4"]) as ckpt:
        with pytest.raises(ConfigError, match=r"quantize = 'int8' conflicts with .* already quantized as 'int4'"):
            storage.configure(ckpt, "int8")
        with pytest.raises(ConfigError, match=r"quantize_group = 64 conflicts with .* stored in groups of 16"):
            storage.configure(ckpt, "int4", 64)
        storage.configure(ckpt, "int4", 16)
        storage.configure(ckpt, "int4")                                     # unset (0 too): the stored groups
        storage.configure(ckpt, "int4", 0)
        storage.configure(ckpt, "none", 64)                                 # "none": the stored groups as they are
    with open_checkpoint(llama["int8"]) as ckpt:
        storage.configure(ckpt, "int8", 64)                                 # int8: one group per row, any setting
    with open_checkpoint(llama["float32"]) as ckpt, pytest.raises(ConfigError, match="'int2' is not allowed"):
        storage.configure(ckpt, "int2")


def test_group_size_not_dividing_a_dimension(llama, tmp_path):
    folder = str(Path(llama["float32"]).parent / "hf")
    with pytest.raises(CheckpointError, match=r"group size 40 does not divide the input dimension 64"):
        convert_hf(folder, str(tmp_path / "bad.h5"), quantize="int4", group_size=40)
    assert not (tmp_path / "bad.h5").exists()
    with open_checkpoint(llama["float32"]) as ckpt:       # tp = 2: down's shard has 48 inputs, not a multiple of 32
        storage.configure(ckpt, "int4", 32)
        with pytest.raises(ConfigError, match=r"group size 32 does not divide the input dimension 48"):
            Decoder(NumpyOps(), Groups(tp=LoadOnlyGroup(2, 0)), ckpt.arch).load(ckpt)


def test_cli_convert_quantize(llama, tmp_path, capsys):
    from hpcinfer.cli import main

    folder = str(Path(llama["float32"]).parent / "hf")
    assert main(["convert", folder, str(tmp_path / "q.h5"), "--quantize", "int4", "--group-size", "32"]) == 0
    with open_checkpoint(str(tmp_path / "q.h5")) as ckpt:
        assert ckpt.quantization == "int4" and ckpt.file["layers.0.mlp.up.weight.q"].attrs["group_size"] == 32
        assert ckpt.file["embed.tokens.q"].attrs["mode"] == "int8"           # --quantize-embedding int8, the default
    assert main(["inspect", str(tmp_path / "q.h5")]) == 0
    assert "quantization int4" in capsys.readouterr().out


# ---- GGUF kept quantized --------------------------------------------------------------------------------------
@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"{SMOLLM2} not present")
def test_gguf_keep_quantized_dequantizes_to_the_plain_conversion(tmp_path, smollm2_float_conversion):
    pytest.importorskip("gguf")
    from hpcinfer.checkpoint.gguf import convert_gguf

    plain, kept = str(smollm2_float_conversion[0]), str(tmp_path / "kept.h5")     # plain: converted once per run
    convert_gguf(str(SMOLLM2), kept, keep_quantized=True)
    with open_checkpoint(plain) as a, open_checkpoint(kept) as b:
        assert b.quantization == "gguf"
        modes = {}
        for name in ("embed.tokens", "layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.3.attn.o.weight",
                     "layers.5.mlp.down.weight", "layers.7.mlp.up.weight"):
            if storage.is_stored_quantized(b.file, name):
                modes[name] = str(b.file[f"{name}.q"].attrs["mode"])
            assert np.array_equal(a.read(name), b.read(name)), name
        assert modes["embed.tokens"] == "q8_0" and "q4_1" in modes.values()
    tokens_plain = generate(load_model(plain), [[1, 2, 3]], 4)
    assert generate(load_model(kept), [[1, 2, 3]], 4) == tokens_plain


@pytest.mark.parametrize("mode", ["int8", "int4", "q4_1"])
def test_linear_q_memory_is_one_reused_tile(mode, monkeypatch):
    """NumpyOps.linear_q holds one float32 tile (plus a uint8 nibble tile for 4 bits) between calls, never a float
    copy of the weight: a repeated call allocates less than one tile beyond its output, and the scratch does not
    grow across calls."""
    import tracemalloc

    import hpcinfer.backend.numpy_ops as numpy_ops

    monkeypatch.setattr(numpy_ops, "QUANT_TILE", 128)
    w = _weights(2048, 256)                                         # float32 2 MiB; a 128-row tile: 128 KiB
    qt, x = quantize(w, mode, 64), np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    ops, tile = NumpyOps(), 128 * 256 * 4
    ops.linear_q(x, qt)
    held = {key: b.nbytes for key, b in ops._scratch.items()}
    assert sum(held.values()) <= tile + (tile // 4 if qt.bits == 4 else 0)
    tracemalloc.start()
    try:
        y = ops.linear_q(x, qt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < tile + y.nbytes and peak < w.nbytes / 8
    ops.linear_q(x[:1], qt)
    assert {key: b.nbytes for key, b in ops._scratch.items()} == held


def test_stored_checkpoint_shard_that_splits_a_group_is_refused(llama):
    """Reading a block of input columns of a stored int4 g16 matrix whose edge falls inside a group: a
    CheckpointError naming the tensor and asking for another tp degree."""
    with open_checkpoint(llama["int4"]) as ckpt:
        assert storage.read_quantized(ckpt.file, "layers.0.mlp.down.weight", cols=slice(48, 96)).shape == (64, 48)
        with pytest.raises(CheckpointError, match=r"tensor 'layers.0.mlp.down.weight': group size 16 .*40:80.*"
                                                  r"use a tp degree whose shards hold whole groups"):
            storage.read_quantized(ckpt.file, "layers.0.mlp.down.weight", cols=slice(40, 80))


# ---- bench/perplexity.py: attribution and search modes ---------------------------------------
def test_perplexity_bench_part_modes_and_search_quantize():
    """The bench's W-layers / W-embed / W-search names parse, and its clipping search keeps the int4 format (q in
    0..15, one scale and min per group) with a squared error no larger than min-max's (the (0, 0) clip is one of
    its candidates, refitted by least squares)."""
    from bench import perplexity as bench

    assert bench.split_weights("int4-g64-layers") == ("int4-g64", "layers")
    assert bench.split_weights("int8-embed") == ("int8", "embed")
    assert bench.split_weights("int4-g32") == ("int4-g32", "")
    assert bench.split_weights("q4_1-layers") == ("q4_1-layers", "")            # the kept GGUF has no float load
    w = _weights(64, 256, seed=4)
    qt, err_minmax, err_search = bench.search_quantize(w, "int4", 64, chunk_rows=24)
    assert qt.q.shape == (64, 128) and qt.scale.shape == qt.min.shape == (64, 4) and qt.group_size == 64
    assert np.isclose(err_minmax, float(((dequantize(quantize(w, "int4", 64)) - w).astype(np.float64) ** 2).sum()))
    assert np.isclose(err_search, float(((dequantize(qt) - w).astype(np.float64) ** 2).sum()))
    assert err_search < err_minmax


def test_model_section_quantize_keys(tmp_path):
    """[model] quantize_group defaults to 0 (= follow the source's block grid) and quantize_embedding to "int8";
    a value outside the choices is an error naming the key, the value and what is allowed."""
    from hpcinfer.config import load_config

    path = tmp_path / "job.toml"
    path.write_text('[model]\ncheckpoint = "m.h5"\nquantize = "int4"\n\n'
                    '[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n')
    config = load_config(str(path))
    assert (config.model.quantize_group, config.model.quantize_embedding) == (0, "int8")
    assert load_config(str(path), ["model.quantize_embedding=\"same\""]).model.quantize_embedding == "same"
    with pytest.raises(ConfigError, match=r"quantize_embedding.*'int4'.*int8, same"):
        load_config(str(path), ["model.quantize_embedding=\"int4\""])
    with pytest.raises(ConfigError, match=r"quantize_group.*must be >= 0"):
        load_config(str(path), ["model.quantize_group=-1"])
