"""Tensor-parallel encoders (tp=2, in process under mpiexec -n 2) give transformers' per-token hidden states and
mean-pooled embeddings, for the tiny BERT, RoBERTa and DistilBERT models and for MiniLM when `make minilm` made it.
(Data parallelism and tp through the CLI: tests/cli/test_embed_job.py.)"""

import numpy as np
import pytest

from encoder_models import ENCODER_FAMILIES, MINILM, SENTENCES, hf_hidden_states, mean_pool, save_tiny_encoder
from mpi_helpers import shared_files, world
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.comm.group import Groups, MPIGroup
from hpcinfer.embed.api import embed_texts, hidden_states, load_encoder


@pytest.fixture(scope="module")
def checkpoints():
    """Rank 0 builds and converts every tiny encoder (and MiniLM, when its folder is there) and computes the
    transformers reference of the sentences; every rank gets the paths and references."""
    def build(root):
        out = {}
        folders = {f: save_tiny_encoder(f, root / f) for f in ENCODER_FAMILIES}
        if (MINILM / "model.safetensors").is_file():
            folders["minilm"] = str(MINILM)
        for name, folder in folders.items():
            convert_hf(folder, str(root / f"{name}.h5"))
            _, tokenizer = load_encoder(str(root / f"{name}.h5"))
            sequences = [tokenizer.encode(t) for t in SENTENCES]
            out[name] = (str(root / f"{name}.h5"), sequences, hf_hidden_states(folder, sequences))
        return out

    yield from shared_files("hpcinfer-embed-tp-", build)


def tp_groups(tp: int) -> Groups:
    comm = world()
    return Groups(tp=MPIGroup(comm.Split(color=comm.Get_rank() // tp, key=comm.Get_rank()), "tp"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ENCODER_FAMILIES + ("minilm",))
def test_tensor_parallel_encoder_matches_transformers(checkpoints, name):
    if name not in checkpoints:
        pytest.skip(f"needs {MINILM} (run `make minilm`)")
    if world().Get_size() % 2:
        pytest.skip("tp=2 needs an even number of ranks")
    path, sequences, ref = checkpoints[name]
    model, tokenizer = load_encoder(path, groups=tp_groups(2))
    ours = hidden_states(model, sequences)
    assert max(np.abs(a - b).max() for a, b in zip(ours, ref)) < 1e-4
    pooled = embed_texts(model, tokenizer, SENTENCES)
    assert np.sum(pooled * mean_pool(ref), axis=1).min() > 0.99999
