"""MoE layouts across ranks, in process (run under mpiexec -n 2 and -n 4): every (tp, pp, ep, expert_tp) that fits
the world, with each all-to-all variant, gives the single-rank greedy tokens and prompt logits (the tolerance of
test_mpi_pipeline.check_layout) for the tiny Mixtral (tests/helpers/hf_models.py) and the DeepSpeed-MoE GPT and PR-MoE
(tests/helpers/moe_models.py).

A layout fits when dp * tp = ep * expert_tp, dp = world / (tp * pp), with ep in {1, 2, 4}, expert_tp in {1, 2},
tp in {1, 2}, pp in {1, 2}. Nodes: ranks_per_node = 2 at 4 ranks, so `hierarchical` has two levels (2 nodes of 2
stage ranks; with tp = 2 the pcc exchange among dp ranks is then inter-node only), and at 2 ranks 1 (tp = 1: two
nodes) or 2 (tp = 2). With dp > 1 the replicas step together (job.generate_share): each takes its np.array_split
slice of the batch, and the slices' answers are gathered and compared whole.

Capacity is computed over each data-parallel replica's tokens of a step, so a layout with dp > 1 drops other
tokens than one rank does: the DS-MoE / PR-MoE checkpoints here are written with capacity factor 16 (>= the
experts of any layer, so ceil(T / E * 16) >= T: nothing is ever dropped) and Mixtral has no capacity limit.
"""

import numpy as np
import pytest

from mpi_helpers import shared_files, world
from hpcinfer.api import load_model
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.comm.group import Groups, MoELayout
from hpcinfer.comm.mesh import build_mesh
from hpcinfer.comm.pipeline import StageLink
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.model.moe import MoE
from hpcinfer.model.transformer import Decoder
from hpcinfer.parallel.layout import check_experts
from hpcinfer.parallel.stages import partition_layers
from moe_models import write_ds_moe, write_pr_moe

NEW_TOKENS = 5
NO_DROPS = 16.0                                  # capacity factor >= every layer's experts: nothing is dropped
KINDS = ("flat", "hierarchical", "pcc", "pcc+hierarchical")
MODELS = ("mixtral", "ds_moe", "pr_moe")
DROPS = 1.0                                      # capacity factor 1, min capacity 1: tokens are dropped
PROMPT_LENGTHS = (4, 9, 1, 13, 6)


@pytest.fixture(scope="module")
def checkpoints():
    def build(root):
        from hf_models import save_tiny_model
        from hpcinfer.checkpoint.hf import convert_hf

        paths = {m: str(root / f"{m}.h5") for m in MODELS + ("ds_moe_drops",)}
        convert_hf(str(save_tiny_model("mixtral", root / "mixtral")), paths["mixtral"])
        write_ds_moe(paths["ds_moe"], capacity_factor=NO_DROPS)
        write_pr_moe(paths["pr_moe"], capacity_factor=NO_DROPS)
        write_ds_moe(paths["ds_moe_drops"], capacity_factor=DROPS, min_capacity=1)
        return paths

    yield from shared_files("hpcinfer-moe-", build)


@pytest.fixture(scope="module")
def references(checkpoints):
    """Per model: (prompts, single-rank greedy tokens, single-rank prompt logits [S, V]), on every rank."""
    out = {}
    for name in MODELS:
        model = load_model(checkpoints[name])
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, model.arch.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
        logits = {}
        results = generate_batch(model, prompts, list(range(len(prompts))),
                                 GenerationParams(NEW_TOKENS, ignore_eos=True), StepTimes(), ScheduleParams(), None,
                                 logits)
        out[name] = (prompts, [t for t, _ in results], np.stack([logits[i] for i in range(len(prompts))]))
    return out


def layouts(size: int):
    """(tp, pp, ep, expert_tp) with dp * tp = ep * expert_tp inside each stage, dp = size / (tp * pp)."""
    return [(tp, pp, ep, etp) for pp in (1, 2) for tp in (1, 2) for ep in (1, 2, 4) for etp in (1, 2)
            if size % (tp * pp) == 0 and size // pp == ep * etp]


def ranks_per_node(size: int, tp: int) -> int:
    """2 at 4 ranks (two nodes: hierarchical has two levels); at 2 ranks two nodes of 1 unless tp = 2."""
    return max(tp, size // 2)


def run_layout(path: str, tp: int, pp: int, ep: int, expert_tp: int, kind: str, prompts) -> list:
    """This rank's part of one layout; returns every prompt's (tokens, logits [V]) in prompt order, on every rank
    (each replica's last stage, tp rank 0, contributes its slice)."""
    comm = world()
    size = comm.Get_size()
    mesh = build_mesh(comm, tp, pp, ranks_per_node(size, tp))
    moe = MoELayout(ep, expert_tp, kind, mesh.node_size_in(mesh.stage_members()),
                    mesh.node_size_in(mesh.dp_members()))
    if size == 4 and pp == 1:                    # two nodes of two stage ranks: two real levels
        assert moe.stage_ranks_per_node == 2
    groups = Groups(tp=mesh.tp, pp=mesh.pp, stage=mesh.stage, dp=mesh.dp, moe=moe)
    with open_checkpoint(path) as ckpt:
        check_experts(ckpt.arch, tp, pp, ep, expert_tp, size, "test")
        stage = partition_layers(ckpt.arch, pp)[mesh.coords[0]]
        model = Decoder(NumpyOps(), groups, ckpt.arch, "float32", stage).load(ckpt)
    _, dp_index, _ = mesh.coords
    dp = mesh.shape.dp
    indices = [int(i) for i in np.array_split(np.arange(len(prompts)), dp)[dp_index]]
    logits = {}
    out = generate_batch(model, [prompts[i] for i in indices], indices,
                         GenerationParams(NEW_TOKENS, ignore_eos=True), StepTimes(), ScheduleParams(pp, pp),
                         StageLink(mesh.pp) if pp > 1 else None, logits,
                         lockstep=mesh.dp if dp > 1 else None, batch_size=len(prompts))
    mine = []
    if out is not None and mesh.tp.rank == 0:
        mine = [(i, tokens, logits[i]) for i, (tokens, _) in zip(indices, out)]
    gathered = sorted((row for part in comm.allgather(mine) for row in part), key=lambda row: row[0])
    _close(model, mesh)
    assert [row[0] for row in gathered] == list(range(len(prompts))), "every prompt answered exactly once"
    return [(row[1], row[2]) for row in gathered]


def _close(model, mesh) -> None:
    """Free this layout's communicators (the hierarchical exchanges' and the mesh's): a run makes dozens of
    layouts, and MPI has a bounded number of communicators."""
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.dispatch.exchange.close()
    for group in (mesh.tp, mesh.dp, mesh.pp, mesh.stage):
        group.comm.Free()


def check_layout(path, reference, tp, pp, ep, expert_tp, kind, prompts=None):
    prompts_all, tokens, logits = reference
    prompts = prompts_all if prompts is None else prompts
    got = run_layout(path, tp, pp, ep, expert_tp, kind, prompts)
    n = len(prompts)
    layout = dict(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp, kind=kind, prompts=n)
    assert [t for t, _ in got] == tokens[:n], layout
    ours = np.stack([row for _, row in got])
    # as test_mpi_pipeline.check_layout: 1e-4 for logits of order 10, in proportion above
    tolerance = 1e-5 * max(10.0, float(np.abs(logits[:n]).max()))
    assert np.abs(ours - logits[:n]).max() < tolerance, (layout, np.abs(ours - logits[:n]).max())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_every_moe_layout_matches_one_rank(checkpoints, references, model, kind):
    size = world().Get_size()
    ran = layouts(size)
    assert ran, f"no MoE layout fits {size} ranks"
    for tp, pp, ep, expert_tp in ran:
        check_layout(checkpoints[model], references[model], tp, pp, ep, expert_tp, kind)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("model", MODELS)
def test_a_replica_with_no_prompt_still_steps_with_the_others(checkpoints, references, model):
    """3 prompts on dp = 4 replicas (tp = 1, ep = 4): one replica holds none, yet takes part in every exchange."""
    if world().Get_size() != 4:
        pytest.skip("a 4-rank layout")
    prompts = references[model][0][:3]
    for kind in ("flat", "hierarchical"):
        check_layout(checkpoints[model], references[model], 1, 1, 4, 1, kind, prompts)


def one_rank(path: str, prompts: list) -> list:
    """(tokens, prompt logits [V]) of each prompt, the prompts run on one rank as one batch."""
    logits = {}
    out = generate_batch(load_model(path), prompts, list(range(len(prompts))),
                         GenerationParams(NEW_TOKENS, ignore_eos=True), StepTimes(), ScheduleParams(), None, logits)
    return [(tokens, logits[i]) for i, (tokens, _) in enumerate(out)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["flat", "pcc+hierarchical"])
def test_capacity_is_per_replica_step(checkpoints, references, kind):
    """DS-MoE with capacity factor 1 (tokens are dropped): each data-parallel replica's MoE layers take the
    capacity of its own step's tokens, so a layout answers, slice by slice, what one rank answers for each
    replica's slice run as a batch of its own; the whole batch on one rank answers otherwise."""
    path = checkpoints["ds_moe_drops"]
    prompts = references["ds_moe"][0]
    size = world().Get_size()
    whole = one_rank(path, prompts)
    for tp, pp, ep, expert_tp in layouts(size):
        if pp > 1:
            continue
        dp = size // tp
        got = run_layout(path, tp, pp, ep, expert_tp, kind, prompts)
        expected = [row for part in np.array_split(np.arange(len(prompts)), dp)
                    for row in one_rank(path, [prompts[int(i)] for i in part])]
        layout = dict(tp=tp, ep=ep, expert_tp=expert_tp, kind=kind)
        assert [t for t, _ in got] == [t for t, _ in expected], layout
        ours, theirs = np.stack([r for _, r in got]), np.stack([r for _, r in expected])
        tolerance = 1e-5 * max(10.0, float(np.abs(theirs).max()))
        assert np.abs(ours - theirs).max() < tolerance, (layout, np.abs(ours - theirs).max())
        if dp > 1:                                   # the drops do depend on the split
            assert np.abs(np.stack([r for _, r in whole]) - theirs).max() > 1e-2, layout
