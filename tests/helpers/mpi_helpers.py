"""Helpers for in-process MPI tests (run under mpiexec with --with-mpi)."""

import shutil
import tempfile
from pathlib import Path

import pytest


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def shared_files(prefix: str, build):
    """Generator for a module fixture: rank 0 runs `build(root) -> value` in a directory every rank sees; every
    rank gets the value. An error on rank 0 fails the fixture on every rank (none is left in a collective); the
    directory goes when the module is done."""
    comm = world()
    root = Path(comm.bcast(tempfile.mkdtemp(prefix=prefix) if comm.Get_rank() == 0 else None))
    value = error = None
    if comm.Get_rank() == 0:
        try:
            value = build(root)
        except Exception as exc:
            error = repr(exc)
    value, error = comm.bcast((value, error))
    if error:
        pytest.fail(f"building the test files failed on rank 0: {error}")
    yield value
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(root)
