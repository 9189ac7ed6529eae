"""`hpcinfer run`: init MPI, validate everything, build the mesh, backend and model, run the job, write outputs.

Failure discipline (no rank is ever left waiting):
- set-up steps run on every rank and then *agree*: an allgather of the error messages, so a problem found on any
  rank (bad config, checkpoint, prompts) is reported once by rank 0 and every rank exits 2, before any weight is read;
- any error after set-up (or a bug anywhere) prints the failing rank's message and aborts the whole job.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

import numpy as np

from .backend.ops import make_ops
from .checkpoint.format import open_checkpoint
from .comm.group import Groups
from .comm.mesh import MeshShape, build_mesh
from .config import load_config
from .errors import HpcinferError
from .generate.engine import GenerationParams, StepTimes, generate_batch
from .generate.output import result_record, write_metrics, write_results
from .generate.prompts import load_prompts
from .generate.sampling import SamplingParams
from .generate.tokenizer import TextTokenizer
from .metrics import summarize
from .model.transformer import Decoder
from .parallel.layout import check_tensor_parallel


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


@dataclasses.dataclass
class Job:
    config: object
    ckpt: object
    tokenizer: object
    prompts: list


def _prepare(config, world_size: int, rank: int) -> Job:
    """Everything that can be wrong with the inputs, checked before any weight is read."""
    make_ops(config.runtime.backend)
    ckpt = open_checkpoint(config.model.checkpoint)
    try:
        check_tensor_parallel(ckpt.arch, config.parallel.tp, config.path)
        MeshShape.for_world(world_size, config.parallel.tp, config.parallel.pp)
        tokenizer = TextTokenizer.from_checkpoint(ckpt)
        prompts = load_prompts(config.generate.prompts, ckpt.arch, tokenizer)
        if rank == 0:
            _check_writable(config.generate.output, "[generate] output")
            if config.generate.metrics:
                _check_writable(config.generate.metrics, "[generate] metrics")
    except Exception:
        ckpt.close()
        raise
    return Job(config, ckpt, tokenizer, prompts)


def _check_writable(path: str, key: str) -> None:
    from .errors import ConfigError

    if os.path.isdir(path):
        raise ConfigError(f"{key} = '{path}' is a directory; give a file path")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key} = '{path}': cannot create directory '{directory}' ({exc.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"{key} = '{path}': directory '{directory}' is not writable")


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
    job = agree(world, lambda: _prepare(config, world.Get_size(), rank))
    mesh = build_mesh(world, config.parallel.tp, config.parallel.pp)
    threads = _set_threads(config, world)
    descriptions = world.gather(mesh.describe())
    if rank == 0:
        print(f"hpcinfer: {world.Get_size()} ranks, mesh pp={mesh.shape.pp} dp={mesh.shape.dp} "
              f"tp={mesh.shape.tp}, {threads} BLAS thread(s) per rank", flush=True)
        for line in descriptions:
            print(f"  {line}", flush=True)

    t0 = time.perf_counter()
    with job.ckpt as ckpt:
        model = Decoder(make_ops(config.runtime.backend), Groups(tp=mesh.tp), ckpt.arch, config.model.dtype)
        model.load(ckpt)
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    times, local = _generate_share(model, job, mesh)
    generate_s = time.perf_counter() - t0

    is_writer = mesh.tp.rank == 0                               # one copy of each replica's results
    gathered = world.gather((local if is_writer else [], times if is_writer else None, generate_s))
    if rank == 0:
        _write_outputs(job, model, mesh, gathered, load_s, time.perf_counter() - t_start, threads)


def _generate_share(model, job: Job, mesh):
    """This data-parallel replica's batches (batch b goes to replica b mod dp)."""
    g = job.config.generate
    params = GenerationParams(g.max_new_tokens, SamplingParams(g.temperature, g.top_k, g.top_p), g.seed,
                              g.ignore_eos)
    _, dp_index, _ = mesh.coords
    times, results = StepTimes(), []
    for b, start in enumerate(range(0, len(job.prompts), g.batch_size)):
        if b % mesh.shape.dp != dp_index:
            continue
        indices = list(range(start, min(start + g.batch_size, len(job.prompts))))
        outputs = generate_batch(model, [job.prompts[i].tokens for i in indices], indices, params, times)
        results += [(i, tokens, reason) for i, (tokens, reason) in zip(indices, outputs)]
    return times, results


def _write_outputs(job: Job, model, mesh, gathered, load_s: float, total_s: float, threads: int) -> None:
    results = sorted((r for local, _, _ in gathered for r in local), key=lambda r: r[0])
    assert [r[0] for r in results] == list(range(len(job.prompts))), "every prompt is answered exactly once"
    records = [result_record(job.prompts[i].id, tokens, reason, job.tokenizer) for i, tokens, reason in results]
    write_results(job.config.generate.output, records)
    for record in records:
        answer = record.get("text", " ".join(map(str, record["output_tokens"])))
        print(f"[{record['id']}] {answer!r} ({record['finish_reason']})", flush=True)
    replica_times = [t for _, t, _ in gathered if t is not None]
    metrics = summarize(job.config, model, mesh, replica_times, max(s for _, _, s in gathered), load_s, total_s,
                        threads)
    print(f"hpcinfer: {metrics['generated_tokens']} tokens generated for {len(records)} prompts in "
          f"{metrics['generate_s']:.2f} s ({metrics['tokens_per_s']:.1f} tokens/s); results in "
          f"{job.config.generate.output}", flush=True)
    if job.config.generate.metrics:
        write_metrics(job.config.generate.metrics, metrics)
        print(f"hpcinfer: metrics in {job.config.generate.metrics}", flush=True)
