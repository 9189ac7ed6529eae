"""Collectives and the mesh against answers computed by hand, at every world size the suite runs (2 and 4)."""

import numpy as np
import pytest

from hpcinfer.comm.group import MPIGroup
from hpcinfer.comm.mappings import broadcast_from_tp_root, gather_from_tp, reduce_from_tp
from hpcinfer.comm.mesh import MeshShape, build_mesh


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_all_reduce_sums_rank_dependent_values():
    group = MPIGroup(world())
    n, r = group.size, group.rank
    x = np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1)
    expect = np.arange(6, dtype=np.float32).reshape(2, 3) * (n * (n + 1) / 2)
    np.testing.assert_array_equal(reduce_from_tp(x, group), expect)


@pytest.mark.mpi(min_size=2)
def test_all_gather_concatenates_in_rank_order():
    group = MPIGroup(world())
    x = np.full((2, 2), group.rank, dtype=np.float32)
    out = gather_from_tp(x, group, np)                       # [2, 2 * size]
    expect = np.concatenate([np.full((2, 2), r, np.float32) for r in range(group.size)], axis=-1)
    np.testing.assert_array_equal(out, expect)


@pytest.mark.mpi(min_size=2)
def test_broadcast_gives_every_rank_root_value():
    group = MPIGroup(world())
    x = np.array([group.rank * 10 + 1, 7], dtype=np.int64)
    assert broadcast_from_tp_root(x, group).tolist() == [1, 7]


def test_mesh_coordinates_put_tp_fastest():
    shape = MeshShape.for_world(8, tp=2, pp=1)
    assert shape.dp == 4
    assert [shape.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


@pytest.mark.mpi(min_size=2)
def test_mesh_groups_hold_the_expected_ranks():
    comm = world()
    tp = 2
    mesh = build_mesh(comm, tp=tp, pp=1, ranks_per_node=comm.Get_size())
    r = comm.Get_rank()
    members = lambda g: sorted(g.comm.allgather(r))
    assert members(mesh.tp) == [r // tp * tp + i for i in range(tp)]
    assert members(mesh.dp) == [r % tp + tp * i for i in range(comm.Get_size() // tp)]
    assert mesh.coords == (0, r // tp, r % tp)
