"""One data-parallel replica's share of a generation job under continuous batching (docs/scheduling.md): which
prompts it runs (balanced over the replicas by predicted positions), its paged KV pool, and the points where its
finished results are committed to rank 0 (generate/rounds.BatchRounds.end, a world collective). The schedule itself
is generate/schedules/continuous.py; job.generate_share calls `continuous_share` when `[schedule] batching` resolves
to continuous.
"""

from __future__ import annotations

import os

import numpy as np

from .engine import StepTimes
from .graphs import paged_decode_graphs
from .paged_cache import PagedKVCache, block_bytes, pool_blocks
from .runner import Runner
from .slot_cache import SlotKVCache
from .schedules.continuous import ContinuousParams, balanced_shares, run_continuous


def continuous_share(runner: Runner, job, mesh, times: StepTimes, end_round=None, lockstep=None, link=None) -> list:
    """This replica's share of the prompts not yet done (balanced by predicted positions over the dp replicas),
    batched continuously over a paged KV cache (generate/schedules/continuous.py). Results are committed at as many
    points as the static schedule has rounds (the same on every replica: end_round is a world collective): the
    k-th when this replica has finished k/K of its share (with lockstep, the MoE replicas stepping together: when
    every replica has). Without end_round they are returned. With lockstep, as in the static schedule, batch_size
    is the sequences of all the replicas together: each runs batch_size / dp. With pp > 1 (`link`) the first stage
    decides and the commit points travel down the pipeline (schedules/continuous_stages.py); the results are the
    last stage's."""
    config, model, g = job.config, runner.model, job.config.generate
    running = max(1, g.batch_size // mesh.shape.dp) if lockstep is not None else g.batch_size
    todo = [i for i in range(len(job.prompts)) if i not in job.skip]
    _, dp_index, _ = mesh.coords
    capacity = [min(len(job.prompts[i].tokens) + g.max_new_tokens, model.arch.max_positions) for i in todo]
    mine = [todo[k] for k in balanced_shares(capacity, mesh.shape.dp)[dp_index]]
    cache = continuous_cache(model, config.schedule, max(1, min(running, len(mine))),
                             max((capacity[todo.index(i)] for i in mine), default=1), mesh)
    per_round = g.batch_size if lockstep is not None else mesh.shape.dp * g.batch_size
    points = max(1, -(-len(todo) // per_round))                                # the static schedule's rounds
    commits = CommitPoints(mine, points, _announced(end_round, link), lockstep)
    sch = config.schedule
    micro_batches = (sch.gen_micro_batches or mesh.shape.pp) if link is not None else 1
    exact = model.kv_format is not None or 0 < g.attention_topk < 1       # step-dependent arithmetic: as static
    params = ContinuousParams(running, sch.step_tokens(running), min(micro_batches, running), exact)
    graphs = paged_decode_graphs(runner, cache, config.runtime.cuda_graphs)
    try:
        served = run_continuous(runner, [job.prompts[i].tokens for i in mine], mine, times, params, cache,
                                commits.after_step, lambda i: f"prompt {job.prompts[i].id!r} (line {i + 1} of "
                                f"{g.prompts})", lockstep, graphs, link, end_round)
    finally:
        if graphs is not None:
            graphs.close()                              # the graphs' private memory pool
    if model.stage.is_first:
        commits.finish()
    times.kv_peak_device_bytes = max(times.kv_peak_device_bytes, cache.nbytes)     # the pool, allocated whole
    return commits.results + served


def continuous_cache(model, schedule, running: int, longest: int, mesh=None):
    """This rank's KV store for the continuous schedule: a pool of `[schedule] kv_cache_memory` (`schedule`, the
    config's ScheduleSection) over the bytes of a block of its layers, or `running` sequences (batch_size, or fewer
    when the share has fewer prompts) at their longest; with pp > 1 every stage takes the smallest stage's block
    count (the first stage's block tables index every stage's pool). Backends that read a dense cache fastest
    (Ops.continuous_kv = "slots": NumPy) keep the pool as accounting and the rows in `running` dense slots of
    `longest` positions (generate/slot_cache.py). mesh None: one process (api.generate)."""
    per_block = block_bytes(model.num_local_layers, model.kv_heads_local, schedule.kv_block_size, model.arch.head_dim,
                            model.kv_format)
    nbytes = schedule.kv_memory_bytes(lambda: free_bytes(model.ops, mesh.ranks_per_node if mesh else 1))
    blocks = max(1, pool_blocks(nbytes, per_block, running, longest, schedule.kv_block_size))
    if mesh is not None and mesh.shape.pp > 1:
        blocks = int(mesh.pp.all_gather(np.array([blocks], dtype=np.int64)).min())
    shape = (model.ops, model.num_local_layers, blocks, model.kv_heads_local, schedule.kv_block_size,
             model.arch.head_dim)
    if getattr(model.ops, "continuous_kv", "blocks") == "slots":
        return SlotKVCache(*shape, running, longest, model.kv_format)
    return PagedKVCache(*shape, model.kv_format)


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
