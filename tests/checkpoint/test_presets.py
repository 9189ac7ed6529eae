"""Presets (hpcinfer/checkpoint/presets.py): the papers' model shapes with random weights made on demand.

Checked here: every preset is a valid architecture of the size its table gives; an element has one value whatever
slice, shard, layout, read order or process asks for it; each rank draws only its shard (fast even for 175B);
the tiny presets run end to end, in one process and under `hpcinfer run` on 1 and 2 ranks (ep = 2); the example
configs validate. Loading runs in one process with stand-in groups, since it needs no collectives.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.api import generate, prompt_logits
from hpcinfer.arch import ModelArch, tensor_shapes
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, SOURCES, PresetSource, open_preset, preset_table
from hpcinfer.comm.group import Groups, MoELayout
from hpcinfer.errors import ConfigError
from hpcinfer.model.transformer import Decoder
from hpcinfer.parallel.experts import ExpertStack
from hpcinfer.parallel.layers import even_shard, vocab_shard
from hpcinfer.parallel.stages import StageSpec

REPO = Path(__file__).resolve().parents[2]

# The tables' nominal sizes (billions of parameters) and shapes (layers, hidden, heads). DeepSpeed Inference
# Table I (dense) and Table II (MoE; = DeepSpeed-MoE Table 6), DeepSpeed-MoE Table 1 (350M bases, PR-MoE).
# Our counts (ModelArch.param_count: every stored tensor, a tied head once):
#   gpt2-1.5b 1.56B, gpt-neo-2.7b 2.65B, gpt-j-6b 6.05B, gpt-13b 12.85B, gpt-neox-20b 20.55B, gpt-50b 50.36B,
#   gpt-87b 87.62B, lm-175b 174.60B, lm-530b 529.58B; ds-moe-350m-128 13.15B, ds-prmoe-350m-32-64 4.12B,
#   ds-moe-1.3b-128 52.47B, ds-prmoe-1.3b-64-128 31.39B, ds-moe-2.4b-128 107.08B, ds-moe-8b-128 349.24B,
#   ds-moe-24b-128 1047.42B, ds-moe-47b-128 2024.62B; PR-MoE-64/128 (no table size): 2.4b 68.43B, 8b 197.28B,
#   24b 608.76B, 47b 1112.39B.
TABLES = {
    "gpt2-1.5b": (1.5, 48, 1600, 25), "gpt-neo-2.7b": (2.7, 32, 2560, 20), "gpt-j-6b": (6, 28, 4096, 32),
    "gpt-13b": (13, 40, 5120, 40), "gpt-neox-20b": (20, 44, 6144, 64), "gpt-50b": (50, 62, 8192, 64),
    "gpt-87b": (87, 48, 12288, 96), "lm-175b": (175, 96, 12288, 96), "lm-530b": (530, 105, 20480, 128),
    "ds-moe-350m-128": (13, 24, 1024, 16), "ds-prmoe-350m-32-64": (4, 24, 1024, 16),
    "ds-moe-1.3b-128": (52, 24, 2048, 16), "ds-prmoe-1.3b-64-128": (31, 24, 2048, 16),
    "ds-moe-2.4b-128": (107.7, 16, 3584, None), "ds-moe-8b-128": (349.0, 40, 4096, None),
    "ds-moe-24b-128": (1064.9, 30, 8192, None), "ds-moe-47b-128": (2024.0, 58, 8192, None),
}
# Table II prints 30 layers for 8B+MoE-128 and 40 for 24B+MoE-128; the sizes fit only the other way round:
# 40 x 4096 with 20 MoE layers makes 349B (30 layers: 262B), 30 x 8192 makes 1047B (40 layers: 1406B).


class LoadOnlyGroup:
    """A group of `size` ranks seen from `rank`, for code that only reads shards (no collectives)."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def test_every_preset_is_valid_and_as_large_as_its_table_says():
    assert set(SOURCES) == set(PRESETS)
    assert set(TABLES) <= set(PRESETS)
    for name, arch in PRESETS.items():
        assert isinstance(arch, ModelArch)
        assert ModelArch.from_attrs(arch.to_attrs()) == arch                  # a checkpoint could store it
        assert arch.head_dim * arch.num_heads == arch.hidden_size
        if name in TABLES:
            nominal, layers, hidden, heads = TABLES[name]
            assert (arch.num_layers, arch.hidden_size) == (layers, hidden), name
            assert heads is None or arch.num_heads == heads, name
            assert abs(arch.param_count() / (nominal * 1e9) - 1) < 0.10, (name, arch.param_count())
        if SOURCES[name][1] is not None:
            assert name in TABLES, name


def test_moe_presets_follow_deepspeed_moe():
    for name, arch in PRESETS.items():
        if not name.startswith("ds-"):
            continue
        moe = [i for i, e in enumerate(arch.moe_experts) if e]
        assert moe == list(range(1, arch.num_layers, 2)), name                # every other layer, from layer 1
        assert (arch.moe_top_k, arch.moe_normalize, arch.moe_capacity_factor) == (1, "none", 1.0)
        counts = [arch.moe_experts[i] for i in moe]
        if name.startswith("ds-prmoe-"):
            small, large = map(int, name.split("-")[-2:])
            assert counts == [small] * (len(moe) - 2) + [large] * 2, name     # the pyramid: the last two larger
            assert arch.moe_residual
            standard = PRESETS[name.replace("ds-prmoe-", "ds-moe-").rsplit("-", 2)[0] + "-128"]
            assert arch.param_count() < standard.param_count()
        else:
            assert counts == [128] * len(moe) and not arch.moe_residual
    assert PRESETS["tiny-prmoe"].moe_experts == (0, 4, 0, 8) and PRESETS["tiny-prmoe"].moe_residual
    assert PRESETS["tiny-moe"].moe_experts == (0, 8, 0, 8)
    assert not PRESETS["tiny-dense"].moe_experts


def test_families():
    neox, gptj, gpt2 = PRESETS["gpt-neox-20b"], PRESETS["gpt-j-6b"], PRESETS["gpt2-1.5b"]
    assert (neox.position, neox.rotary_dim, neox.parallel_residual) == ("rotary", neox.head_dim // 4, True)
    assert (gptj.position, gptj.rotary_dim, gptj.parallel_residual) == ("rotary", 64, True)
    assert (gpt2.position, gpt2.activation, gpt2.tied_embeddings, gpt2.qkv_bias) == ("learned", "gelu_tanh",
                                                                                      True, True)
    for name in ("gpt-13b", "gpt-50b", "gpt-87b", "lm-175b", "lm-530b"):
        arch = PRESETS[name]
        assert (arch.vocab_size, arch.max_positions, arch.position) == (50257, 2048, "learned")


def test_unknown_preset_is_a_config_error_listing_the_presets():
    with pytest.raises(ConfigError) as info:
        open_preset("gpt-4")
    assert "'gpt-4'" in str(info.value) and "ds-moe-1.3b-128" in str(info.value) and "tiny-moe" in str(info.value)


def test_shapes_values_and_the_reading_interface():
    for name in ("tiny-dense", "tiny-moe", "tiny-prmoe"):
        with open_preset(name) as src:
            arch = src.arch
            assert (src.path, src.dtype, src.tokenizer_json(), src.tokenizer_attrs()) == \
                (f"preset:{name}", "float32", None, {})
            for tensor, shape in tensor_shapes(arch).items():
                value = src.read(tensor)
                assert src.shape(tensor) == shape and value.shape == shape and value.dtype == np.float32, tensor
                if tensor.endswith(".bias"):
                    assert not value.any(), tensor
                elif tensor.endswith("norm.weight"):
                    assert (value == 1).all(), tensor
                else:
                    fan_in = arch.q_size if tensor.endswith("attn.o.weight") else (
                        shape[-2] if tensor.endswith("down.weight") else arch.hidden_size)
                    expected = 0.02 if tensor.startswith("embed.") else 1 / math.sqrt(fan_in)
                    n = value.size                                            # 5 standard errors
                    assert np.isfinite(value).all() and abs(value.mean()) < 5 * expected / math.sqrt(n), tensor
                    assert abs(value.std() / expected - 1) < 2.5 / math.sqrt(n), (tensor, value.std(), expected)
    # A big preset: every tensor's shape, and a first-row read of each, without drawing any whole tensor.
    src = open_preset("ds-prmoe-1.3b-64-128")
    for tensor, shape in tensor_shapes(src.arch).items():
        assert src.shape(tensor) == shape
        index = tuple(slice(0, 1) for _ in shape[:-1]) or (slice(0, 1),)
        expected = (1,) * (len(shape) - 1) + (shape[-1],) if len(shape) > 1 else (1,)
        assert src.read_slab(tensor, index).shape == expected, tensor
    assert src.values_drawn < 10**6
    with pytest.raises(KeyError):
        src.shape("layers.0.moe.router.weight")                               # layer 0 is dense


def test_the_same_element_whatever_slice_asks_for_it():
    src = open_preset("tiny-moe")
    name = "embed.tokens"
    a, b = src.read(name, slice(0, 10)), src.read(name, slice(5, 15))
    np.testing.assert_array_equal(a[5:], b[:5])                               # overlapping rows
    full = src.read(name)
    for start, stop in ((0, 10), (5, 15), (3, 4), (250, 256), (0, 256), (7, 7)):
        np.testing.assert_array_equal(src.read(name, slice(start, stop)), full[start:stop])
    # Another source (another rank), reading in another order, with odd offsets into the generator's stream.
    other = open_preset("tiny-moe")
    for start in (255, 101, 0, 1, 2, 3):
        np.testing.assert_array_equal(other.read(name, slice(start, None)), full[start:])
    # Expert stacks [E, F, D] and their [E, F] biases: any (experts, rows) slab is the same block of the whole.
    for tensor in ("layers.1.moe.experts.up.weight", "layers.3.moe.experts.down.weight",
                   "layers.1.moe.experts.up.bias", "layers.3.moe.router.weight"):
        whole = other.read(tensor)
        for index in ((slice(0, 8),), (slice(2, 5),), (slice(3, 4), slice(17, 200)), (slice(0, 8), slice(1, 2)),
                      (slice(7, 8), slice(0, 256))):
            np.testing.assert_array_equal(src.read_slab(tensor, index), whole[index], err_msg=f"{tensor} {index}")
    # A different seed is a different model; the same seed the same one.
    assert not np.array_equal(open_preset("tiny-moe", seed=1).read(name), full)
    np.testing.assert_array_equal(open_preset("tiny-moe", seed=0).read(name), full)
    # A big expert stack: expert 77's rows 100:300 overlapping 250:400.
    big = open_preset("ds-moe-1.3b-128")
    tensor = "layers.23.moe.experts.down.weight"
    x = big.read_slab(tensor, (slice(77, 78), slice(100, 300)))
    y = big.read_slab(tensor, (slice(76, 79), slice(250, 400)))
    np.testing.assert_array_equal(x[0, 150:], y[1, :50])


def _decoder(src, tp=1, tp_rank=0, ep=1, expert_tp=1, stage_rank=0, stage=None):
    groups = Groups(tp=LoadOnlyGroup(tp, tp_rank), stage=LoadOnlyGroup(ep * expert_tp, stage_rank),
                    moe=MoELayout(ep, expert_tp))
    return Decoder(NumpyOps(), groups, src.arch, "float32", stage).load(src)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_are_blocks_of_the_one_model(tp):
    """Column-parallel (q, k, v, up), row-parallel (o, down) and vocab-parallel shards of tp ranks, built by the
    real layers, reassemble into what one rank holds."""
    src = open_preset("tiny-prmoe")
    whole = _decoder(src)
    ranks = [_decoder(open_preset("tiny-prmoe"), tp, r) for r in range(tp)]
    arch = src.arch
    for i in range(arch.num_layers):
        full_qkv = np.split(whole.blocks[i].attn.qkv.w, [arch.q_size, arch.q_size + arch.kv_size])
        for r, model in enumerate(ranks):
            local = model.blocks[i].attn.qkv.w
            q, k, v = np.split(local, [arch.q_size // tp, (arch.q_size + arch.kv_size) // tp])
            for part, full in zip((q, k, v), full_qkv):
                np.testing.assert_array_equal(part, full[even_shard(full.shape[0], tp, r)])
        cols = [model.blocks[i].attn.out.w for model in ranks]                      # [D, in_local] each
        np.testing.assert_array_equal(np.concatenate(cols, axis=1), whole.blocks[i].attn.out.w)
        mlp = whole.blocks[i].mlp if not arch.experts_in(i) else whole.blocks[i].mlp.residual
        local_mlps = [m.blocks[i].mlp if not arch.experts_in(i) else m.blocks[i].mlp.residual for m in ranks]
        np.testing.assert_array_equal(np.concatenate([m.up.w for m in local_mlps]), mlp.up.w)
        np.testing.assert_array_equal(np.concatenate([m.down.w for m in local_mlps], axis=1), mlp.down.w)
    table = np.concatenate([m.embed.table for m in ranks])
    np.testing.assert_array_equal(table[:arch.vocab_size], whole.embed.table)
    assert not table[arch.vocab_size:].any()


@pytest.mark.parametrize("ep, expert_tp", [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_expert_shards_are_blocks_of_the_one_model(ep, expert_tp):
    """Expert parallelism (experts split) and expert-slicing (F split) read slabs of the same expert stacks."""
    src = open_preset("tiny-prmoe")
    arch, ops = src.arch, NumpyOps()
    for layer in (1, 3):
        experts = arch.experts_in(layer)
        prefix = f"layers.{layer}.moe.experts"
        whole = ExpertStack(ops, arch, prefix, experts, MoELayout(), 0, "float32")
        whole.load(src)
        for q in range(ep * expert_tp):
            part = ExpertStack(ops, arch, prefix, experts, MoELayout(ep, expert_tp), q, "float32")
            part.load(open_preset("tiny-prmoe"))
            for local, e in enumerate(range(part.experts.start, part.experts.stop)):
                np.testing.assert_array_equal(part.up[local], whole.up[e][part.width])
                np.testing.assert_array_equal(part.down[local], whole.down[e][:, part.width])


def test_a_rank_draws_only_its_shard_of_a_big_preset():
    """tp = 8 on LM-175B: the embedding shard of the last tp rank is drawn alone, quickly; no whole tensor."""
    src = open_preset("lm-175b")
    start, stop, _ = vocab_shard(50257, 8, 7)
    t0 = time.perf_counter()
    block = src.read("embed.tokens", slice(start, stop))
    elapsed = time.perf_counter() - t0
    assert block.shape == (stop - start, 12288)
    assert src.values_drawn == block.size == (50257 - 7 * 6283) * 12288     # 6276 of 50257 rows
    assert elapsed < 5.0, elapsed                                              # ~0.1-0.4 s (1 ns a value)
    assert abs(float(block[::97, ::89].std()) / 0.02 - 1) < 0.05


def test_a_pipeline_stage_of_expert_rank_127_draws_only_its_share():
    """ds-moe-350m-128 on 128 ranks (ep = 128, dp = 128, tp = 1), pp = 8: a middle stage (layers 19-21, two of
    them MoE) of stage rank 127 draws its attention, its dense MLP, one expert per MoE layer, and no more."""
    src = open_preset("ds-moe-350m-128")
    arch = src.arch
    reads = []
    original = src._make

    def spy(name, index):
        value = original(name, index)
        reads.append((name, value.size))
        return value

    src._make = spy
    model = _decoder(src, ep=128, stage_rank=127, stage=StageSpec(6, 8, 19, 22))
    D, F = arch.hidden_size, arch.intermediate_size
    expected = 3 * 4 * D * D + 2 * F * D + 2 * (2 * F * D + 128 * D)       # attention, MLP, (expert, router) x 2
    assert src.values_drawn == expected                                       # nothing drawn but what is held
    for block in (model.blocks[0], model.blocks[2]):
        assert block.mlp.experts.experts == slice(127, 128)
    shapes = tensor_shapes(arch)
    assert {name.split(".")[1] for name, _ in reads} == {"19", "20", "21"}
    for name, size in reads:
        assert size <= math.prod(shapes[name]) // (128 if ".moe.experts." in name else 1)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-prmoe"])
def test_a_tiny_preset_runs_in_one_process(name):
    model = Decoder(NumpyOps(), Groups(), PRESETS[name]).load(open_preset(name))
    prompts = [[1, 2, 3, 4, 5], [200, 7], [42] * 20]
    logits = prompt_logits(model, prompts)
    assert logits.shape == (3, 256) and np.isfinite(logits).all()
    assert logits.std() > 1e-3                                                # not a constant
    tokens = generate(model, prompts, max_new_tokens=6)
    assert all(len(t) == 6 and all(0 <= x < 256 for x in t) for t in tokens)


def test_the_big_presets_stay_finite_through_many_layers():
    """The 1 / sqrt(fan_in) scaling keeps activations finite and O(1): a narrowed stand-in for the deep presets
    (LM-530B's 105 layers, DeepSpeed-MoE's routing) with the same init rules."""
    import dataclasses

    arch = dataclasses.replace(PRESETS["tiny-moe"], num_layers=106, moe_experts=(0, 8) * 53)
    src = PresetSource("deep-moe", arch)
    model = Decoder(NumpyOps(), Groups(), arch).load(src)
    logits = prompt_logits(model, [[1, 2, 3], [9] * 30])
    assert np.isfinite(logits).all() and 1e-3 < logits.std() < 100


# ---- `hpcinfer run` with a preset --------------------------------------------------------------------------

PROMPTS = [[5, 17, 200, 3], [9], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54], [250, 1, 250, 1, 250],
           [7, 7, 7], [100, 101], [33] * 9, [128, 64, 32, 16, 8, 4]]


def _write_job(root: Path, preset: str) -> Path:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": t}) + "\n" for i, t in enumerate(PROMPTS)))
    config = root / "job.toml"
    # capacity_factor = 8 (the expert count): no token is ever dropped. With the preset's 1.0, capacity is counted
    # per data-parallel replica (as in DeepSpeed), so 2 replicas may drop other tokens than 1 does.
    config.write_text(f'[model]\npreset = "{preset}"\n\n[moe]\ncapacity_factor = 8.0\n\n'
                      f'[generate]\nprompts = "{prompts}"\noutput = "{root / "out.jsonl"}"\nmax_new_tokens = 5\n'
                      f'batch_size = 8\nignore_eos = true\nmetrics = "{root / "metrics.json"}"\n')
    return config


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-prmoe"])
def test_hpcinfer_run_with_a_preset_on_one_and_two_ranks(tmp_path, run_cli, repo_root, preset):
    one, two = tmp_path / "n1", tmp_path / "n2"
    one.mkdir(), two.mkdir()
    done = run_cli(["run", str(_write_job(one, preset)), "--set", "parallel.ep=1"], n=1, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    done = run_cli(["run", str(_write_job(two, preset)), "--set", "parallel.ep=2",
                    "--set", 'moe.all_to_all="pcc+hierarchical"'], n=2, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    expected = (one / "out.jsonl").read_text()
    assert (two / "out.jsonl").read_text() == expected
    records = [json.loads(line) for line in expected.splitlines()]
    assert [r["id"] for r in records] == [f"p{i}" for i in range(len(PROMPTS))]
    assert all(len(r["output_tokens"]) == 5 for r in records)
    metrics = json.loads((two / "metrics.json").read_text())
    assert metrics["model"]["parameters"] == PRESETS[preset].param_count()


def test_the_example_configs(tmp_path, run_cli, repo_root):
    """inputs/preset-tiny-moe.toml runs as written on 2 ranks; inputs/moe-1.3b-128.toml passes every set-up check
    of a 128-rank run on 16 nodes of 8 (jobs/moe-1.3b-128.slurm) with prompts like the ones the job makes."""
    from hpcinfer.comm.mesh import MeshShape
    from hpcinfer.config import load_config
    from hpcinfer.generate.prompts import load_prompts
    from hpcinfer.preflight import open_model_source
    from hpcinfer.parallel.layout import check_experts, check_tensor_parallel
    from hpcinfer.parallel.stages import partition_layers

    done = run_cli(["run", "inputs/preset-tiny-moe.toml", "--set", f'generate.output="{tmp_path / "o.jsonl"}"',
                    "--set", f'generate.metrics="{tmp_path / "m.json"}"'], n=2, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 8

    config = load_config(str(REPO / "inputs/moe-1.3b-128.toml"))
    assert config.model.preset == "ds-moe-1.3b-128" and config.model.checkpoint is None
    par = config.parallel
    with open_model_source(config.model) as src:
        arch = src.arch
    check_tensor_parallel(arch, par.tp, config.path)
    partition_layers(arch, par.pp, config.path)
    MeshShape.for_world(128, par.tp, par.pp).check_nodes(8)
    check_experts(arch, par.tp, par.pp, par.ep, par.expert_tp, 128, config.path)
    assert (par.tp, par.ep, par.expert_tp, config.moe.all_to_all) == (1, 128, 1, "pcc+hierarchical")
    slurm = (REPO / "jobs/moe-1.3b-128.slurm").read_text()
    assert "--nodes=16" in slurm and "--ntasks-per-node=8" in slurm and "inputs/moe-1.3b-128.toml" in slurm
    assert "source jobs/lib.sh" in slurm and "hpcinfer_run inputs/moe-1.3b-128.toml" in slurm
    assert "srun --mpi=pmi2 --kill-on-bad-exit=1" in (REPO / "jobs/lib.sh").read_text()   # the shared launcher
    # The job writes its prompts with this module's helper; they fit the model.
    from hpcinfer.checkpoint.presets import write_token_prompts

    path = tmp_path / "prompts.jsonl"
    write_token_prompts(str(path), count=16, length=128, vocab=arch.vocab_size, seed=0)
    prompts = load_prompts(str(path), arch, None)
    assert len(prompts) == 16 and all(len(p.tokens) == 128 for p in prompts)
    assert config.generate.batch_size % 128 == 0                               # every replica gets sequences


def test_docs_list_every_preset_with_its_size():
    docs = (REPO / "docs/presets.md").read_text()
    for row in preset_table().splitlines()[2:]:
        assert row in docs, row
