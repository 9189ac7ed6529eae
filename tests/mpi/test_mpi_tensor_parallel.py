"""Tensor parallelism gives the single-rank logits (within 1e-4) and the same greedy tokens, for every family,
at tp = 2 and (where the heads divide) tp = 4."""

import numpy as np
import pytest

from hf_models import VARIANTS, save_tiny_model
from mpi_helpers import shared_files, world
from hpcinfer.api import generate, load_model, prompt_logits
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.comm.group import Groups, MPIGroup

LENGTHS = (3, 11, 1, 20)


@pytest.fixture(scope="module")
def checkpoints():
    """Rank 0 converts every tiny model once; every rank then reads them."""
    def build(root):
        paths = {v: str(root / f"{v}.h5") for v in VARIANTS}
        for variant, path in paths.items():
            convert_hf(str(save_tiny_model(variant, root / variant)), path)
        return paths

    yield from shared_files("hpcinfer-tp-", build)


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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cpu_kernels", ["numpy", "numba"])
def test_tensor_parallel_under_each_cpu_kernel_setting(checkpoints, cpu_kernels):
    """tp = 2 against one rank with `[runtime] cpu_kernels` named (the test above runs the default), on llama."""
    if world().Get_size() % 2:
        pytest.skip("tp=2 needs an even number of ranks")
    path = checkpoints["llama"]
    reference = load_model(path, cpu_kernels=cpu_kernels)
    sharded = load_model(path, groups=tp_groups(2), cpu_kernels=cpu_kernels)
    assert sharded.ops.cpu_kernels == cpu_kernels
    prompts = [np.random.default_rng(n).integers(0, reference.arch.vocab_size, n).tolist() for n in LENGTHS]
    assert np.abs(prompt_logits(sharded, prompts) - prompt_logits(reference, prompts)).max() < 1e-4
    assert generate(sharded, prompts, 8) == generate(reference, prompts, 8)
