"""`hpcinfer run`: init MPI, validate everything, build the mesh, backend and model, run the job, write outputs.

Failure discipline (no rank is ever left waiting):
- set-up steps run on every rank and then *agree*: an allgather of the error messages, so a problem found on any
  rank (bad config, checkpoint, prompts) is reported once by rank 0 and every rank exits 2, before any weight is read;
- any error after set-up (or a bug anywhere) prints the failing rank's message and aborts the whole job.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from .backend.ops import make_ops
from .comm.group import Groups, MoELayout
from .comm.mesh import build_mesh, shared_memory_ranks
from .comm.nccl_group import device_group_factory, resolve_comm
from .comm.pipeline import StageLink
from .config import load_config
from .errors import HpcinferError
from .job import RankReport, generate_share, prepare_job, write_outputs
from .model.transformer import Decoder
from .offload.tiers import WeightTiers, place_layers


class AgreedError(Exception):
    """A set-up error every rank knows about (so no rank needs to be aborted)."""


def agree(world, step):
    """Run `step` on every rank; if it raised an HpcinferError anywhere, raise AgreedError everywhere."""
    try:
        value, message = step(), None
    except HpcinferError as exc:
        value, message = None, str(exc)
    messages = world.allgather(message)
    failed = [m for m in messages if m is not None]
    if failed:
        raise AgreedError(failed[0])
    return value


def main_run(config_path: str, overrides: list[str]) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        _run(world, config_path, overrides)
        return 0
    except AgreedError as exc:
        if world.Get_rank() == 0:
            print(f"hpcinfer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except HpcinferError as exc:
        return _abort(world, f"hpcinfer: error on rank {world.Get_rank()}: {exc}", exc.exit_code)
    except BaseException as exc:  # a bug or a system error: report it whole, and bring every rank down
        detail = "".join(traceback.format_exception(exc))
        return _abort(world, f"hpcinfer: internal error on rank {world.Get_rank()}:\n{detail}", 1)


def _abort(world, message: str, code: int) -> int:
    print(message, file=sys.stderr, flush=True)
    if world.Get_size() > 1:
        world.Abort(code)
        os._exit(code)
    return code


def _set_threads(config, world) -> int:
    """BLAS threads per rank: the configured number, or the cores of this node divided among its ranks."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    local_ranks = world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    threads = config.runtime.threads or max(1, len(os.sched_getaffinity(0)) // local_ranks)
    threadpool_limits(threads)
    return threads


def _run(world, config_path: str, overrides: list[str]) -> None:
    t_start = time.perf_counter()
    rank = world.Get_rank()
    config = agree(world, lambda: load_config(config_path, overrides))
    ranks_per_node = config.parallel.ranks_per_node or shared_memory_ranks(world)
    job = agree(world, lambda: prepare_job(config, world.Get_size(), rank, ranks_per_node))
    mesh = build_mesh(world, config.parallel.tp, config.parallel.pp, ranks_per_node)
    threads = _set_threads(config, world)
    _print_mesh(world, mesh, threads)

    # the backend on this rank's GPU (node-local rank), then the communicators for its arrays (CUDA backend)
    ops = agree(world, lambda: make_ops(config.runtime.backend, device=mesh.local_rank))
    comm = agree(world, lambda: resolve_comm(config.runtime.comm, ops, world))
    groups = _groups(config, mesh, device_group_factory(comm, ops))

    t0 = time.perf_counter()
    stage = job.stages[mesh.coords[0]]
    with job.ckpt as ckpt:
        model = Decoder(ops, groups, ckpt.arch, config.model.dtype, stage, config.moe.capacity_factor)
        model.weights = _weight_tiers(config, model, ops, rank)
        model.load(ckpt, after_block=model.weights.place if model.weights is not None else None)
    load_s = time.perf_counter() - t0
    _injected_fault(rank)

    t0 = time.perf_counter()
    link = StageLink(mesh.pp) if mesh.shape.pp > 1 else None
    times, local = generate_share(model, job, mesh, link)
    generate_s = time.perf_counter() - t0

    is_writer = mesh.tp.rank == 0 and stage.is_last             # one copy of each replica's results
    gathered = world.gather(RankReport(mesh.coords, local if is_writer else [], times, generate_s))
    if rank == 0:
        write_outputs(job, model.arch, mesh, gathered, load_s, time.perf_counter() - t_start, threads)


def _groups(config, mesh, wrap) -> Groups:
    """The mesh's MPI groups, each wrapped by `wrap` (NCCL or host-staged groups for device arrays; identity for
    numpy). Every rank wraps the same groups in the same order: building an NCCL communicator is collective."""
    par = config.parallel
    moe = MoELayout(par.ep, par.expert_tp, config.moe.all_to_all, mesh.node_size_in(mesh.stage_members()),
                    mesh.node_size_in(mesh.dp_members()))
    return Groups(tp=wrap(mesh.tp), pp=wrap(mesh.pp), stage=wrap(mesh.stage), dp=wrap(mesh.dp), moe=moe)


def _weight_tiers(config, model, ops, rank: int):
    """The offload tiers of this rank's layers, when [offload] is active (docs/offload.md)."""
    off = config.offload
    if not off.active:
        return None
    tiers = place_layers(model.num_local_layers, off.weights_gpu, off.weights_cpu)
    disk_dir = os.path.join(off.disk_dir, f"rank{rank:05d}") if off.disk_dir else None
    return WeightTiers(ops, model.blocks, tiers, disk_dir, off.prefetch_layers)


def _injected_fault(rank: int) -> None:
    """For tests of the failure discipline: HPCINFER_FAIL_RANK=r makes rank r fail after loading its weights,
    while its peers go on into the schedule and wait for it."""
    if os.environ.get("HPCINFER_FAIL_RANK") == str(rank):
        raise RuntimeError(f"injected failure on rank {rank} (HPCINFER_FAIL_RANK)")


def _print_mesh(world, mesh, threads: int) -> None:
    descriptions = world.gather(mesh.describe())
    if world.Get_rank() == 0:
        print(f"hpcinfer: {world.Get_size()} ranks on {world.Get_size() // mesh.ranks_per_node} node(s), mesh "
              f"pp={mesh.shape.pp} dp={mesh.shape.dp} tp={mesh.shape.tp}, {threads} BLAS thread(s) per rank",
              flush=True)
        for line in descriptions:
            print(f"  {line}", flush=True)
