"""One data-parallel replica's share of a generation job (docs/scheduling.md): which prompts it runs, its KV store,
the scheduler's policy, and the points where its finished results are committed to rank 0
(generate/rounds.BatchRounds.end, a world collective). The scheduler itself is generate/schedules/continuous.py;
job.generate_share calls `run_share` for every job but [offload]'s.
"""

from __future__ import annotations

import os

import numpy as np

from .engine import StepTimes
from .graphs import paged_decode_graphs
from .kv_cache import KVOffload
from .paged_cache import block_bytes, pool_blocks
from .runner import Runner
from .schedules.continuous import ContinuousParams, balanced_shares, run_sequences


def run_share(runner: Runner, job, mesh, times: StepTimes, end_round=None, lockstep=None, link=None) -> list:
    """This replica's share of the prompts not yet done, through the scheduler under the job's policy
    (`[schedule] batching`, job.batching_mode): continuous, or static (a batch enters when the running set is
    empty). Results are committed at as many points as the static schedule has rounds (the same on every replica:
    end_round is a world collective): the k-th when this replica has finished k/K of its share (with lockstep, the
    MoE replicas stepping together: when every replica has). Without end_round they are returned. With pp > 1
    (`link`) the first stage decides and the commit points travel down the pipeline
    (schedules/continuous_stages.py); the results are the last stage's.

    batch_size is the running-set limit of a step: each replica's, or with lockstep (MoE replicas, whose steps
    are one step over all of them) the replicas' together, each running batch_size / dp."""
    config, model, g = job.config, runner.model, job.config.generate
    static = times.batching == "static"
    todo = [i for i in range(len(job.prompts)) if i not in job.skip]
    mine, groups = _share(todo, job, mesh, model, lockstep is not None, static)
    if lockstep is not None:             # the same on every replica: their steps (and collectives) pair up
        running = -(-g.batch_size // mesh.shape.dp) if static else max(1, g.batch_size // mesh.shape.dp)
    else:
        running = max(groups, default=1) if static else g.batch_size
    capacity = {i: min(len(job.prompts[i].tokens) + g.max_new_tokens, model.arch.max_positions) for i in todo}
    params = scheduler_params(config, mesh, model, running, static, link is not None)
    cache = _kv_store(runner, config, mesh, max(1, min(running, len(mine))),
                      max((capacity[i] for i in mine), default=1),
                      max(params.step_sequences, params.prompt_step_sequences))
    per_round = g.batch_size if lockstep is not None else mesh.shape.dp * g.batch_size
    points = max(1, -(-len(todo) // per_round))                                # the static schedule's rounds
    commits = CommitPoints(mine, points, _announced(end_round, link), lockstep)
    graphs = paged_decode_graphs(runner, cache, config.runtime.cuda_graphs)
    try:
        served = run_sequences(runner, runner.sequences([job.prompts[i].tokens for i in mine], mine), times, params,
                               cache, commits.after_step, lambda i: f"prompt {job.prompts[i].id!r} (line {i + 1} "
                               f"of {g.prompts})", lockstep, graphs, link, end_round, groups, finish=commits.finish)
    finally:
        if graphs is not None:
            graphs.close()                              # the graphs' private memory pool
    cache.report(times)
    return commits.results + served


def _share(todo: list, job, mesh, model, lockstep: bool, static: bool) -> tuple[list, list]:
    """(this replica's prompt indices, and under the static policy the sizes of the batches they enter in).
    Continuous: balanced over the replicas by predicted positions. Static: batches of batch_size in input order,
    dealt to the replicas in turn; with lockstep every replica takes its slice of every batch (so that the steps
    over all of them hold the batch, as on one replica)."""
    g, dp = job.config.generate, mesh.shape.dp
    _, dp_index, _ = mesh.coords
    if not static:
        capacity = [min(len(job.prompts[i].tokens) + g.max_new_tokens, model.arch.max_positions) for i in todo]
        return [todo[k] for k in balanced_shares(capacity, dp)[dp_index]], []
    batches = [todo[a:a + g.batch_size] for a in range(0, len(todo), g.batch_size)]
    if lockstep:
        mine = [[int(i) for i in np.array_split(batch, dp)[dp_index]] for batch in batches]
    else:
        mine = batches[dp_index::dp]
    return [i for batch in mine for i in batch], [len(batch) for batch in mine]


def scheduler_params(config, mesh, model, running: int, static: bool, pipelined: bool) -> ContinuousParams:
    """The scheduler's policy for this job: `running` sequences at most; with pp > 1 gen_micro_batches (default
    pp) steps in flight (static: the prompts in prompt_micro_batches steps, default pp)."""
    sch, g, pp = config.schedule, config.generate, mesh.shape.pp
    micro_batches = min((sch.gen_micro_batches or pp) if pipelined else 1, running)
    if static:
        prompt_micro_batches = min((sch.prompt_micro_batches or pp) if pipelined else 1, running)
        return ContinuousParams.static_policy(running, micro_batches, prompt_micro_batches)
    exact = model.kv_format is not None or 0 < g.attention_topk < 1       # step-dependent arithmetic: as static
    return ContinuousParams(running, sch.step_tokens(running), micro_batches, exact)


def _kv_store(runner, config, mesh, running: int, longest: int, largest_step: int):
    """This rank's KV store (Runner.kv_store): a pool of `[schedule] kv_cache_memory` over the bytes of a block of
    its layers, or `running` sequences (batch_size, or fewer when the share has fewer prompts) at their longest;
    with pp > 1 every stage takes the smallest stage's block count (the first stage's block tables index every
    stage's pool). With `[schedule] kv_offload_threshold` the layers of this rank's parity (node-local rank % 2)
    move idle sequences' rows to host memory."""
    sch = config.schedule
    blocks = kv_pool_blocks(runner.model, sch, running, longest, mesh.ranks_per_node)
    if mesh.shape.pp > 1:
        blocks = int(mesh.pp.all_gather(np.array([blocks], dtype=np.int64)).min())
    offload = KVOffload(sch.kv_offload_bytes, mesh.local_rank % 2) if sch.kv_offload_bytes else None
    return runner.kv_store(blocks, sch.kv_block_size, running, longest, offload, largest_step)


def kv_pool_blocks(model, schedule, running: int, longest: int, ranks_per_node: int = 1) -> int:
    """Blocks of this rank's pool: `[schedule] kv_cache_memory` (`schedule`, a config.ScheduleSection) over the
    bytes of a block of its layers, or `running` sequences at their `longest` when it is 0."""
    per_block = block_bytes(model.num_local_layers, model.kv_heads_local, schedule.kv_block_size, model.arch.head_dim,
                            model.kv_format)
    nbytes = schedule.kv_memory_bytes(lambda: free_bytes(model.ops, ranks_per_node))
    return max(1, pool_blocks(nbytes, per_block, running, longest, schedule.kv_block_size))


def _announced(end_round, link):
    """end_round as the first stage calls it: with pp > 1 the commit point goes down the pipeline first, so the
    later stages enter end_round's collectives after the same steps."""
    if end_round is None or link is None:
        return end_round

    def announced(results: list) -> bool:
        link.send_to_next_stage({"commit": True})
        return end_round(results)
    return announced


class CommitPoints:
    """The continuous schedule's commit points: after_step(finished) hands results to end_round at the k-th of
    `points` thresholds of this replica's share (every replica calls end_round `points` times, the last when its
    share is done or the job stops); True once end_round says stop. With `lockstep` (MoE replicas stepping
    together, whose steps hold collectives of their own) a point passes when every replica has reached it, agreed
    at every step, so that end_round's collectives come at the same step on every replica."""

    def __init__(self, share: list, points: int, end_round=None, lockstep=None):
        self.thresholds = [-(-k * len(share) // points) for k in range(1, points + 1)]
        self.end_round, self.lockstep, self.pending, self.results, self.done = end_round, lockstep, [], [], 0
        self.stopped = False

    def after_step(self, finished: list) -> bool:
        self.pending += [(s.index, s.generated, s.finish_reason) for s in finished]
        self.done += len(finished)
        reached = sum(1 for t in self.thresholds if self.done >= t)
        if self.lockstep is not None:
            reached = int(self.lockstep.all_gather(np.array([reached], dtype=np.int64)).min())
        for _ in range(reached):
            if self.stopped:
                break
            self.thresholds.pop(0)
            self._commit()
        return self.stopped

    def finish(self) -> None:
        """The share is done (or the job stops): the remaining points, so every replica calls end_round alike."""
        while self.thresholds and not self.stopped:
            self.thresholds.pop(0)
            self._commit()

    def _commit(self) -> None:
        if self.end_round is None:
            self.results += self.pending
        else:
            self.stopped = bool(self.end_round(self.pending))
        self.pending = []


def free_bytes(ops, ranks_per_node: int) -> int:
    """Memory left for this rank's KV pool after the weights: its GPU's free memory (cupy), or the host's
    available memory shared by the node's ranks (numpy)."""
    if ops.name == "cupy":
        return int(ops.xp.cuda.runtime.memGetInfo()[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, ranks_per_node)
