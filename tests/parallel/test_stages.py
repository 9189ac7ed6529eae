"""Pipeline stages (parallel/stages.py): contiguous non-empty runs of layers that minimize the largest stage's
parameter count, the embedding on the first stage and the LM head on the last. The optimum is checked by brute
force over every placement of the P-1 cuts among the L-1 gaps between layers."""

from __future__ import annotations

from itertools import combinations

import pytest

from hpcinfer.arch import ModelArch, tensor_shapes
from hpcinfer.errors import ConfigError
from hpcinfer.parallel.stages import StageSpec, layer_params, partition_layers, stage_params

# SmolLM2-135M: V=49152 D=576 L=30 H=9 Hkv=3 hd=64 F=1536, rmsnorm, rotary, silu gated MLP, tied embeddings
SMOLLM2 = ModelArch(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, intermediate_size=1536, max_positions=8192, norm="rmsnorm", position="rotary",
                    rotary_dim=64, activation="silu", gated_mlp=True, tied_embeddings=True)
TINY = ModelArch(family="llama", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                 head_dim=16, intermediate_size=96, max_positions=128, norm="rmsnorm", position="rotary",
                 rotary_dim=16, activation="silu", gated_mlp=True, tied_embeddings=True)
# GPT-2-like with a huge learned position table: the first stage carries far more than the last
GPT2_LONG = ModelArch(family="gpt2", vocab_size=257, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=4,
                      head_dim=16, intermediate_size=128, max_positions=4096, activation="gelu_tanh",
                      tied_embeddings=True)
# a vocabulary worth several layers, untied head: both ends carry a table
BIG_VOCAB = ModelArch(family="llama", vocab_size=6000, hidden_size=32, num_layers=9, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, max_positions=64, norm="rmsnorm", position="rotary",
                      rotary_dim=16, activation="silu", gated_mlp=True)
# a tiny vocabulary: the ends hardly matter
SMALL_VOCAB = ModelArch(family="opt", vocab_size=8, hidden_size=32, num_layers=7, num_heads=2, num_kv_heads=2,
                        head_dim=16, intermediate_size=48, max_positions=16, activation="relu")

ARCHS = {"smollm2": SMOLLM2, "tiny": TINY, "gpt2_long": GPT2_LONG, "big_vocab": BIG_VOCAB,
         "small_vocab": SMALL_VOCAB}


def stage_cost(arch, pp: int, s: int, first: int, last: int) -> int:
    """Parameters of stage s of pp holding layers [first, last), by the module's own count."""
    first_extra, last_extra = stage_params(arch)
    return ((last - first) * layer_params(arch) + (first_extra if s == 0 else 0)
            + (last_extra if s == pp - 1 else 0))


def largest_stage(arch, stages) -> int:
    return max(stage_cost(arch, len(stages), st.index, st.first_layer, st.last_layer) for st in stages)


def brute_force_optimum(arch, pp: int) -> int:
    L, best = arch.num_layers, None
    for cuts in combinations(range(1, L), pp - 1):
        bounds = (0, *cuts, L)
        worst = max(stage_cost(arch, pp, s, bounds[s], bounds[s + 1]) for s in range(pp))
        best = worst if best is None else min(best, worst)
    return best


# every pp up to the layers (up to 5 for SmolLM2's 30 layers: C(29, 4) placements to try)
CASES = [pytest.param(arch, pp, id=f"{name}-pp{pp}") for name, arch in ARCHS.items()
         for pp in range(1, min(arch.num_layers, 5 if arch.num_layers > 10 else arch.num_layers) + 1)]


# -------------------------------------------------------------------------------------------- the counting

def test_layer_params_of_smollm2_by_hand():
    """attention: q 576x576, k and v 576x192 each, o 576x576 = 884,736; gated MLP 3 x 576x1536 = 2,654,208."""
    assert layer_params(SMOLLM2) == 884_736 + 2_654_208 == 3_538_944
    assert stage_params(SMOLLM2) == (49152 * 576, 49152 * 576)       # tied: the last stage holds its own copy
    # 30 layers + one table = the stored parameters minus the norms (SmolLM2-135M)
    norms = (2 * 30 + 1) * 576
    assert 30 * layer_params(SMOLLM2) + 49152 * 576 + norms == SMOLLM2.param_count()


@pytest.mark.parametrize("arch", ARCHS.values(), ids=ARCHS.keys())
def test_counts_agree_with_the_stored_tensors(arch):
    """A layer's count is its matrices (norms and biases are noise); the ends are the token table, the learned
    position table on the first stage, and a V x D head on the last."""
    matrices = sum(shape[0] * shape[1] for name, shape in tensor_shapes(arch).items()
                   if name.startswith("layers.0.") and len(shape) == 2)
    assert layer_params(arch) == matrices
    first, last = stage_params(arch)
    positions = arch.max_positions * arch.hidden_size if arch.position == "learned" else 0
    assert first == arch.vocab_size * arch.hidden_size + positions
    assert last == arch.vocab_size * arch.hidden_size


# ------------------------------------------------------------------------------------------- the partition

@pytest.mark.parametrize("arch, pp", CASES)
def test_stages_are_contiguous_non_empty_and_flagged(arch, pp):
    stages = partition_layers(arch, pp)
    assert len(stages) == pp
    assert [st.index for st in stages] == list(range(pp)) and all(st.count == pp for st in stages)
    assert stages[0].first_layer == 0 and stages[-1].last_layer == arch.num_layers
    for a, b in zip(stages, stages[1:]):
        assert a.last_layer == b.first_layer
    assert all(len(st.layers) >= 1 for st in stages)
    assert [layer for st in stages for layer in st.layers] == list(range(arch.num_layers))
    assert [st.is_first for st in stages] == [s == 0 for s in range(pp)]
    assert [st.is_last for st in stages] == [s == pp - 1 for s in range(pp)]


@pytest.mark.parametrize("arch, pp", CASES)
def test_largest_stage_is_the_optimum(arch, pp):
    assert largest_stage(arch, partition_layers(arch, pp)) == brute_force_optimum(arch, pp)


@pytest.mark.parametrize("arch", ARCHS.values(), ids=ARCHS.keys())
def test_one_stage_holds_everything(arch):
    assert partition_layers(arch, 1) == [StageSpec(0, 1, 0, arch.num_layers)]
    (only,) = partition_layers(arch, 1)
    assert only.is_first and only.is_last and only.layers == range(arch.num_layers)


def test_one_layer_per_stage_when_pp_equals_the_layers():
    stages = partition_layers(TINY, 4)
    assert [(st.first_layer, st.last_layer) for st in stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("arch, pp", [(TINY, 5), (TINY, 40), (SMOLLM2, 31), (SMALL_VOCAB, 8)])
def test_more_stages_than_layers_is_a_config_error(arch, pp):
    with pytest.raises(ConfigError) as info:
        partition_layers(arch, pp, "job.toml")
    message = str(info.value)
    assert message.startswith("job.toml: ")
    assert f"pp = {pp}" in message and f"{arch.num_layers} layers" in message


def test_smollm2_stages_by_hand():
    """Each table (28.3M) is worth exactly 8 layers (3.54M each), so count in layer units. pp=2: stages of
    8 + a and 8 + 30 - a units, best (and only) at a = 15: 23 + 23. pp=3: 46 units, at best ceil(46/3) = 16 per
    stage (e.g. 8 + 14 + 8 layers; ties allowed, so only the ends' bound is checked). pp=4: 46/4 -> 12 units."""
    unit = layer_params(SMOLLM2)
    assert 49152 * 576 == 8 * unit
    assert [len(st.layers) for st in partition_layers(SMOLLM2, 2)] == [15, 15]
    assert largest_stage(SMOLLM2, partition_layers(SMOLLM2, 2)) == 23 * unit
    three = partition_layers(SMOLLM2, 3)
    assert largest_stage(SMOLLM2, three) == 16 * unit
    assert len(three[0].layers) <= 8 and len(three[-1].layers) <= 8
    assert largest_stage(SMOLLM2, partition_layers(SMOLLM2, 4)) == 12 * unit


@pytest.mark.parametrize("pp", [3, 4, 5])
def test_the_ends_carry_the_tables(pp):
    """With tables worth several layers, the first and last stages get fewer layers than the middle ones."""
    stages = partition_layers(SMOLLM2, pp)
    middle = min(len(st.layers) for st in stages[1:-1])
    assert len(stages[0].layers) < middle and len(stages[-1].layers) < middle


def test_a_learned_position_table_weighs_on_the_first_stage():
    """GPT2_LONG: positions 4096x64 + table 257x64 = 278,592 = 8.5 layers of 32,768 on the first stage, the
    head 16,448 = 0.5 layer on the last. pp=2: 8.5 + a against 0.5 + 8 - a units, best at a = 1 (9.5 vs 7.5).
    For every pp the first stage keeps a single layer: two would make it 10.5 units, more than 9.5."""
    unit = layer_params(GPT2_LONG)
    assert unit == 32_768 and stage_params(GPT2_LONG) == (278_592, 16_448)
    assert [len(st.layers) for st in partition_layers(GPT2_LONG, 2)] == [1, 7]
    for pp in (2, 3, 4):
        stages = partition_layers(GPT2_LONG, pp)
        assert len(stages[0].layers) == 1, [len(st.layers) for st in stages]
        assert largest_stage(GPT2_LONG, stages) == stage_cost(GPT2_LONG, pp, 0, 0, 1)
