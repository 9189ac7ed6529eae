"""`hpcinfer plan --gpus N` and the options it shares with the offload planner: --quantize and --kv-cache are
modelled (bytes held and bytes read), the offload-only options are refused by name instead of ignored."""

from __future__ import annotations

import math

import pytest

from hpcinfer.arch import tensor_shapes
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.cli import _parser, main
from hpcinfer.offload.profile import PRESETS as HARDWARE
from hpcinfer.perf.layout import Layout
from hpcinfer.perf.memory import kv_bytes, rank_memory, weight_bytes
from hpcinfer.perf.report import OFFLOAD_ONLY
from hpcinfer.perf.step import Workload, predict
from hpcinfer.quant.kv import kv_format
from hpcinfer.quant.storage import is_quantizable, quantized_nbytes


def _int8(name: str):
    return ("int8", 64) if is_quantizable(name) else None


def test_quantized_weights_count_their_packed_bytes():
    """tp = 2, int8 (one float32 scale per row of each shard): the quantizable matrices' bytes are replaced by
    rows * cols + 4 * rows of each shard; norms and the rest stay at the dtype."""
    arch, tp = PRESETS["tiny-dense"], 2
    lay = Layout(tp=tp, pp=1, dp=1, ranks_per_node=2)
    plain, quant = Workload(1, 8, 2, "float16"), Workload(1, 8, 2, "float16", _int8)
    layers = range(arch.num_layers)
    delta = 0.0
    for name, shape in tensor_shapes(arch).items():
        if not is_quantizable(name) or (name == "lm_head.weight" and arch.tied_embeddings):
            continue
        if name in ("embed.tokens", "lm_head.weight"):
            rows, cols = -(-arch.vocab_size // tp), shape[1]
        elif name.endswith((".attn.o.weight", ".mlp.down.weight")):          # row-parallel: stored [in, out]
            rows, cols = shape[1], shape[0] // tp
        else:
            rows, cols = shape[0] // tp, shape[1]
        assert quantized_nbytes("int8", rows, cols, 64) == rows * cols + 4 * rows
        delta += rows * cols + 4 * rows - 2 * math.prod(shape) / tp
    got = weight_bytes(arch, lay, layers, True, True, quant) - weight_bytes(arch, lay, layers, True, True, plain)
    assert got == pytest.approx(delta)
    assert rank_memory(arch, lay, quant) < rank_memory(arch, lay, plain)


def test_quantized_kv_cache_counts_its_packed_rows():
    """int4 rows of head_dim values: hd / 2 bytes + a float16 scale and minimum per group of 64."""
    arch = PRESETS["tiny-dense"]
    hd, kv_heads, tp = arch.head_dim, arch.num_kv_heads, 1
    fmt = kv_format("int4", 64, hd)
    work = Workload(4, 16, 8, "float16", None, fmt)
    row = hd // 2 + 2 * 2 * max(hd // min(64, hd), 1)
    want = 2 * kv_heads // tp * row * arch.num_layers * 4 * (16 + 8)
    assert kv_bytes(arch, Layout(tp, 1, 1), arch.num_layers, work) == want
    assert want < kv_bytes(arch, Layout(tp, 1, 1), arch.num_layers, Workload(4, 16, 8, "float16"))


def test_quantized_weights_make_decode_read_fewer_bytes():
    """A bandwidth-bound token step reads the quantized bytes (about a quarter of float16's at int4)."""
    arch, hw, lay = PRESETS["gpt-13b"], HARDWARE["dgx-a100-40gb"], Layout(1, 1, 1)
    plain = predict(arch, lay, Workload(1, 128, 8, "float16"), hw).token_s
    int4 = predict(arch, lay, Workload(1, 128, 8, "float16", lambda n: ("int4", 64) if is_quantizable(n) else None),
                   hw).token_s
    assert 0.2 < int4 / plain < 0.4


def test_cli_quantize_and_kv_cache_change_what_fits(capsys):
    """gpt-13b with 64 sequences of 512 + 32 on 2 GPUs of 16 GB: the leanest float16 layout needs 29.3 GB a GPU,
    int4 weights 20.3 GB (the KV cache is most of it), int4 weights and an int4 KV cache fit. (1 GB of host memory
    and disk a node: no room to offload, tests/perf/test_planner_offload.py plans that.)"""
    args = ["plan", "--model", "gpt-13b", "--gpus", "2", "--batch", "64", "--gpu-memory", "16GB",
            "--host-memory", "1GB", "--disk-memory", "1GB"]
    leanest = []
    for extra in ([], ["--quantize", "int4"]):
        assert main(args + extra) != 0
        err = capsys.readouterr().err
        leanest.append(float(err.split("leanest needs ")[1].split(" GB")[0]))
    assert leanest[1] < leanest[0]
    assert main(args + ["--quantize", "int4", "--kv-cache", "int4"]) == 0
    out = capsys.readouterr().out
    # 6 layouts fit; one more did before int4 kept the embedding and LM head at 8 bits by default (issue 22)
    assert "weights int4" in out and "KV cache int4" in out and "6 valid, 1 over the memory" in out


def test_offload_only_defaults_are_the_parsers():
    args = _parser().parse_args(["plan", "--model", "tiny-dense"])
    assert {name: getattr(args, name) for name in OFFLOAD_ONLY} == OFFLOAD_ONLY


@pytest.mark.parametrize("option", [["--schedule", "row"], ["--prefetch-layers", "0"], ["--cpu-attention", "on"],
                                    ["--fix", "cache_gpu=100"], ["--max-latency", "2"], ["--candidates", "3"],
                                    ["--backend", "numpy"]])
def test_offload_only_options_are_refused_by_name(capsys, option):
    assert main(["plan", "--model", "tiny-dense", "--gpus", "2", *option]) != 0
    err = capsys.readouterr().err
    assert f"{option[0]} is an offload planner option" in err and "without --gpus" in err
