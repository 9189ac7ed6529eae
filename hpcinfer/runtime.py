"""`hpcinfer run`: init MPI, validate everything, build the mesh, backend and model, run the job, write outputs.

Failure discipline (no rank is ever left waiting):
- set-up steps run on every rank and then *agree*: an allgather of the error messages, so a problem found on any
  rank (bad config, checkpoint, prompts) is reported once by rank 0 and every rank exits 2, before any weight is read;
- any error after set-up (or a bug anywhere) prints the failing rank's message and aborts the whole job;
- a collective or transfer that does not complete within [runtime] comm_timeout aborts the job with exit code 3
  (comm/watchdog.py), and SIGTERM / SIGUSR1 stop every rank after the current batch round with exit code 75.
Exit codes: 0 done, 1 internal error, 2 configuration or input error, 3 watchdog timeout, 75 stopped (resume by
running the same command again). docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

from .backend.ops import make_ops
from .comm.group import Groups, MoELayout, MPIGroup
from .comm.mesh import build_mesh, shared_memory_ranks
from .comm.mpi_library import load_mpi
from .comm.nccl_group import NcclGroup, device_group_factory, resolve_comm
from .comm.pipeline import StageLink
from .config import batching_choice, gpu_kv_dtype, load_config
from .embed.job import embed_metrics, open_writer, prepare_embed_job, run_rounds
from .errors import HpcinferError
from .metrics import held_bytes
from .faults import Faults
from .generate.graphs import check_comm as check_graphs_comm
from .generate.output import write_metrics
from .generate.progress import Progress
from .generate.rounds import BatchRounds, StopFlag
from .generate.runner import Runner
from .job import RankReport, generate_share, prepare_job, write_outputs
from .model.encoder import Encoder
from .logs import setup_logging
from .offload.tiers import WeightTiers, place_layers

ABORT_GRACE_S = 0.5
EXIT_STOPPED = 75                 # EX_TEMPFAIL: stopped by a signal, committed results kept; re-run to resume
log = logging.getLogger("hpcinfer")


class AgreedError(Exception):
    """A set-up error every rank knows about (so no rank needs to be aborted)."""


class Stopped(Exception):
    """Every rank agreed to stop early after a signal; the finished batches are committed."""


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


def main_run(config_path: str, overrides: list[str], restart: bool = False) -> int:
    world = load_mpi().COMM_WORLD
    setup_logging(world.Get_rank())
    stop = StopFlag()
    stop.install()
    try:
        _run(world, config_path, overrides, restart, stop)
        return 0
    except Stopped as exc:
        if world.Get_rank() == 0:
            print(f"hpcinfer: {exc}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
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
        time.sleep(ABORT_GRACE_S)            # let the launcher forward the message before it kills the job
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


def _run(world, config_path: str, overrides: list[str], restart: bool = False, stop: StopFlag = None) -> None:
    t_start = time.perf_counter()
    rank = world.Get_rank()
    config = agree(world, lambda: load_config(config_path, overrides))
    setup_logging(rank, config.runtime.log_level)
    ranks_per_node = config.parallel.ranks_per_node or shared_memory_ranks(world)
    if config.embed is not None:                              # an [embed] job (hpcinfer/embed, docs/embed.md)
        return _run_embed(world, config, ranks_per_node, t_start, restart, stop or StopFlag())
    job = agree(world, lambda: prepare_job(config, world.Get_size(), rank, ranks_per_node, restart))
    job.skip = set(world.bcast(sorted(job.writer.done) if rank == 0 else None))
    mode, why = batching_choice(config)
    if why:                                                   # a mode derived from the config says why
        log.info("schedule.batching = %s runs %s batching: %s", config.schedule.batching, mode, why)
    if job.skip:
        log.info("resuming %s: %d of %d prompts are already done", config.generate.output, len(job.skip),
                 len(job.prompts))
    faults = Faults(rank)
    mesh, threads, ops, groups, comm = _compute_setup(world, config, config.parallel.pp, ranks_per_node)

    t0 = time.perf_counter()
    stage = job.stages[mesh.coords[0]]
    with job.ckpt as ckpt:
        runner = Runner.load(config, ckpt, ops, groups, stage, weight_source(config, ops, rank, mesh, comm),
                             job.load_quant, lambda tiers: faults.after_block(tiers.place if tiers else None),
                             faults.sampling_hook(stage.is_last))
    load_s = time.perf_counter() - t0
    faults.at("after_load")
    faults.arm([mesh.world, mesh.tp, mesh.dp, mesh.pp, mesh.stage])
    _generate(config, mesh, runner, job, stop or StopFlag(), load_s, t_start, threads)


def _generate(config, mesh, runner, job, stop: StopFlag, load_s: float, t_start: float, threads: int) -> None:
    """The schedule, one batch round at a time (each committed by rank 0), then the final outputs; raises
    Stopped on every rank when a signal asked them to stop."""
    t0 = time.perf_counter()
    link = StageLink(mesh.pp) if mesh.shape.pp > 1 else None
    is_writer = mesh.tp.rank == 0 and job.stages[mesh.coords[0]].is_last    # one copy of each replica's results
    progress = None
    if mesh.world.rank == 0 and config.runtime.progress != "off":
        mode = config.runtime.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() and sys.stderr.isatty() else "log"
        progress = Progress(len(job.prompts), len(job.skip), mode, stream=sys.stderr)
    rounds = BatchRounds(mesh.world, job.writer, progress, stop, is_writer)
    times, _ = generate_share(runner, job, mesh, link, rounds.end)
    generate_s = time.perf_counter() - t0
    gathered = mesh.world.gather_object(RankReport(mesh.coords, [], times, generate_s,
                                                   held=held_bytes(runner.model)))
    if rounds.stopped:
        done = len(job.writer.done) if job.writer is not None else 0
        raise Stopped(f"stopped by {rounds.stopped} after the batch round in flight: {done} of {len(job.prompts)} "
                      f"prompts committed to {config.generate.output}; run the same command again to resume "
                      f"(exit code {EXIT_STOPPED})")
    if mesh.world.rank == 0:
        write_outputs(job, runner.model.arch, mesh, gathered, load_s, time.perf_counter() - t_start, threads)


def _run_embed(world, config, ranks_per_node: int, t_start: float, restart: bool, stop: StopFlag) -> None:
    """An embedding job: an encoder over tp x dp ranks; rank 0 writes the HDF5 file batch by batch."""
    rank = world.Get_rank()
    job = agree(world, lambda: prepare_embed_job(config, world.Get_size(), rank))
    writer = agree(world, lambda: open_writer(job, restart) if rank == 0 else None)     # resume or refuse here
    mesh, threads, ops, groups, _ = _compute_setup(world, config, 1, ranks_per_node)
    t0 = time.perf_counter()
    with job.ckpt as ckpt:
        model = Encoder(ops, groups, ckpt.arch, config.model.dtype).load(ckpt, quantize=job.load_quant)
    load_s = time.perf_counter() - t0
    e = config.embed
    t0 = time.perf_counter()
    try:
        stats = run_rounds(world, mesh, model, job, writer, stop)
        if writer is not None and not stats.stopped:
            writer.finish()
    finally:
        if writer is not None:
            writer.close()
    embed_s = time.perf_counter() - t0
    if stats.stopped:
        raise Stopped(f"stopped by {stats.stopped} after the batch round in flight; the rows written so far are in "
                      f"{e.output}.partial: run the same command again to resume (exit code {EXIT_STOPPED})")
    reports = world.gather((mesh.coords, stats))
    if rank == 0:
        metrics = embed_metrics(job, mesh, reports, load_s, embed_s, time.perf_counter() - t_start, threads)
        print(f"hpcinfer: {metrics['embedded_inputs']} inputs ({metrics['tokens']} tokens, "
              f"{metrics['truncated_inputs']} truncated) embedded in {embed_s:.2f} s; embeddings in {e.output}",
              flush=True)
        if e.metrics:
            write_metrics(e.metrics, metrics)
            print(f"hpcinfer: metrics in {e.metrics}", flush=True)


def _compute_setup(world, config, pp: int, ranks_per_node: int):
    """The mesh (printed by rank 0), BLAS threads, the backend on this rank's GPU (node-local rank) and the
    communicator groups for its arrays -> (mesh, threads, ops, groups, comm: "nccl" or "mpi")."""
    mesh = build_mesh(world, config.parallel.tp, pp, ranks_per_node, config.runtime.comm_timeout)
    threads = _set_threads(config, world)
    _print_mesh(world, mesh, threads)
    ops = agree(world, lambda: make_ops(config.runtime.backend, device=mesh.local_rank, threads=threads,
                                        cpu_kernels=config.runtime.cpu_kernels, kv_dtype=gpu_kv_dtype(config)))
    _print_kernels(world, ops)
    comm = agree(world, lambda: resolve_comm(config.runtime.comm, ops, world))
    agree(world, lambda: check_graphs_comm(config, comm))         # [runtime] cuda_graphs with tp over MPI
    return mesh, threads, ops, _groups(config, mesh, device_group_factory(comm, ops)), comm


def _groups(config, mesh, wrap) -> Groups:
    """The mesh's MPI groups, each wrapped by `wrap` (NCCL or host-staged groups for device arrays; identity for
    numpy). Every rank wraps the same groups in the same order: building an NCCL communicator is collective."""
    par = config.parallel
    moe = MoELayout(par.ep, par.expert_tp, config.moe.all_to_all, mesh.node_size_in(mesh.stage_members()),
                    mesh.node_size_in(mesh.dp_members()), config.moe.dispatch)
    return Groups(tp=wrap(mesh.tp), pp=wrap(mesh.pp), stage=wrap(mesh.stage), dp=wrap(mesh.dp), moe=moe)


def weight_source(config, ops, rank: int, mesh=None, comm: str = "mpi"):
    """The Decoder's `weights`: when [offload] is active (docs/offload.md), blocks -> the offload tiers of this
    rank's layers; None otherwise. comm: the resolved [runtime] comm (with "nccl", partitioned fetch gathers on the
    devices). Partitioned fetch splits the world when the tiers are made (collective: every rank builds its model)."""
    if not config.offload.active:
        return None
    return lambda blocks: _tiers_of(config, blocks, ops, rank, mesh, comm)


def _weight_tiers(config, model, ops, rank: int, mesh=None, comm: str = "mpi"):
    """The offload tiers of a model's blocks, when [offload] is active (tests attach them to a model built
    without them, as `model.weights`: nothing else may); None otherwise. A model built as `hpcinfer run` builds it
    takes weight_source's value instead (generate/runner.Runner.load)."""
    source = weight_source(config, ops, rank, mesh, comm)
    return source(model.blocks) if source is not None else None


def _tiers_of(config, blocks, ops, rank: int, mesh, comm: str):
    off = config.offload
    tiers = place_layers(len(blocks), off.weights_gpu, off.weights_cpu)
    disk_dir = os.path.join(off.disk_dir, f"rank{rank:05d}") if off.disk_dir else None
    nccl = comm == "nccl"
    group, threads_ok = _fetch_group(mesh, nccl) if off.partitioned_fetch and mesh is not None else (None, True)
    return WeightTiers(ops, blocks, tiers, disk_dir, off.prefetch_layers, group, threads_ok,
                       gather_on_device=group is not None and nccl)


def _fetch_group(mesh, nccl: bool = False):
    """The data-parallel replicas of this rank's (stage, tp rank) on its node: they share each layer fetch
    (partitioned fetch, offload/partition.py). Collective over the world. With `nccl`, an NcclGroup: the parts
    are all-gathered between the GPUs (each copies only its part in). Without it an MPIGroup gathering in host
    memory, also under comm = "mpi" with cupy: a host-staged device group would move more bytes over PCIe than
    one copy of the gathered layer. MPI rounds run on a prefetch thread when MPI allows calls from several threads
    at once (the second value). NCCL rounds run on the main thread, in program order (their part uploads are
    prefetched; offload/tiers.py says why)."""
    from mpi4py import MPI

    pp_i, dp_i, tp_i = mesh.coords
    color = (mesh.node * mesh.shape.pp + pp_i) * mesh.shape.tp + tp_i
    world = mesh.world.comm
    comm = world.Split(color=color, key=dp_i)
    members = comm.Get_group().Translate_ranks(list(range(comm.Get_size())), world.Get_group())
    watch = mesh.world.watch                              # the mesh's watchdog deadline and arrivals
    group = MPIGroup(comm, "offload fetch", watch.timeout, members, watch.arrivals)
    if nccl:
        return NcclGroup(group), False
    return group, MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def _print_kernels(world, ops) -> None:
    """Rank 0's console: the compiled CPU kernels' cold start (backend/cpu_kernels/compiled.py), on cupy CPU
    attention delegation's. stdout, as the mesh: stderr carries only warnings and errors."""
    warm_up = getattr(getattr(ops, "host_ops", ops), "kernel_warm_up", None)
    if world.Get_rank() == 0 and warm_up is not None:
        print(f"hpcinfer: cpu kernels (numba) {warm_up.describe()}", flush=True)


def _print_mesh(world, mesh, threads: int) -> None:
    descriptions = world.gather(mesh.describe())
    if world.Get_rank() == 0:
        print(f"hpcinfer: {world.Get_size()} ranks on {world.Get_size() // mesh.ranks_per_node} node(s), mesh "
              f"pp={mesh.shape.pp} dp={mesh.shape.dp} tp={mesh.shape.tp}, {threads} BLAS thread(s) per rank",
              flush=True)
        for line in descriptions:
            print(f"  {line}", flush=True)
