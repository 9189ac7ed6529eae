"""cuda_src/paged_attention.cu on the CPU emulator, against backend/paged_attention.py (the NumPy spec).

paged_decode_attention (one pass) and paged_decode_attention_split + decode_attention_combine (flash-decoding:
chunk counts 2, 3, 5 and 16, with empty chunks): sequences of mixed lengths (1: only the new row; a partial last
block; several blocks), their blocks scattered through a pool whose every unwritten row is NaN (the rest of a last
block, the blocks of no sequence), block sizes 1, 4 and 16, GQA groups 1, 2 and 8, head dims 16, 64 and 128; q, k
and v are views into a fused qkv row and out a wider buffer (the row strides). The table entries past a
sequence's blocks point at a NaN block in the kernel's copy (a read of one shows) and are -1 in the reference's,
as BlockTables pads them. The kernels append each new row: the pools equal the spec's after, bit for bit.
paged_kv_append: exactly the given rows change. Also: the file compiles with NVRTC in every storage type with its
kernels in the binary (the registry of the shared compile test does not list it yet).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.paged_attention import paged_append, paged_decode_attention
from hpcinfer.kernels import loader
import kernel_emulator as emulate

F32 = np.float32
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
NWARPS, SCALE = 4, 0.3
DECODE = {"T_STORAGE": "float", "T_ACT": "float", "NWARPS": NWARPS, "MAX_HEAD_DIM": 128, "MAX_GROUP": 8}
KERNELS = ("paged_kv_append", "paged_decode_attention", "paged_decode_attention_split")


def _starts(bs: int) -> list[int]:
    """Positions cached before the decode step: none (length 1), a partial last block after the new row, several
    blocks and one more."""
    return [0, bs + max(1, bs // 2) - 1, 3 * bs]


def _scattered_pool(rng, starts, bs, Hkv, hd):
    """(pool_k, pool_v [num_blocks, Hkv, bs, hd] NaN but each sequence's first starts[s] positions, tables [S, B]
    int32 -1 padded holding start + 1 positions, poison: a block no sequence owns): the blocks drawn from a
    shuffled pool with spares."""
    need = [n // bs + 1 for n in starts]
    num_blocks = sum(need) + 3
    order = rng.permutation(num_blocks)
    tables = np.full((len(starts), max(need)), -1, np.int32)
    pools = np.full((2, num_blocks, Hkv, bs, hd), np.nan, F32)
    taken = 0
    for s, (n, nb) in enumerate(zip(starts, need)):
        tables[s, :nb] = order[taken:taken + nb]
        taken += nb
        rows = rng.standard_normal((2, n, Hkv, hd)).astype(F32)
        positions = np.arange(n)
        pools[:, tables[s, positions // bs], :, positions % bs] = rows.transpose(1, 0, 2, 3)
    return pools[0], pools[1], tables, int(order[-1])


def _qkv(rng, S, H, Hkv, hd):
    """qkv [S, (H + 2 Hkv) hd] float32 and q [S, H, hd], k, v [S, Hkv, hd] views into it (as the model passes)."""
    qkv = rng.standard_normal((S, (H + 2 * Hkv) * hd)).astype(F32)
    q = qkv[:, :H * hd].reshape(S, H, hd)
    k = qkv[:, H * hd:(H + Hkv) * hd].reshape(S, Hkv, hd)
    v = qkv[:, (H + Hkv) * hd:].reshape(S, Hkv, hd)
    return qkv, q, k, v


def _decode(bs, H, Hkv, hd, chunks, pool_k, pool_v, tables, lengths, qkv):
    """The kernels' output [S, H hd] (a wider buffer: its tail must stay NaN): one pass when chunks == 1, else the
    split kernel into a NaN workspace then decode_attention.cu's combine."""
    S, ld, ldo = len(lengths), qkv.shape[1], H * hd + 5
    out = np.full((S, ldo), np.nan, F32)
    rows = (qkv, qkv[:, H * hd:], qkv[:, (H + Hkv) * hd:], pool_k, pool_v, tables, np.array(lengths, np.int32))
    shape = (H, Hkv, hd, bs, tables.shape[1], ld, ld, ld)
    module = emulate.build("paged_attention", DECODE)
    if chunks == 1:
        module.launch("paged_decode_attention", (Hkv, S), (32, NWARPS), *rows, out, *shape, ldo, SCALE)
        return out
    part = np.full((S, H, chunks, 2 + hd), np.nan, F32)
    module.launch("paged_decode_attention_split", (Hkv, S, chunks), (32, NWARPS), *rows, part, *shape, SCALE)
    assert not np.isnan(part).any(), "the split kernel left workspace entries unwritten"
    emulate.build("decode_attention", DECODE).launch(
        "decode_attention_combine", (-(-H * hd // (32 * NWARPS)), S), (32, NWARPS), part, out, H, hd, chunks, ldo)
    return out


DECODE_CASES = [
    # block size, H, Hkv, hd, chunks
    (1, 4, 4, 16, 1),         # MHA, a block per position
    (4, 4, 2, 64, 1),         # GQA 2
    (16, 8, 1, 128, 1),       # MQA (group 8), the widest head
    (4, 8, 1, 16, 3),         # group 8, a narrow head (most lanes idle); flash-decoding
    (16, 4, 2, 16, 2),
    (1, 2, 1, 64, 5),         # more chunks than the 1- and 2-position sequences fill: empty chunks
    (4, 4, 4, 16, 16),
]


@pytest.mark.parametrize("bs, H, Hkv, hd, chunks", DECODE_CASES)
@needs_emulator
def test_paged_decode_attention_matches_numpy(bs, H, Hkv, hd, chunks):
    rng = np.random.default_rng(bs * 1000 + H * 10 + hd + chunks)
    starts = _starts(bs)
    pool_k, pool_v, tables, poison = _scattered_pool(rng, starts, bs, Hkv, hd)
    qkv, q, k, v = _qkv(rng, len(starts), H, Hkv, hd)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    paged_append(want_k, want_v, [tables[s, n // bs] * bs + n % bs for s, n in enumerate(starts)], k, v)
    lengths = np.add(starts, 1)
    want = paged_decode_attention(q, want_k, want_v, tables, lengths, SCALE)

    padded = np.where(tables < 0, poison, tables).astype(np.int32)            # a read past the blocks: NaN
    out = _decode(bs, H, Hkv, hd, chunks, pool_k, pool_v, padded, lengths, qkv)
    assert np.isfinite(out[:, :H * hd]).all(), "a NaN row, table entry or unwritten output reached the result"
    assert np.isnan(out[:, H * hd:]).all(), "wrote past a row's H * hd outputs"
    np.testing.assert_allclose(out[:, :H * hd], want, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(pool_k.view(np.uint32), want_k.view(np.uint32))   # the new rows, NaN elsewhere
    np.testing.assert_array_equal(pool_v.view(np.uint32), want_v.view(np.uint32))


@needs_emulator
def test_paged_decode_attention_writes_nothing_past_its_bounds():
    # group 16 > MAX_GROUP: the wrapper never launches this; the kernel must leave the output and the pools alone
    rng = np.random.default_rng(1)
    pool_k, pool_v, tables, _ = _scattered_pool(rng, [2], 4, 1, 16)
    before = pool_k.copy()
    qkv, _, _, _ = _qkv(rng, 1, 16, 1, 16)
    out = _decode(4, 16, 1, 16, 1, pool_k, pool_v, tables, [3], qkv)
    assert np.isnan(out).all()
    np.testing.assert_array_equal(pool_k.view(np.uint32), before.view(np.uint32))


@pytest.mark.parametrize("bs, Hkv, hd", [(1, 2, 16), (4, 1, 64), (16, 2, 128)])
@needs_emulator
def test_paged_kv_append_writes_exactly_the_given_rows(bs, Hkv, hd):
    rng = np.random.default_rng(bs + hd)
    num_blocks, T, H = 5, 6, 2
    qkv, _, k, v = _qkv(rng, T, H, Hkv, hd)
    slots = rng.choice(num_blocks * bs, size=min(T, num_blocks * bs), replace=False).astype(np.int64)
    k, v, T = k[:len(slots)], v[:len(slots)], len(slots)
    pool_k = np.full((num_blocks, Hkv, bs, hd), np.nan, F32)
    pool_v = np.full_like(pool_k, np.nan)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    paged_append(want_k, want_v, slots, k, v)

    emulate.build("paged_attention", {"T_STORAGE": "float", "T_ACT": "float", "BLOCK": 128}).launch(
        "paged_kv_append", (T,), (128,), qkv[:, H * hd:], qkv[:, (H + Hkv) * hd:], pool_k, pool_v, slots, Hkv,
        hd, bs, qkv.shape[1], qkv.shape[1])
    np.testing.assert_array_equal(pool_k.view(np.uint32), want_k.view(np.uint32))   # NaN elsewhere, bit for bit
    np.testing.assert_array_equal(pool_v.view(np.uint32), want_v.view(np.uint32))


# ---- NVRTC -----------------------------------------------------------------------------------------------------
def _nvrtc_skip() -> str | None:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:   # noqa: BLE001 - cupy or libnvrtc absent
        return f"NVRTC unavailable ({type(exc).__name__}: {exc})"
    return None


NVRTC_SKIP = _nvrtc_skip()
COMPILE_CASES = [{"T_STORAGE": t} for t in ("float", "__half", "__nv_bfloat16")] + [
    {"T_STORAGE": "float", "T_ACT": "float", "NWARPS": 4, "MAX_HEAD_DIM": 128, "MAX_GROUP": 8, "BLOCK": 128},
    {"T_STORAGE": "__half", "MAX_HEAD_DIM": 256, "NWARPS": 2},                 # the shared-memory assert's edge
]


@pytest.mark.skipif(NVRTC_SKIP is not None, reason=NVRTC_SKIP or "")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("defines", COMPILE_CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_paged_attention_compiles_with_nvrtc(defines, arch):
    binary, _ = loader.nvrtc_compile("paged_attention", defines, arch)
    for function in KERNELS:
        assert function.encode() in binary
