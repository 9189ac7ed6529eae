"""`[moe] dispatch = "one-hot"` (hpcinfer/backend/moe_onehot.py): the GShard / DeepSpeed one-hot einsum gating,
dispatch and combine, the bench's naive baseline, against the indexed path (backend/moe_ops.py) and the einsum
reference of tests/helpers/moe_reference.py.

- The gating's combine weights and dispatch mask [T, E, C] equal moe_reference.einsum_gating's, and the kept
  pairs sit exactly where moe_ops.route puts them (the same capacity dropping), for top-1 and top-2, with ties.
- The MoE branch through the Dispatcher equals the table path on one rank.
- End to end on tiny-moe (random weights, capacity factor 1: the prompts drop tokens) and a top-2 variant of it:
  the one-hot model generates the indexed model's greedy tokens, and its prompt logits agree within float32
  rounding. Under mpiexec -n 2 (--with-mpi) the same on every 2-rank MoE layout (ep = 2, expert_tp = 2, tp = 2)
  with the flat and pcc+hierarchical all-to-all.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcinfer.api import generate, prompt_logits
from hpcinfer.backend import moe_ops
from hpcinfer.backend.moe_onehot import onehot_gating, onehot_moe
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups, MoELayout
from hpcinfer.model.moe import MoE
from hpcinfer.model.transformer import Decoder
from hpcinfer.parallel.moe_dispatch import Dispatcher
from moe_reference import einsum_gating, table_moe

NEW_TOKENS = 6
PROMPT_LENGTHS = (9, 4, 13, 1, 7)


def logits_with_ties(rng, tokens: int, experts: int) -> np.ndarray:
    """[T, E] random logits, a few rows with an exact tie for the largest (the lower expert must win)."""
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[::5, 1] = logits[::5, 3] = logits[::5].max(axis=1) + 1.0
    return logits


# ---- the gating ------------------------------------------------------------------------------------------------
CASES = [(1, "none", None), (1, "none", 3), (2, "topk", None), (2, "topk", 2), (2, "none", 5), (1, "topk", 0)]


@pytest.mark.parametrize("k, normalize, capacity", CASES)
def test_gating_equals_the_einsum_reference(k, normalize, capacity):
    logits = logits_with_ties(np.random.default_rng(1), 23, 6)
    gating = onehot_gating(np, logits, k, normalize, capacity)
    combine, dispatch = einsum_gating(logits, k, normalize, capacity)
    assert gating.combine.shape == combine.shape == (23, 6, 23 if capacity is None else capacity)
    np.testing.assert_array_equal(gating.dispatch.astype(bool), dispatch)
    np.testing.assert_allclose(gating.combine, combine, rtol=1e-6, atol=0)


@pytest.mark.parametrize("k, normalize, capacity", CASES)
def test_kept_pairs_sit_where_route_puts_them(k, normalize, capacity):
    """The same capacity dropping as the indexed path: every kept (token, choice) is at its route() slot in the
    mask with its gate weight, and nothing else is in the mask."""
    logits = logits_with_ties(np.random.default_rng(2), 31, 5)
    gating = onehot_gating(np, logits, k, normalize, capacity)
    experts, weights = moe_ops.top_k_gating(logits, k, normalize)
    routing = moe_ops.route(experts, weights, 5, capacity)
    expect_dispatch = np.zeros_like(gating.dispatch)
    expect_combine = np.zeros_like(gating.combine)
    tokens, choices = np.nonzero(routing.slot >= 0)
    where = (tokens, experts[tokens, choices], routing.slot[tokens, choices])
    expect_dispatch[where] = 1.0
    expect_combine[where] = weights[tokens, choices]
    np.testing.assert_array_equal(gating.dispatch, expect_dispatch)
    np.testing.assert_array_equal(gating.combine, expect_combine)
    np.testing.assert_array_equal(gating.kept_choices, (routing.slot >= 0).sum(axis=1))
    if capacity is not None and capacity < 31:
        assert routing.dropped.any()                                   # the case does drop pairs


def test_gating_errors_name_the_value():
    with pytest.raises(ValueError, match="top-k = 3"):
        onehot_gating(np, np.zeros((4, 2), np.float32), 3, "none", None)
    with pytest.raises(ValueError, match="normalize = 'softmax'"):
        onehot_gating(np, np.zeros((4, 2), np.float32), 1, "softmax", None)


# ---- the MoE branch through the Dispatcher --------------------------------------------------------------------
class TinyExperts:
    """E random tanh experts behind ExpertStack's call signature (rows [M, D], local expert [M], counts)."""
    first_expert = 0

    def __init__(self, rng, experts: int, hidden: int):
        self.w = rng.standard_normal((experts, hidden, hidden)).astype(np.float32) / np.sqrt(hidden)

    def fn(self, e, x):                                                # x [n, D] -> [n, D]
        return np.tanh(x @ self.w[e])

    def __call__(self, rows, local_expert, counts=None):
        out = np.zeros_like(rows, dtype=np.float32)
        for e in range(len(self.w)):
            mine = local_expert == e
            out[mine] = self.fn(e, rows[mine])
        return out


@pytest.mark.parametrize("k, normalize, capacity", [(1, "none", 4), (2, "topk", None), (2, "topk", 3)])
def test_onehot_branch_equals_the_table_path(k, normalize, capacity):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((19, 8)).astype(np.float32)
    gate_w = rng.standard_normal((4, 8)).astype(np.float32)
    experts = TinyExperts(rng, 4, 8)
    ops = NumpyOps()
    got = onehot_moe(ops, Dispatcher(ops, Groups(), 4), experts, x @ gate_w.T, x, k, normalize, capacity)
    want = table_moe(x, gate_w, experts.fn, k, normalize, capacity)
    assert got.shape == (19, 8) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- end to end on a tiny preset -------------------------------------------------------------------------------
def tiny_moe(top2: bool):
    arch = PRESETS["tiny-moe"]
    if top2:                                                           # the same weights, Mixtral's routing
        arch = dataclasses.replace(arch, moe_top_k=2, moe_normalize="topk")
    return PresetSource("tiny-moe", arch)


def prompts(vocab: int) -> list:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def build(source, dispatch: str, groups: Groups | None = None, ops=None) -> Decoder:
    groups = groups or Groups(moe=MoELayout(dispatch=dispatch))
    return Decoder(ops or NumpyOps(), groups, source.arch).load(source)


@pytest.mark.parametrize("top2", [False, True], ids=["top1", "top2"])
def test_onehot_model_generates_the_indexed_tokens(top2):
    source = tiny_moe(top2)
    indexed, one_hot = build(source, "indexed"), build(source, "one-hot")
    assert all(b.mlp.one_hot for b in one_hot.blocks if isinstance(b.mlp, MoE))
    assert not any(b.mlp.one_hot for b in indexed.blocks if isinstance(b.mlp, MoE))
    batch = prompts(source.arch.vocab_size)
    want, got = prompt_logits(indexed, batch), prompt_logits(one_hot, batch)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(10.0, float(np.abs(want).max())))
    assert generate(one_hot, batch, NEW_TOKENS) == generate(indexed, batch, NEW_TOKENS)


def test_tiny_moe_prompt_drops_tokens():
    """The end-to-end case exercises dropping: capacity ceil(T / E * 1) of the packed prompt step is exceeded."""
    arch = PRESETS["tiny-moe"]
    source = tiny_moe(False)
    model = build(source, "indexed")
    moe = next(b.mlp for b in model.blocks if isinstance(b.mlp, MoE))
    tokens = sum(PROMPT_LENGTHS)
    capacity = moe_ops.capacity_for(tokens, moe.num_experts, moe.capacity_factor, arch.moe_min_capacity)
    assert capacity * moe.num_experts < tokens * 2          # room for at most half the tokens' double share
    x = np.random.default_rng(0).standard_normal((tokens, arch.hidden_size)).astype(np.float32)
    gating = onehot_gating(np, x @ moe.router.value.T, 1, "none", capacity)
    experts, weights = moe_ops.top_k_gating(x @ moe.router.value.T, 1, "none")
    routing = moe_ops.route(experts, weights, moe.num_experts, capacity)
    assert gating.kept_choices.sum() == routing.num_rows


# ---- expert parallelism (mpiexec -n 2 ... --with-mpi -m mpi) ---------------------------------------------------
def run_on_layout(source, dispatch: str, tp: int, ep: int, expert_tp: int, kind: str, batch: list):
    """Greedy tokens and prompt logits of the whole batch on a 2-rank pp = 1 layout (dp replicas split the batch
    and step together); every rank returns the whole answer."""
    from mpi_helpers import world

    from hpcinfer.comm.mesh import build_mesh
    from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
    from hpcinfer.generate.schedules.pipeline import generate_batch

    comm = world()
    mesh = build_mesh(comm, tp, 1, tp)                  # tp = 1: two nodes of one rank (two levels)
    moe = MoELayout(ep, expert_tp, kind, mesh.node_size_in(mesh.stage_members()),
                    mesh.node_size_in(mesh.dp_members()), dispatch)
    model = build(source, dispatch, Groups(tp=mesh.tp, pp=mesh.pp, stage=mesh.stage, dp=mesh.dp, moe=moe))
    _, dp_index, _ = mesh.coords
    mine = [int(i) for i in np.array_split(np.arange(len(batch)), mesh.shape.dp)[dp_index]]
    logits = {}
    out = generate_batch(model, [batch[i] for i in mine], mine, GenerationParams(NEW_TOKENS, ignore_eos=True),
                         StepTimes(), ScheduleParams(), None, logits,
                         lockstep=mesh.dp if mesh.shape.dp > 1 else None, batch_size=len(batch))
    rows = [(i, t, logits[i]) for i, (t, _) in zip(mine, out)] if mesh.tp.rank == 0 else []
    gathered = sorted((r for part in comm.allgather(rows) for r in part), key=lambda r: r[0])
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.dispatch.exchange.close()
    for group in (mesh.tp, mesh.dp, mesh.pp, mesh.stage):
        group.comm.Free()
    return [r[1] for r in gathered], np.stack([r[2] for r in gathered])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["flat", "pcc+hierarchical"])
@pytest.mark.parametrize("top2", [False, True], ids=["top1", "top2"])
def test_onehot_with_expert_parallelism_matches_indexed(top2, kind):
    from mpi_helpers import world

    if world().Get_size() != 2:
        pytest.skip("the 2-rank layouts")
    source, batch = tiny_moe(top2), prompts(PRESETS["tiny-moe"].vocab_size)
    for tp, ep, expert_tp in [(1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2)]:
        want_tokens, want = run_on_layout(source, "indexed", tp, ep, expert_tp, kind, batch)
        got_tokens, got = run_on_layout(source, "one-hot", tp, ep, expert_tp, kind, batch)
        layout = dict(tp=tp, ep=ep, expert_tp=expert_tp, kind=kind)
        assert len(got_tokens) == len(batch) and got_tokens == want_tokens, layout
        assert np.abs(got - want).max() < 1e-5 * max(10.0, float(np.abs(want).max())), layout
