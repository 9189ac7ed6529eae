"""A generation job: the set-up checks (before any weight is read), this rank's share of the batches, and the
outputs rank 0 writes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .backend.ops import make_ops
from .comm.mesh import MeshShape
from .preflight import check_quantization, check_writable, open_model_source
from .config import batching_mode
from .errors import ConfigError
from .generate.commit import ResultWriter, generation_fingerprint
from .generate.engine import ScheduleParams, StepTimes
from .generate.graphs import check_model as check_graphs
from .generate.kv_cache import KVOffload, plan_offload
from .generate.output import write_metrics
from .generate.prompts import load_prompts
from .generate.resume import SIDECAR_SUFFIX
from .generate.runner import Runner
from .generate.replica import run_share
from .generate.schedules import run_block
from .generate.tokenizer import TextTokenizer
from .metrics import peak_rss_bytes, summarize
from .offload.budget import check_budgets, kv_format_of, predicted_vs_measured
from .offload.partition import fetch_share
from .offload.profile import resolve_profile
from .quant.storage import quant_of
from .parallel.layout import check_experts, check_tensor_parallel
from .parallel.stages import partition_layers


@dataclass
class Job:
    config: object
    ckpt: object
    tokenizer: object
    prompts: list
    stages: list                 # StageSpec per pipeline stage
    writer: object = None        # rank 0: generate/commit.ResultWriter (resumes, commits each batch round)
    skip: set = field(default_factory=set)    # prompt indices an earlier run committed (every rank, from rank 0)
    quant_of: object = None      # tensor name -> (mode, group) when held quantized (quant.storage.quant_of)
    load_quant: object = None    # what the model load quantizes (`[model] quantize`: quant.storage.load_quant)


@dataclass
class RankReport:
    """What every rank sends to rank 0 at the end."""
    coords: tuple                # (pp, dp, tp) index
    results: list                # [(prompt index, generated ids, finish_reason)] (last stage, tp rank 0 only)
    times: StepTimes
    generate_s: float
    peak_rss_bytes: int = field(default_factory=peak_rss_bytes)   # this rank's host memory peak, when built
    held: dict | None = None     # metrics.held_bytes(model): weights as held (quantized at their size), scratch


def prepare_job(config, world_size: int, rank: int, ranks_per_node: int, restart: bool = False) -> Job:
    """Everything that can be wrong with the inputs, checked on every rank before any weight is read."""
    ops = make_ops(config.runtime.backend)
    ckpt = open_model_source(config.model)
    try:
        if ckpt.arch.is_encoder:                          # BERT-family checkpoints embed, they do not generate
            raise ConfigError(f"{config.path}: [generate] needs a decoder checkpoint; {config.model.checkpoint} is "
                              f"a {ckpt.arch.family} encoder: use an [embed] job (docs/embed.md)")
        load_quant = check_quantization(config, ckpt, ops)
        par = config.parallel
        check_tensor_parallel(ckpt.arch, par.tp, config.path)
        stages = partition_layers(ckpt.arch, par.pp, config.path)
        MeshShape.for_world(world_size, par.tp, par.pp).check_nodes(ranks_per_node)
        check_experts(ckpt.arch, par.tp, par.pp, par.ep, par.expert_tp, world_size, config.path)
        check_graphs(config, ckpt.arch, ops)
        if config.model.verify:              # each tensor's CRC-32, spread over the ranks (checkpoint/integrity.py)
            ckpt.verify(rank, world_size)
        tokenizer = TextTokenizer.from_checkpoint(ckpt)
        prompts = load_prompts(config.generate.prompts, ckpt.arch, tokenizer)
        _check_kv_offload(config, ckpt.arch, stages, prompts, world_size, ranks_per_node)
        quantized = quant_of(ckpt, load_quant) if config.offload.active else None      # what the tiers move quantized
        if config.offload.active:
            check_budgets(ckpt.arch, config, stages, [len(p.tokens) for p in prompts], quantized,
                          _fetch_share(config, world_size, ranks_per_node))
            if ckpt.arch.moe_experts and world_size // (par.tp * par.pp) > 1:
                raise ConfigError(f"{config.path}: [offload] with an MoE model needs dp = 1: data-parallel "
                                  f"replicas exchange tokens in every MoE layer and the offload schedules do not "
                                  f"step them together; use tp, ep and expert_tp over all ranks instead")
        if config.offload.profile is not None:
            resolve_profile(config.offload.profile)
        if config.offload.active and config.offload.disk_dir and config.offload.weights_gpu + \
                config.offload.weights_cpu < 100:           # every rank writes its layers there
            check_writable(os.path.join(config.offload.disk_dir, "rank"), "[offload] disk_dir")
        writer = _open_results(config, prompts, tokenizer, restart) if rank == 0 else None
    except Exception:
        ckpt.close()
        raise
    return Job(config, ckpt, tokenizer, prompts, stages, writer, quant_of=quantized, load_quant=load_quant)


def _open_results(config, prompts, tokenizer, restart: bool):
    """Rank 0: the output and metrics are writable files distinct from the inputs, and an earlier run's output
    is resumed when its fingerprint matches (a changed job is refused unless `restart`)."""
    g = config.generate
    check_writable(g.output, "[generate] output")
    if g.metrics:
        check_writable(g.metrics, "[generate] metrics")
    paths = {"[generate] prompts": g.prompts, "[model] checkpoint": config.model.checkpoint,
             "[generate] metrics": g.metrics, "[generate] output": g.output,
             "the output's resume state": g.output + SIDECAR_SUFFIX}
    seen = {}
    for key, path in paths.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"{config.path}: {key} and {seen[real]} are the same file '{path}'; the job would "
                              f"overwrite it")
        seen[real] = key
    return ResultWriter(g.output, prompts, tokenizer, generation_fingerprint(config), restart)


def _fetch_share(config, world_size: int, ranks_per_node: int) -> int:
    """Replicas of a partitioned fetch group ([offload] partitioned_fetch): the dp ranks of one node that hold the
    same tp shard (runtime._fetch_group); 1 without it."""
    par = config.parallel
    if not config.offload.partitioned_fetch:
        return 1
    return fetch_share(world_size // (par.tp * par.pp), par.tp, ranks_per_node)


def _batches(n_prompts: int, batch_size: int) -> list[range]:
    return [range(a, min(a + batch_size, n_prompts)) for a in range(0, n_prompts, batch_size)]


def _check_kv_offload(config, arch, stages, prompts, world_size: int, ranks_per_node: int) -> None:
    """The KV offload threshold must hold a step's sequences on every rank: its stage, with the layer parity it
    offloads (node-local rank % 2), with batch_size slots of the longest sequence (the static policy's store,
    generate/replica._kv_store; a step holds batch_size / min(prompt, gen micro-batches) of them)."""
    sch, g, par = config.schedule, config.generate, config.parallel
    if not sch.kv_offload_bytes:
        return
    shape = MeshShape.for_world(world_size, par.tp, par.pp)
    placements = {(shape.coords(r)[0], r % ranks_per_node % 2) for r in range(world_size)}
    slots = min(g.batch_size, len(prompts))
    split = min(sch.prompt_micro_batches or par.pp, sch.gen_micro_batches or par.pp, slots) if par.pp > 1 else 1
    max_len = max(min(len(p.tokens) + g.max_new_tokens, arch.max_positions) for p in prompts)
    for stage_index, parity in sorted(placements):
        stage = stages[stage_index]
        plan_offload(len(stage.layers), stage.first_layer, slots, arch.num_kv_heads // par.tp, max_len,
                     arch.head_dim, KVOffload(sch.kv_offload_bytes, parity), -(-slots // split),
                     kv_format_of(config, arch))


def generate_share(runner: Runner, job: Job, mesh, link, end_round=None) -> tuple[StepTimes, list]:
    """This data-parallel replica's share of the prompts: through the scheduler (generate/replica.run_share), or
    with `[offload]` in blocks of batch_size prompts, round by round (round k holds the next dp blocks not yet done,
    replica d takes the d-th), each through the offload schedule (zig-zag or rows, schedules.run_block).

    end_round(results) -> bool runs on every rank at each commit point (generate/rounds.py: commit, stop flag);
    True stops. Without it, the results are collected and returned."""
    model, g = runner.model, job.config.generate
    times = StepTimes(batching=batching_mode(job.config))
    lockstep = mesh.dp if model.arch.moe_experts and mesh.shape.dp > 1 else None   # experts cross the replicas
    if not job.config.offload.active:
        results = run_share(runner, job, mesh, times, end_round, lockstep, link)
    else:
        results = []
        dp_index, dp = mesh.coords[1], mesh.shape.dp
        todo = [b for b in _batches(len(job.prompts), g.batch_size) if not set(b) <= job.skip]
        for first in range(0, len(todo), dp):
            mine = todo[first:first + dp]
            block = list(mine[dp_index]) if dp_index < len(mine) else []
            outputs = run_block(runner, [job.prompts[i].tokens for i in block], block, times, ScheduleParams(),
                                job.config.offload) if block else []
            block_results = [(i, tokens, reason) for i, (tokens, reason) in zip(block, outputs or [])]
            if end_round is None:
                results += block_results
            elif end_round(block_results):
                break
    runner.close()
    if model.weights is not None:
        times.weights_peak_device_bytes = model.weights.peak_bytes
        times.weights_bytes_from_host = model.weights.bytes_from_host
        times.weights_bytes_from_disk = model.weights.bytes_from_disk
        model.weights.close()
    return times, results


def write_outputs(job: Job, arch, mesh, reports: list, load_s: float, total_s: float, threads: int) -> None:
    """Rank 0, at the end of a job that was not stopped: the output in input order (every batch was committed
    by job.writer as it finished), the summary and the metrics; the answers on the console too with
    `[generate] echo` (a batch job of thousands of prompts would flood its log with them)."""
    job.writer.commit([r for report in reports for r in report.results])     # (empty when rounds committed)
    records = job.writer.finish()
    if job.config.generate.echo:
        for record in records:
            answer = record.get("text", " ".join(map(str, record["output_tokens"])))
            print(f"[{record['id']}] {answer!r} ({record['finish_reason']})", flush=True)
    metrics = summarize(job.config, arch, mesh, reports, load_s, total_s, threads)
    if job.config.offload.active:
        blocks = -(-len(job.prompts) // job.config.generate.batch_size) / mesh.shape.dp
        report = predicted_vs_measured(arch, job.config, [len(p.tokens) for p in job.prompts], blocks,
                                       metrics["generate_s"], job.quant_of)
        if report is not None:
            metrics["offload"].update(report)
            print(f"hpcinfer: offload: measured {report['measured_s']:.3g} s, cost model predicted "
                  f"{report['predicted_s']:.3g} s on profile {report['profile']}", flush=True)
        else:
            print("hpcinfer: offload: no cost-model prediction to compare (set [offload] profile to a preset or "
                  "to a file from `hpcinfer profile --out FILE`)", flush=True)
    resumed = f" ({len(job.skip)} of them done by an earlier run)" if job.skip else ""
    print(f"hpcinfer: {metrics['generated_tokens']} tokens generated for {len(records)} prompts{resumed} in "
          f"{metrics['generate_s']:.2f} s ({metrics['tokens_per_s']:.1f} tokens/s); results in "
          f"{job.config.generate.output}", flush=True)
    if mesh.shape.pp > 1:
        stages = ", ".join(f"stage {s['stage']} busy {s['busy_s']:.2f} s, bubble {s['bubble_fraction']:.0%}"
                           for s in metrics["pipeline"]["stages"])
        print(f"hpcinfer: pipeline: {stages}", flush=True)
    if job.config.generate.metrics:
        write_metrics(job.config.generate.metrics, metrics)
        print(f"hpcinfer: metrics in {job.config.generate.metrics}", flush=True)
