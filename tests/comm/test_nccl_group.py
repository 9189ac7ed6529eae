"""Device-array communicators (hpcinfer.comm.nccl_group) and how the backend and comm options resolve.

- Everywhere: the modules import without cupy and without a GPU; without a GPU, CupyOps, make_ops("cupy") and
  NcclGroup fail with a clear message; `[runtime] comm` resolves and validates.
- With a GPU, one process: groups of one rank are the identity, device arrays stay on the device.
- With a GPU, under `mpiexec -n 2|4 python -m pytest --with-mpi`: every collective, the all-to-all(v) and the
  pipeline's StageLink over StagedMPIGroup (ranks may share a GPU) and over NcclGroup (needs one GPU per rank)
  against answers computed by hand.
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from hpcinfer.backend.cupy_ops import gpu_available
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.backend.ops import make_ops
from hpcinfer.comm.nccl_group import NcclGroup, device_group_factory, nccl_available, resolve_comm
from hpcinfer.errors import ConfigError

GPU = gpu_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU visible to cupy (cupy.is_available() is False)")
without_gpu = pytest.mark.skipif(GPU, reason="checks the error raised where there is no GPU; this machine has one")


class FakeWorld:
    """A world of one rank for resolve_comm (its only collective is an allgather)."""

    def allgather(self, value):
        return [value]


# ---------------------------------------------------------------------------------- anywhere, GPU or not

def test_modules_import_and_auto_means_numpy_without_cupy_installed():
    """With cupy made unimportable, everything imports, auto picks numpy, and asking for cupy says what to
    install."""
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import hpcinfer.backend.cupy_ops, hpcinfer.comm.nccl_group, hpcinfer.runtime, hpcinfer.config\n"
        "from hpcinfer.backend.ops import make_ops\n"
        "from hpcinfer.errors import ConfigError\n"
        "assert make_ops('auto').name == 'numpy'\n"
        "try:\n"
        "    make_ops('cupy')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "needs cupy" in result.stdout and "pip install" in result.stdout, result.stdout


def test_comm_resolves_to_mpi_for_the_numpy_backend_and_refuses_nccl():
    ops = NumpyOps()
    assert resolve_comm("auto", ops, FakeWorld()) == "mpi"
    assert resolve_comm("mpi", ops, FakeWorld()) == "mpi"
    with pytest.raises(ConfigError, match="needs the cupy backend"):
        resolve_comm("nccl", ops, FakeWorld())
    with pytest.raises(ConfigError, match="auto, nccl, mpi"):
        resolve_comm("tcp", ops, FakeWorld())
    group = object()
    assert device_group_factory("mpi", ops)(group) is group                 # numpy: the MPI groups as they are


def test_config_comm_key_defaults_to_auto_and_is_checked(tmp_path):
    from hpcinfer.config import load_config

    path = tmp_path / "job.toml"
    path.write_text('[model]\ncheckpoint = "m.h5"\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n')
    assert load_config(str(path)).runtime.comm == "auto"
    assert load_config(str(path), ["runtime.comm=mpi"]).runtime.comm == "mpi"
    with pytest.raises(ConfigError, match="runtime.comm = 'tcp' is not allowed; choose one of auto, nccl, mpi"):
        load_config(str(path), ["runtime.comm=tcp"])
    with pytest.raises(ConfigError, match="runtime.comm = 'nccl' needs device arrays"):
        load_config(str(path), ["runtime.comm=nccl", "runtime.backend=numpy"])


# ------------------------------------------------------------------------------------------- without a GPU

@without_gpu
def test_without_a_gpu_auto_is_numpy_and_cupy_is_a_clear_error():
    from hpcinfer.backend.cupy_ops import CupyOps

    assert make_ops("auto").name == "numpy"
    for build in (CupyOps, lambda: make_ops("cupy"), lambda: make_ops("cupy", device=1)):
        with pytest.raises(ConfigError) as info:
            build()
        message = str(info.value)
        assert "cupy" in message and ("needs a CUDA GPU" in message or "needs cupy" in message), message


@without_gpu
def test_without_a_gpu_an_nccl_group_is_a_clear_error():
    mpi_group = types.SimpleNamespace(size=2, rank=0, comm=None, name="tp")
    with pytest.raises(ConfigError) as info:
        NcclGroup(mpi_group)
    message = str(info.value)
    assert "NCCL" in message and ("CUDA GPU" in message or "needs cupy" in message), message
    assert not nccl_available()


# ------------------------------------------------------------------------------------ one GPU, one process

def self_group():
    from mpi4py import MPI

    from hpcinfer.comm.group import MPIGroup

    return MPIGroup(MPI.COMM_SELF, "self")


@needs_gpu
@pytest.mark.parametrize("kind", ["staged", "nccl"])
def test_groups_of_one_rank_are_the_identity_on_device_arrays(kind):
    import cupy as cp

    from hpcinfer.comm.nccl_group import StagedMPIGroup

    if kind == "nccl" and not nccl_available():
        pytest.skip("the NCCL library does not load here")
    group = (NcclGroup if kind == "nccl" else StagedMPIGroup)(self_group())
    x = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    for out, expect in ((group.all_reduce(x.copy()), x), (group.all_gather(x), x[None]),
                        (group.broadcast(x.copy()), x), (group.all_gather_v(x), x)):
        assert isinstance(out, cp.ndarray)
        np.testing.assert_array_equal(out.get(), expect.get())
    host = np.array([3, 4], dtype=np.int64)
    assert isinstance(group.all_reduce(host.copy()), np.ndarray)               # host arrays stay on the host
    (rows, ids), counts = group.make_all_to_all("flat", 1).exchange([x, host], np.array([2]))
    assert isinstance(rows, cp.ndarray) and isinstance(ids, np.ndarray) and counts.tolist() == [2]
    np.testing.assert_array_equal(rows.get(), x.get())
    np.testing.assert_array_equal(ids, host)


@needs_gpu
def test_runtime_resolution_with_the_cupy_backend_on_one_rank():
    ops = make_ops("cupy", device=0)
    assert resolve_comm("mpi", ops, FakeWorld()) == "mpi"
    assert resolve_comm("auto", ops, FakeWorld()) == ("nccl" if nccl_available() else "mpi")
    assert device_group_factory("nccl", ops) is NcclGroup


# --------------------------------------------------------------------------- several ranks (mpiexec, GPU)

def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def device_groups(kind: str):
    """(cupy, the world as a `kind` group); this rank on GPU rank % count. NCCL: skipped unless one GPU a rank."""
    import cupy as cp

    from hpcinfer.comm.group import MPIGroup
    from hpcinfer.comm.nccl_group import StagedMPIGroup

    comm = world()
    gpus = cp.cuda.runtime.getDeviceCount()
    if kind == "nccl" and (gpus < comm.Get_size() or not nccl_available()):
        pytest.skip(f"NCCL needs one GPU per rank and the NCCL library: {comm.Get_size()} ranks, {gpus} GPU(s), "
                    f"NCCL {'loads' if nccl_available() else 'does not load'}")
    make_ops("cupy", device=comm.Get_rank())
    mpi_group = MPIGroup(comm, "world")
    return cp, (NcclGroup(mpi_group) if kind == "nccl" else StagedMPIGroup(mpi_group))


KINDS = [pytest.param("staged", id="staged-mpi"), pytest.param("nccl", id="nccl")]


@needs_gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", KINDS)
def test_all_reduce_all_gather_broadcast_against_hand_answers(kind):
    cp, group = device_groups(kind)
    n, r = group.size, group.rank
    for dtype in (np.float32, np.float16, np.int64):
        x = cp.arange(6, dtype=dtype).reshape(2, 3) * (r + 1)
        out = group.all_reduce(x)
        assert isinstance(out, cp.ndarray) and out.dtype == dtype
        np.testing.assert_array_equal(out.get(), np.arange(6, dtype=dtype).reshape(2, 3) * (n * (n + 1) // 2))
    gathered = group.all_gather(cp.full((2, 2), r, dtype=cp.float32))                     # [n, 2, 2]
    np.testing.assert_array_equal(gathered.get(), np.arange(n, dtype=np.float32)[:, None, None] * np.ones((2, 2)))
    root = n - 1
    np.testing.assert_array_equal(group.broadcast(cp.array([r * 10 + 1, 7]), root=root).get(), [root * 10 + 1, 7])
    rows = group.all_gather_v(cp.full((r + 1, 3), r, dtype=cp.float32))                   # rank r: r + 1 rows
    expect = np.concatenate([np.full((s + 1, 3), s, np.float32) for s in range(n)])
    np.testing.assert_array_equal(rows.get(), expect)
    host = group.all_reduce(np.array([r], dtype=np.int64))                                 # host values: MPI
    assert isinstance(host, np.ndarray) and host.tolist() == [n * (n - 1) // 2]
    group.barrier()


@needs_gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("exchange", ["flat", "hierarchical"])
def test_all_to_all_v_against_hand_answers(kind, exchange):
    """Rank r sends (r + p) % 3 rows to rank p, row i valued [r, p, i]; a host int64 array rides along."""
    cp, group = device_groups(kind)
    n, r = group.size, group.rank
    per_node = 2 if n % 2 == 0 else 1
    counts = np.array([(r + p) % 3 for p in range(n)], dtype=np.int64)
    rows = np.array([[r, p, i] for p in range(n) for i in range(counts[p])], dtype=np.float32).reshape(-1, 3)
    ids = (rows[:, 1] * 100 + rows[:, 2]).astype(np.int64)
    all_to_all = group.make_all_to_all(exchange, per_node)
    (got_rows, got_ids), recv_counts = all_to_all.exchange([cp.asarray(rows), ids], counts)
    all_to_all.close()
    expect = np.array([[s, r, i] for s in range(n) for i in range((s + r) % 3)], dtype=np.float32).reshape(-1, 3)
    assert recv_counts.tolist() == [(s + r) % 3 for s in range(n)]
    assert isinstance(got_rows, cp.ndarray) and isinstance(got_ids, np.ndarray)
    np.testing.assert_array_equal(got_rows.get(), expect)
    np.testing.assert_array_equal(got_ids, (expect[:, 1] * 100 + expect[:, 2]).astype(np.int64))


@needs_gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_stage_link_moves_arrays_forward_and_back(kind):
    """comm/pipeline.py's StageLink over the group: stage 0 -> stage 1 activations, last -> first an array."""
    from hpcinfer.comm.pipeline import StageLink

    cp, group = device_groups(kind)
    n, r = group.size, group.rank
    link = StageLink(group)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    if r == 0:
        link.send_to_next_stage({"mb": 0}, x)
        header, back = link.recv_from_last_stage()
        assert header["mb"] == 0
        np.testing.assert_array_equal(cp.asnumpy(back), x * n)
    elif r < n - 1:
        header, got = link.recv_from_prev_stage()
        link.send_to_next_stage(header, cp.asnumpy(got) + x)
    else:
        header, got = link.recv_from_prev_stage()
        np.testing.assert_array_equal(cp.asnumpy(got), x * (n - 1))
        link.send_to_first_stage(header, cp.asnumpy(got) + x)
    link.flush()
    group.barrier()
