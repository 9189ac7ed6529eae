"""Quantized KV cache (quant/kv.py, backend/kv_attention.py, generate/kv_cache.py): the row format, attention over
it against dequantize-then-attend in float64, the cache's bytes and its offload to host, the config checks."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.interface import StepLayout
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError
from hpcinfer.generate.kv_cache import KVCache, KVOffload
from hpcinfer.quant.formats import QuantError
from hpcinfer.quant.kv import FloatKV, QuantizedKV, kv_bytes_per_token, kv_format, kv_rows
from hpcinfer.quant.kv import QuantizedKV, dequantize_rows, kv_format, quantize_rows

OPS = NumpyOps()


def _rows(shape, seed=0):
    """Rows with a spread of offsets and ranges per group (and one constant group)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * rng.uniform(0.01, 20, size=shape[:-1] + (1,)) + rng.normal(size=shape[:-1] + (1,))
    x = x.astype(np.float32)
    x[0, 0, :] = 0.3                                                  # constant row: every group of it constant
    return x


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_round_trip_within_half_a_step_per_element(mode, group):
    fmt = kv_format(mode, group, 64)
    x = _rows((4, 6, 64), seed=group)
    q, scale, low = quantize_rows(x, fmt)
    assert q.dtype == np.uint8 and q.shape == (4, 6, 64 * fmt.bits // 8)
    assert scale.dtype == low.dtype == np.float16 and scale.shape == (4, 6, 64 // group)
    y = dequantize_rows(q, scale, low, fmt)
    step = np.repeat(scale.astype(np.float64), group, axis=-1)                 # [..., hd] the step of each value
    err = np.abs(x.astype(np.float64) - y)
    bound = step / 2 + 1e-6 * np.abs(x) + 1e-7                                 # + float32 multiply-add rounding
    assert np.all(err <= bound), float((err / np.maximum(bound, 1e-30)).max())
    assert np.abs(y[0, 0] - 0.3).max() < 1e-5                                  # a constant row: a tiny step
    check_scale_and_min(x, scale, low, group, (1 << fmt.bits) - 1)


def check_scale_and_min(x, scale, low, group, top):
    """The half-step bound above takes the step from the returned scale, so a scale too large would pass it; this
    pins (scale, min) to the group's own range. Derivation (quant/kv.quantize_rows):
      low = the largest float16 <= x.min, so  x.min - u <= low <= x.min,  u = the float16 spacing at |low| (the
        float16 neighbour of low towards x.min is at most that far);
      scale = the smallest float16 >= fl32(fl32(x.max - low) / top): two float32 roundings (relative 2^-24 each)
        and one float16 rounding up (relative 2^-10 for a normal float16, absolute 2^-24 below 2^-14), so
        (x.max - low) / top * (1 - 2^-23) <= scale <= (x.max - low) / top * (1 + 2^-10) * (1 + 2^-23) + 2^-24,
      with x.max - low = (x.max - x.min) + (x.min - low), the second part at most u."""
    x = x.astype(np.float64).reshape(*scale.shape, group)
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    low64, scale64 = low.astype(np.float64), scale.astype(np.float64)
    u = np.spacing(np.abs(low)).astype(np.float64)                             # float16 spacing at |low|
    assert np.all(low64 <= lo) and np.all(lo - u <= low64)
    assert np.all(scale64 <= (hi - lo) / top * (1 + 2.0 ** -10) * (1 + 2.0 ** -23)
                  + (lo - low64) / top * (1 + 2.0 ** -10) * (1 + 2.0 ** -23) + 2.0 ** -24)
    assert np.all(scale64 >= (hi - low64) / top * (1 - 2.0 ** -23))            # the grid reaches x.max


def test_constant_groups_and_exact_grids_round_trip_exactly():
    fmt = kv_format("int4", 16, 32)
    x = np.zeros((1, 32), np.float32)
    x[0, :16] = 2.5                                                            # constant, fp16-exact
    x[0, 16:] = np.arange(16) * 0.5 - 1.0                                      # exactly on a 16-level grid
    q, scale, low = quantize_rows(x, fmt)
    np.testing.assert_array_equal(dequantize_rows(q, scale, low, fmt), x)


def test_int4_packing_is_low_nibble_first():
    fmt = kv_format("int4", 16, 16)
    values = np.array([[3, 12, 0, 15, 7, 1, 9, 14, 2, 5, 11, 4, 8, 6, 10, 13]], np.float32)   # min 0, max 15
    q, scale, low = quantize_rows(values, fmt)
    assert float(scale[0, 0]) == 1.0 and float(low[0, 0]) == 0.0
    v = values[0].astype(np.uint8)
    np.testing.assert_array_equal(q[0], v[0::2] | (v[1::2] << 4))            # byte j: 2j low, 2j+1 high
    assert q[0, 0] == 3 | (12 << 4)


def test_int8_keeps_one_value_per_byte():
    fmt = kv_format("int8", 4, 4)
    q, scale, low = quantize_rows(np.array([[0.0, 255.0, 17.0, 100.0]], np.float32), fmt)
    assert q.tolist() == [[0, 255, 17, 100]] and float(scale[0, 0]) == 1.0


def test_kv_format_checks():
    assert kv_format("none", 64, 64) is None
    assert kv_format("int4", 64, 32).group == 32                               # clamped to head_dim
    assert kv_format("int8", 16, 64).group == 16
    with pytest.raises(QuantError, match="group 24 does not divide head_dim 64"):
        kv_format("int4", 24, 64)
    with pytest.raises(QuantError, match="unknown KV cache mode 'int2'.*none, int8, int4"):
        kv_format("int2", 64, 64)
    with pytest.raises(QuantError, match="must be even"):
        kv_format("int4", 3, 9)
    assert kv_format("int8", 3, 9).group == 3


def test_float16_overflow_is_an_error():
    with pytest.raises(QuantError, match="float16 range"):
        quantize_rows(np.array([[-7e4, 7e4]], np.float32), kv_format("int8", 2, 2))


# ---------------------------------------------------------------------------------- attention over the cache

H, HKV, HD, NSLOTS, LMAX = 4, 2, 32, 5, 24


def _reference(q, keys, values, scale):
    """float64 attention of each query row over given K/V rows: q [n, H, hd]; keys/values [Hkv, L, hd]; query i
    sees keys 0..L-n+i (causal) -> [n, H*hd]."""
    n, L = q.shape[0], keys.shape[1]
    out = np.zeros((n, H, HD))
    for i in range(n):
        for h in range(H):
            kv = h // (H // HKV)
            s = keys[kv, :L - n + i + 1] @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ values[kv, :L - n + i + 1]
    return out.reshape(n, H * HD)


class Tracker:
    """What a quantized cache holds, in float64: stored rows are dequantize(quantize(row)); a step's own new rows
    are seen unquantized by the step that writes them."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.k = np.zeros((NSLOTS, HKV, LMAX, HD))
        self.v = np.zeros((NSLOTS, HKV, LMAX, HD))

    def rows(self, slot, start, new_k, new_v):               # new [n, Hkv, hd] -> K, V [Hkv, start + n, hd]
        keys = np.concatenate([self.k[slot, :, :start], new_k.transpose(1, 0, 2)], axis=1)
        values = np.concatenate([self.v[slot, :, :start], new_v.transpose(1, 0, 2)], axis=1)
        return keys, values

    def store(self, slot, start, new_k, new_v):
        n = new_k.shape[0]
        for cache, new in ((self.k, new_k), (self.v, new_v)):
            t = new.transpose(1, 0, 2)
            cache[slot, :, start:start + n] = dequantize_rows(*quantize_rows(t, self.fmt), self.fmt)


def _qkv(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, H, HD)).astype(np.float32), rng.normal(size=(n, HKV, HD)).astype(np.float32),
            rng.normal(size=(n, HKV, HD)).astype(np.float32))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_attention_over_quantized_cache_matches_dequantize_then_attend_in_float64(mode):
    """Two prefill chunks (the second reads the quantized first), then batched decode steps, sequences of
    different lengths in non-contiguous slots."""
    fmt = kv_format(mode, 16, HD)
    ck, cv = QuantizedKV.zeros(OPS, fmt, (NSLOTS, HKV, LMAX, HD)), QuantizedKV.zeros(OPS, fmt, (NSLOTS, HKV, LMAX, HD))
    ref = Tracker(fmt)
    slots, lengths = [4, 1, 2], [0, 0, 0]
    for chunk, counts in enumerate(([5, 3, 1], [2, 4, 1], [1, 1, 1], [1, 1, 1])):
        q, k, v = _qkv(sum(counts), seed=chunk)
        step = StepLayout.build(slots, lengths, counts)
        out = OPS.attention(q, k, v, ck, cv, step, 0.3)
        for s, slot in enumerate(slots):
            a, b = step.token_range(s)
            keys, values = ref.rows(slot, lengths[s], k[a:b], v[a:b])
            np.testing.assert_allclose(out[a:b], _reference(q[a:b], keys, values, 0.3), atol=2e-5, rtol=1e-4)
            ref.store(slot, lengths[s], k[a:b], v[a:b])
        lengths = [n + c for n, c in zip(lengths, counts)]
    for cache, mirror in ((ck, ref.k), (cv, ref.v)):              # the cache holds exactly the quantized rows
        np.testing.assert_allclose(cache.read(slice(None)), mirror, atol=1e-6)


def test_quantized_cache_moves_attention_by_less_than_its_steps():
    """int8 rows are close to the float ones: the output of a decode step differs from float attention by a small
    fraction of its spread; int4 by more, but still bounded."""
    errs = {}
    for mode in ("int8", "int4"):
        fmt = kv_format(mode, 32, HD)
        ck, cv = QuantizedKV.zeros(OPS, fmt, (1, HKV, LMAX, HD)), QuantizedKV.zeros(OPS, fmt, (1, HKV, LMAX, HD))
        fk, fv = np.zeros((1, HKV, LMAX, HD), np.float32), np.zeros((1, HKV, LMAX, HD), np.float32)
        q, k, v = _qkv(20, seed=5)
        for c in (ck, fk):
            OPS.attention(q[:19], k[:19], v[:19], c, cv if c is ck else fv, StepLayout.build([0], [0], [19]), 0.3)
        step = StepLayout.build([0], [19], [1])
        a = OPS.attention(q[19:], k[19:], v[19:], ck, cv, step, 0.3)
        b = OPS.attention(q[19:], k[19:], v[19:], fk, fv, step, 0.3)
        errs[mode] = float(np.abs(a - b).max() / b.std())
    assert errs["int8"] < 0.02 and errs["int4"] < 0.3 and errs["int8"] < errs["int4"]


# --------------------------------------------------------------------------------------- the cache object

def test_cache_bytes_are_the_quantized_bytes():
    fmt = kv_format("int4", 64, 64)
    float_cache = KVCache(OPS, 3, 4, 2, 10, 64)
    cache = KVCache(OPS, 3, 4, 2, 10, 64, kv_format=fmt)
    per_row = 64 // 2 + 2 * 2                                                 # packed values + fp16 scale, min
    assert cache.nbytes == 3 * 2 * 4 * 2 * 10 * per_row
    assert float_cache.nbytes == 3 * 2 * 4 * 2 * 10 * 64 * 4
    assert kv_bytes_per_token(2, 64, 3, fmt) * 10 * 4 == cache.nbytes
    assert float_cache.nbytes / cache.nbytes == pytest.approx(256 / 36)
    int8 = KVCache(OPS, 3, 4, 2, 10, 64, kv_format=kv_format("int8", 64, 64))
    assert int8.nbytes == 3 * 2 * 4 * 2 * 10 * (64 + 4)


def test_offload_to_host_keeps_quantized_rows():
    """A pooled layer with room for one sequence: placing the second evicts the first to the host store
    (quantized, as is); placing the first again brings back the same bytes."""
    fmt = kv_format("int4", 16, 16)
    per_seq_layer = kv_bytes_per_token(2, 16, 1, fmt) * 8
    cache = KVCache(OPS, 2, 2, 2, 8, 16, KVOffload(2 * per_seq_layer + per_seq_layer, 1), kv_format=fmt)
    assert cache.pooled == {1} and cache.capacity == 1
    rows = np.random.default_rng(0).normal(size=(2, 8, 16)).astype(np.float32)
    cache.prepare([0])
    cache.k[1][cache.slot_of[0]] = rows
    before = cache.k[1].read(int(cache.slot_of[0]))
    cache.prepare([1])
    assert 0 in cache.on_host and cache.bytes_to_host == per_seq_layer     # K + V, one layer
    cache.prepare([0])
    np.testing.assert_array_equal(cache.k[1].read(int(cache.slot_of[0])), before)
    assert cache.bytes_to_device == per_seq_layer


# ------------------------------------------------------------------------------------------------- config

def _config(tmp_path, model="", generate="", offload=""):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\npreset = "tiny-dense"\n{model}\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n'
                    f'{generate}\n' + (f"[offload]\n{offload}\n" if offload else ""))
    return str(path)


def test_config_keys_and_errors(tmp_path):
    from hpcinfer.checkpoint.presets import open_preset
    from hpcinfer.offload.budget import kv_format_of

    config = load_config(_config(tmp_path, 'kv_cache = "int4"\nkv_cache_group = 16', "attention_topk = 0.1"))
    assert (config.model.kv_cache, config.model.kv_cache_group, config.generate.attention_topk) == ("int4", 16, 0.1)
    arch = open_preset("tiny-dense").arch
    assert kv_format_of(config, arch).group == min(16, arch.head_dim)
    with pytest.raises(ConfigError, match=r"model.kv_cache = 'int3' is not allowed; choose one of none, int8, int4"):
        load_config(_config(tmp_path, 'kv_cache = "int3"'))
    with pytest.raises(ConfigError, match=r"generate.attention_topk = 1.5 must be 0 \(off\) or a fraction"):
        load_config(_config(tmp_path, generate="attention_topk = 1.5"))
    bad = load_config(_config(tmp_path, f'kv_cache = "int8"\nkv_cache_group = {arch.head_dim - 1}'))
    with pytest.raises(ConfigError, match=f"model.kv_cache_group = {arch.head_dim - 1}: KV cache group"):
        kv_format_of(bad, arch)
    zigzag = load_config(_config(tmp_path, 'kv_cache = "int4"', offload='schedule = "zigzag"'))   # moved quantized
    assert (zigzag.model.kv_cache, zigzag.offload.schedule) == ("int4", "zigzag")


# ------------------------------------------------------------------------------------- a whole tiny model

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp("kv-quant")
    convert_hf(save_tiny_model("llama", root / "hf"), str(root / "m.h5"))
    return str(root / "m.h5")


def test_tiny_model_generates_with_quantized_cache(llama):
    """Prefill sees only its own (unquantized) rows, so prompt logits equal the float cache's; int8 decode keeps
    the greedy tokens of the float cache; int4 decodes too."""
    from hpcinfer.api import generate, load_model, prompt_logits

    model = load_model(llama)
    prompts = [np.random.default_rng(n).integers(0, 256, n).tolist() for n in (3, 11, 1, 20)]
    logits, tokens = prompt_logits(model, prompts), generate(model, prompts, 8)
    model.set_attention(kv_format("int8", 64, model.arch.head_dim))
    np.testing.assert_array_equal(prompt_logits(model, prompts), logits)
    assert generate(model, prompts, 8) == tokens
    model.set_attention(kv_format("int4", 8, model.arch.head_dim), topk=0.5)
    out = generate(model, prompts, 8)
    assert [len(t) for t in out] == [8] * 4


def test_cuda_backend_accepts_kv_cache_topk_and_quantized_weights(tmp_path):
    """All run on the CuPy backend (backend/cupy_kv.py, cupy_quant.py); the config check refuses none."""
    from types import SimpleNamespace

    from hpcinfer.checkpoint.presets import open_preset
    from hpcinfer.preflight import check_quantization

    cupy = SimpleNamespace(name="cupy")
    for model, generate in (('kv_cache = "int8"', ""), ("", "attention_topk = 0.25"), ('quantize = "int4"', "")):
        config = load_config(_config(tmp_path, model, generate))
        check_quantization(config, open_preset("tiny-dense"), cupy)
        check_quantization(config, open_preset("tiny-dense"), OPS)


def test_kv_rows_reads_float_and_quantized_stores_alike():
    """quant.kv.kv_rows: a float array as a FloatKV view (reads are views where the index is basic, maps give plain
    arrays, kernel arrays carry no scales), a QuantizedKV as itself; rows of one format store into another only
    through float (encoded)."""
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((2, 3, 8, 64), dtype=np.float32)
    rows = kv_rows(dense)
    assert isinstance(rows, FloatKV) and (rows.quantized, rows.exact, rows.group, rows.bits) == (False, True, 1, 32)
    assert np.shares_memory(rows.read((1, slice(None), slice(0, 4))), dense)
    out = np.empty((3, 4, 64), np.float32)
    assert rows.read((1, slice(None), slice(0, 4)), out=out) is out and np.array_equal(out, dense[1, :, :4])
    assert isinstance(rows.map(np.copy), np.ndarray) and rows.parts()[0] is dense
    values, scales, mins = rows.kernel_arrays()
    assert values is dense and scales.size == mins.size == 0
    int4 = kv_format("int4", 32, 64)
    cache = QuantizedKV.zeros(NumpyOps(), int4, dense.shape)
    cache[:] = dense                                                     # float rows, quantized as stored
    assert kv_rows(cache) is cache and (cache.quantized, cache.exact, cache.group, cache.bits) == (True, False, 32, 4)
    assert isinstance(kv_rows(cache).map(np.copy), QuantizedKV)
    np.testing.assert_allclose(cache.read(np.s_[:]), dense, atol=float(np.abs(dense).max()) / 7)
    assert kv_rows(cache).kernel_arrays()[1].dtype == np.uint16
    other = QuantizedKV.zeros(NumpyOps(), kv_format("int8", 32, 64), dense.shape)
    with pytest.raises(QuantError, match="cannot be stored as"):
        other[:] = cache
