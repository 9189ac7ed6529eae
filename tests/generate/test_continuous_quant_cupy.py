"""Continuous batching with int4 rows in paged blocks and top-k on CupyOps (the CPU stand-in for cupy, fixture
`emu_cupy`; kernels on the emulator): the tokens equal NumpyOps' through chunked prompts, mixed steps and decode
steps (backend/cupy_paged.py -> paged_attention.through_dense -> cupy_kv.py)."""

from __future__ import annotations

import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.generate.engine import GenerationParams
from hpcinfer.model.transformer import Decoder
from hpcinfer.quant.kv import kv_format
import kernel_emulator as emulate
from test_continuous_quant import ARCH, continuous

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")


def test_continuous_schedule_on_cupy_with_int4_rows_and_top_k_gives_the_numpy_tokens(emu_cupy):
    from hpcinfer.backend.cupy_ops import CupyOps

    fmt = kv_format("int4", 64, ARCH.head_dim)
    prompts = [[1, 2, 3, 4, 5], [200, 7], [42] * 11, [9, 8, 7]]

    def tokens(ops):                            # two running, 6 tokens a step: chunked prompts, mixed steps
        model = Decoder(ops, Groups(), ARCH, kv_format=fmt, attention_topk=0.5).load(PresetSource("tiny-dense", ARCH))
        return continuous(model, prompts, GenerationParams(5, ignore_eos=True), 2, 6, 4)[0]

    assert tokens(CupyOps(device=0)) == tokens(NumpyOps())
