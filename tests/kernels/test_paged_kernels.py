"""cuda_src/paged_attention.cu on the CPU emulator, against backend/paged_attention.py (the NumPy spec).

paged_decode_attention, one launch over grid (Hkv, S, C): one pass (C = 1), or split over the context with the last
block of each (sequence, KV head) combining the chunks (C = 2, 3, 5 and 16, with empty chunks; the workspace
filled, the counters back to 0); rotary fused into the q load and the append (against NumpyOps.rotary first):
sequences of mixed lengths (1: only the new row; a partial last
block; several blocks), their blocks scattered through a pool whose every unwritten row is NaN (the rest of a last
block, the blocks of no sequence), block sizes 1, 4 and 16, GQA groups 1, 2 and 8, head dims 16, 64 and 128; q, k
and v are views into a fused qkv row and out a wider buffer (the row strides). The table entries past a
sequence's blocks point at a NaN block in the kernel's copy (a read of one shows) and are -1 in the reference's,
as BlockTables pads them. The kernels append each new row: the pools equal the spec's after, bit for bit.
A float16 pool against the spec on the same rounded rows. paged_kv_append: exactly the given rows change. Also: the
file compiles with NVRTC in every storage type with its kernels in the binary.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.backend.paged_attention import paged_append
from hpcinfer.kernels import loader
import kernel_emulator as emulate
from paged_reference import paged_decode_attention

F32 = np.float32
EMU_SKIP = emulate.unavailable()
needs_emulator = pytest.mark.skipif(EMU_SKIP is not None, reason=f"kernel emulator: {EMU_SKIP}")
NWARPS, SCALE = 4, 0.3
TYPES = {"T_STORAGE": "float", "T_ACT": "float"}
KERNELS = ("paged_kv_append", "paged_decode_attention")


def _starts(bs: int) -> list[int]:
    """Positions cached before the decode step: none (length 1), a partial last block after the new row, several
    blocks and one more."""
    return [0, bs + max(1, bs // 2) - 1, 3 * bs]


def _scattered_pool(rng, starts, bs, Hkv, hd, dtype=F32):
    """(pool_k, pool_v [num_blocks, Hkv, bs, hd] NaN but each sequence's first starts[s] positions, tables [S, B]
    int32 -1 padded holding start + 1 positions, poison: a block no sequence owns): the blocks drawn from a
    shuffled pool with spares."""
    need = [n // bs + 1 for n in starts]
    num_blocks = sum(need) + 3
    order = rng.permutation(num_blocks)
    tables = np.full((len(starts), max(need)), -1, np.int32)
    pools = np.full((2, num_blocks, Hkv, bs, hd), np.nan, dtype)
    taken = 0
    for s, (n, nb) in enumerate(zip(starts, need)):
        tables[s, :nb] = order[taken:taken + nb]
        taken += nb
        rows = rng.standard_normal((2, n, Hkv, hd)).astype(dtype)
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


def _decode(bs, H, Hkv, hd, chunks, pool_k, pool_v, tables, lengths, qkv, rope=None, storage="float", group=None):
    """The kernel's output [S, H hd] (a wider buffer: its tail must stay NaN) over grid (Hkv, S, chunks): with
    chunks > 1 a NaN workspace that must come back filled and counters that must come back 0."""
    S, ld, ldo = len(lengths), qkv.shape[1], H * hd + 5
    out = np.full((S, ldo), np.nan, F32)
    part = np.full((S, H, chunks, 2 + hd), np.nan, F32) if chunks > 1 else None
    counters = np.zeros(S * Hkv, np.int32) if chunks > 1 else None
    cos, sin, rd = rope if rope is not None else (None, None, 0)
    module = emulate.build("paged_attention", {**TYPES, "T_STORAGE": storage, "NWARPS": NWARPS, "HEAD_DIM": hd,
                                               "GROUP": group or H // Hkv})
    module.launch("paged_decode_attention", (Hkv, S, chunks), (32, NWARPS), qkv, qkv[:, H * hd:],
                  qkv[:, (H + Hkv) * hd:], pool_k, pool_v, tables, np.array(lengths, np.int32), cos, sin, rd, out,
                  part, counters, H, Hkv, hd, bs, tables.shape[1], ld, ld, ld, ldo, SCALE)
    if chunks > 1:
        assert not np.isnan(part).any(), "a block left its workspace entries unwritten"
        assert not counters.any(), "the counters must come back zero"
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


@pytest.mark.parametrize("storage, rotary_dim, chunks", [("float", 16, 1), ("__half", 64, 3), ("float", 32, 2)])
@needs_emulator
def test_paged_decode_attention_fuses_rotary_and_takes_half_pools(storage, rotary_dim, chunks):
    """q rotated on load and k before its append (partial rotary_dim passes the rest through), in a float32 or
    float16 pool: the output and the pools equal NumpyOps.rotary then the spec on the same pool (the new rows
    rounded to float16 alike)."""
    bs, H, Hkv, hd = 4, 6, 2, 64
    dt = {"float": F32, "__half": np.float16}[storage]
    rng = np.random.default_rng(rotary_dim + chunks)
    starts = _starts(bs)
    pool_k, pool_v, tables, poison = _scattered_pool(rng, starts, bs, Hkv, hd, dt)
    qkv, q, k, v = _qkv(rng, len(starts), H, Hkv, hd)
    angles = rng.uniform(0, 2 * np.pi, (len(starts), rotary_dim // 2))
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    rot = NumpyOps().rotary(np.concatenate([q, k], axis=1), cos, sin, rotary_dim)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    paged_append(want_k, want_v, [tables[s, n // bs] * bs + n % bs for s, n in enumerate(starts)], rot[:, H:], v)
    want = paged_decode_attention(rot[:, :H], want_k, want_v, tables, np.add(starts, 1), SCALE)

    padded = np.where(tables < 0, poison, tables).astype(np.int32)
    out = _decode(bs, H, Hkv, hd, chunks, pool_k, pool_v, padded, np.add(starts, 1), qkv, (cos, sin, rotary_dim),
                  storage)
    np.testing.assert_allclose(out[:, :H * hd], want, rtol=2e-5, atol=2e-5 if storage == "float" else 2e-4)
    np.testing.assert_array_equal(pool_k.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(pool_v.view(np.uint8), want_v.view(np.uint8))


@needs_emulator
def test_paged_decode_attention_writes_nothing_for_shapes_it_was_not_built_for():
    # a module built for group 2 given group 16: the wrapper never launches this; output and pools stay alone
    rng = np.random.default_rng(1)
    pool_k, pool_v, tables, _ = _scattered_pool(rng, [2], 4, 1, 16)
    before = pool_k.copy()
    qkv, _, _, _ = _qkv(rng, 1, 16, 1, 16)
    out = _decode(4, 16, 1, 16, 1, pool_k, pool_v, tables, [3], qkv, group=2)
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
    {"T_STORAGE": "float", "T_ACT": "float", "NWARPS": 4, "HEAD_DIM": 128, "GROUP": 8, "BLOCK": 128},
    {"T_STORAGE": "__half", "HEAD_DIM": 256, "GROUP": 8, "NWARPS": 4},         # the shared-memory assert's edge
    {"T_STORAGE": "__nv_bfloat16", "T_ACT": "float", "HEAD_DIM": 64, "GROUP": 3},   # SmolLM2's shape
]


@pytest.mark.skipif(NVRTC_SKIP is not None, reason=NVRTC_SKIP or "")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("defines", COMPILE_CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_paged_attention_compiles_with_nvrtc(defines, arch):
    binary, _ = loader.nvrtc_compile("paged_attention", defines, arch)
    for function in KERNELS:
        assert function.encode() in binary
