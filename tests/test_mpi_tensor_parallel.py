"""Tensor parallelism gives the single-rank logits (within 1e-4) and the same greedy tokens, for every family,
at tp = 2 and (where the heads divide) tp = 4."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hf_models import VARIANTS, save_tiny_model
from hpcinfer.api import generate, load_model, prompt_logits
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.comm.group import Groups, MPIGroup

LENGTHS = (3, 11, 1, 20)


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="module")
def checkpoints():
    """Rank 0 converts every tiny model once into a directory all ranks share; every rank then reads them."""
    comm = world()
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcinfer-tp-") if comm.Get_rank() == 0 else None))
    paths = {v: str(root / f"{v}.h5") for v in VARIANTS}
    if comm.Get_rank() == 0:
        for variant, path in paths.items():
            convert_hf(str(save_tiny_model(variant, root / variant)), path)
    comm.Barrier()
    yield paths
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(root)


def tp_groups(tp: int) -> Groups:
    comm = world()
    return Groups(tp=MPIGroup(comm.Split(color=comm.Get_rank() // tp, key=comm.Get_rank()), "tp"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_matches_single_rank(checkpoints, variant, tp):
    if world().Get_size() % tp:
        pytest.skip(f"tp={tp} needs a multiple of {tp} ranks")
    reference = load_model(checkpoints[variant])
    if reference.arch.num_kv_heads % tp:
        pytest.skip(f"{variant} has {reference.arch.num_kv_heads} KV heads")
    sharded = load_model(checkpoints[variant], groups=tp_groups(tp))
    prompts = [np.random.default_rng(n).integers(0, reference.arch.vocab_size, n).tolist() for n in LENGTHS]
    assert np.abs(prompt_logits(sharded, prompts) - prompt_logits(reference, prompts)).max() < 1e-4
    assert generate(sharded, prompts, 8) == generate(reference, prompts, 8)
