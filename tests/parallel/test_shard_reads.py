"""Each rank reads only its own shard: with tp = 2, every matrix is read as a block of rows of at most half
(vocabulary: ceil(V / 2)) of the tensor, never whole. Runs in one process with a stand-in tp group, since
loading needs no collectives."""

import math

import pytest

from hf_models import save_tiny_model
from hpcinfer.checkpoint.format import open_checkpoint
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.comm.group import Groups
from hpcinfer.model.transformer import Decoder


class LoadOnlyGroup:
    """A tp group of `size` ranks seen from `rank`, for code that only reads shards (no collectives)."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_rank_reads_only_its_rows(tmp_path, variant, rank):
    path = str(tmp_path / "m.h5")
    convert_hf(str(save_tiny_model(variant, tmp_path / "hf")), path)
    reads = []
    with open_checkpoint(path) as ckpt:
        original = ckpt.read

        def spy(name, rows=None):
            reads.append((name, rows))
            return original(name, rows)

        ckpt.read = spy
        Decoder(NumpyOps(), Groups(tp=LoadOnlyGroup(2, rank)), ckpt.arch).load(ckpt)
        shapes = {name: ckpt.shape(name) for name, _ in reads}
    arch = ckpt.arch
    for name, rows in reads:
        full = shapes[name][0]
        if len(shapes[name]) == 1 or name == "embed.positions":
            continue                                             # norms, biases, positions: replicated
        assert rows is not None, f"{name} read whole"
        start, stop, _ = rows.indices(full)
        limit = math.ceil(arch.vocab_size / 2) if full == arch.vocab_size else full // 2
        assert 0 < stop - start <= limit, (name, rows)
        assert start == min(rank * limit, full), (name, rows)
    matrices = {n for n, s in shapes.items() if len(s) == 2 and n != "embed.positions"}
    assert matrices == {n for n, r in reads if r is not None and len(shapes[n]) == 2}
