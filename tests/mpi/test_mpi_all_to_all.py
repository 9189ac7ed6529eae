"""All-to-all(v) variants against answers computed by hand and against each other, at 2, 4 and 8 ranks.

Every variant fitting the world runs: flat, and hierarchical with ranks_per_node = each divisor of the world
size in {1, 2, 4, 8}. The 8-rank job runs from one process as a slow test (the suite's MPI runs are 2 and 4).
"""

import sys
from contextlib import contextmanager

import numpy as np
import pytest

from cli_helpers import clean_env, mpiexec_path, run_command
from hpcinfer.comm.all_to_all import FlatAllToAll, HierarchicalAllToAll, make_all_to_all
from hpcinfer.comm.group import MPIGroup, SoloGroup

VARIANTS = [("flat", 1), ("hierarchical", 1), ("hierarchical", 2), ("hierarchical", 4), ("hierarchical", 8)]
IDS = ["flat", "hier-g1", "hier-g2", "hier-g4", "hier-g8"]


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@contextmanager
def all_to_all(kind: str, ranks_per_node: int):
    """The variant over the world group (skipped where ranks_per_node does not divide it); closed after use."""
    group = MPIGroup(world())
    if group.size % ranks_per_node:
        pytest.skip(f"ranks_per_node = {ranks_per_node} does not divide {group.size} ranks")
    impl = make_all_to_all(kind, group, ranks_per_node)
    try:
        yield impl, group
    finally:
        impl.close()


def hand_rows(src: int, dst: int):
    """What src sends dst by hand: (src + dst) % 3 rows; floats [k, 2] (v, -v), v = src*100 + dst + row/1000,
    and int64 ids [k] = src*1000 + dst*10 + row."""
    row = np.arange((src + dst) % 3)
    v = (src * 100 + dst + row / 1000).astype(np.float32)
    return np.stack([v, -v], axis=1), src * 1000 + dst * 10 + row


def concat(blocks):
    return [np.concatenate([b[i] for b in blocks]) for i in range(len(blocks[0]))]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, ranks_per_node", VARIANTS, ids=IDS)
def test_hand_computed_rows_arrive_in_source_order(kind, ranks_per_node):
    with all_to_all(kind, ranks_per_node) as (impl, group):
        p, r = group.size, group.rank
        x, ids = concat([hand_rows(r, d) for d in range(p)])                   # [N, 2], [N]
        counts = np.array([(r + d) % 3 for d in range(p)], dtype=np.int64)
        (got_x, got_ids), recv = impl.exchange([x, ids], counts)
    want_x, want_ids = concat([hand_rows(s, r) for s in range(p)])
    assert recv.dtype == np.int64 and recv.tolist() == [(s + r) % 3 for s in range(p)]
    assert got_x.dtype == np.float32 and got_ids.dtype == np.int64
    np.testing.assert_array_equal(got_x, want_x)
    np.testing.assert_array_equal(got_ids, want_ids)


def random_send(src: int, p: int, pattern: str):
    """Rank src's counts [P] and arrays (float32 [N, 5], int64 [N], float64 [N, 2, 3]), the same on every rank."""
    rng = np.random.default_rng(1000 + src)
    counts = rng.integers(0, 6, size=p)
    if pattern == "sparse":
        counts *= rng.random(p) < 0.3
    elif pattern == "to-rank-0":
        counts[1:] = 0
    n = int(counts.sum())
    arrays = [rng.standard_normal((n, 5)).astype(np.float32), rng.integers(-2**40, 2**40, size=n),
              rng.standard_normal((n, 2, 3))]
    return counts.astype(np.int64), arrays


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pattern", ["uniform", "sparse", "to-rank-0"])
@pytest.mark.parametrize("kind, ranks_per_node", VARIANTS, ids=IDS)
def test_random_sizes_match_flat_and_the_senders(kind, ranks_per_node, pattern):
    with all_to_all(kind, ranks_per_node) as (impl, group):
        p, r = group.size, group.rank
        counts, arrays = random_send(r, p, pattern)
        got, recv = impl.exchange(arrays, counts)
        flat, flat_recv = FlatAllToAll(group).exchange(arrays, counts)
    np.testing.assert_array_equal(recv, flat_recv)
    for a, b in zip(got, flat):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    # and both against what every sender sent this rank, rebuilt here from the senders' seeds
    blocks, want_recv = [], []
    for s in range(p):
        c, arrs = random_send(s, p, pattern)
        lo = int(c[:r].sum())
        blocks.append([a[lo:lo + c[r]] for a in arrs])
        want_recv.append(int(c[r]))
    assert recv.tolist() == want_recv
    for a, want in zip(got, concat(blocks)):
        np.testing.assert_array_equal(a, want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, ranks_per_node", VARIANTS, ids=IDS)
def test_nobody_sends_anything(kind, ranks_per_node):
    with all_to_all(kind, ranks_per_node) as (impl, group):
        arrays = [np.zeros((0, 4), np.float32), np.zeros(0, np.int64)]
        (x, ids), recv = impl.exchange(arrays, np.zeros(group.size, np.int64))
    assert recv.tolist() == [0] * group.size
    assert x.shape == (0, 4) and x.dtype == np.float32 and ids.shape == (0,) and ids.dtype == np.int64


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8])
def test_hierarchical_sub_communicators_are_nodes_and_local_columns(ranks_per_node):
    """(G - 1) + (M - 1) peers: the node's G ranks, and the M ranks of the same local index."""
    with all_to_all("hierarchical", ranks_per_node) as (impl, group):
        g, r = ranks_per_node, group.rank
        node_members = sorted(impl.intra.comm.allgather(r))
        column_members = sorted(impl.inter.comm.allgather(r))
    assert node_members == [r // g * g + i for i in range(g)]
    assert column_members == [r % g + g * n for n in range(group.size // g)]


# ------------------------------------------------------------------------------------- one process, no peers

def test_a_group_of_one_copies():
    x, ids = np.arange(6, dtype=np.float32).reshape(3, 2), np.arange(3)
    for kind in ("flat", "hierarchical"):
        (gx, gids), recv = make_all_to_all(kind, SoloGroup(), 8).exchange([x, ids], np.array([3]))
        assert recv.tolist() == [3] and gx is not x
        np.testing.assert_array_equal(gx, x)
        np.testing.assert_array_equal(gids, ids)


def test_bad_arguments_are_clear_errors():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="ranks_per_node = 2 must divide the group size 1"):
        HierarchicalAllToAll(MPIGroup(MPI.COMM_SELF), 2)
    with pytest.raises(ValueError, match="not one of"):
        make_all_to_all("pcc", SoloGroup(), 1)
    with pytest.raises(ValueError, match="sum\\(send_counts\\) = 2 rows"):
        FlatAllToAll(SoloGroup()).exchange([np.zeros((3, 2))], np.array([2]))
    with pytest.raises(ValueError, match="1 non-negative counts"):
        FlatAllToAll(SoloGroup()).exchange([np.zeros(2)], np.array([1, 1]))


@pytest.mark.slow
def test_every_variant_on_8_ranks(tmp_path):
    """The MPI tests of this file under mpiexec -n 8 (oversubscribed on a small machine); every rank passes."""
    cmd = [mpiexec_path(), "-n", "8", "-outfile-pattern", str(tmp_path / "out.%r"),
           "-errfile-pattern", str(tmp_path / "err.%r"), sys.executable, "-m", "pytest", "-q", "-p",
           "no:cacheprovider", "--color=no", "--with-mpi", "-m", "mpi", __file__]
    done = run_command(cmd, timeout=300, env=clean_env(extra={"MPIEXEC_TIMEOUT": "310"}))
    reports = [(tmp_path / f"out.{r}").read_text() if (tmp_path / f"out.{r}").exists() else "" for r in range(8)]
    assert done.returncode == 0, f"{done.stderr}\n{reports[0]}\n{(tmp_path / 'err.0').read_text()}"
    for r, text in enumerate(reports):
        summary = text.strip().splitlines()[-1] if text.strip() else "(no output)"
        assert " passed" in summary and "failed" not in summary and "error" not in summary, f"rank {r}: {summary}"


# ------------------------------------------------------------------- the NCCL hops, with MPI standing in for NCCL

class LoopbackNccl:
    """What NcclHop reads from an NcclGroup, with NumPy arrays as the "device" arrays and each NCCL group of
    sends and receives done by MPI (Isend/Irecv of the bytes, in transfer order per peer: NCCL's own rule)."""

    cp = np

    def __init__(self, comm):
        self.comm, self.size, self.rank = comm, comm.Get_size(), comm.Get_rank()

    def _grouped(self, transfers):
        from mpi4py import MPI

        requests = [(self.comm.Isend if op == "send" else self.comm.Irecv)(buf.reshape(-1).view(np.uint8), peer)
                    for op, buf, peer in transfers if buf.nbytes]
        MPI.Request.Waitall(requests)

    def close(self):
        pass


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks_per_node", [1, 2, 4])
def test_two_hop_exchange_over_nccl_hops_matches_flat(ranks_per_node):
    """HierarchicalAllToAll with NcclHop hops (comm/nccl_group.py; MPI standing in for NCCL) delivers the rows
    the flat MPI exchange does, in the same order."""
    from hpcinfer.comm.nccl_group import NcclHop

    group = MPIGroup(world())
    if group.size % ranks_per_node:
        pytest.skip(f"ranks_per_node = {ranks_per_node} does not divide {group.size} ranks")
    p, r = group.size, group.rank
    x, ids = concat([hand_rows(r, d) for d in range(p)])
    counts = np.array([(r + d) % 3 for d in range(p)], dtype=np.int64)
    hops = HierarchicalAllToAll(group, ranks_per_node, make_hop=lambda comm, _m, _w: NcclHop(LoopbackNccl(comm)))
    try:
        (got_x, got_ids), recv = hops.exchange([x, ids], counts)
    finally:
        hops.close()
    (want_x, want_ids), want_recv = FlatAllToAll(group).exchange([x, ids], counts)
    assert recv.tolist() == want_recv.tolist()
    np.testing.assert_array_equal(got_x, want_x)
    np.testing.assert_array_equal(got_ids, want_ids)
