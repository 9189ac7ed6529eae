"""CUDA graphs in the decode schedule (`[runtime] cuda_graphs`; docs/gpu.md, Options).

The decode steps over a paged KV store (generate/paged_cache.PagedKVCache, the CuPy store of every schedule but
the KV offload threshold's) run through `PagedDecodeGraphs` (`paged_decode_graphs`; backend/cupy_graphs.DecodeGraph
captures and replays): a decode step of S sequences is padded to batch_bucket(S) rows (the
next power of two: cupy_graphs.batch_bucket says why), each padding row feeding token 0 at position 0 of the
cache's spare block (a block past the pool's, never in a table: its K and V land there and nothing reads them), and
its block tables, lengths and positions go into the graph's device buffers (a PagedDeviceStep: tables as wide as
the KV bucket's blocks), so the graph is keyed by (padded rows, KV bucket) and replays for any running set of that
size; the padding rows' outputs are dropped. Prefill and mixed steps, and empty ones, stay eager. The output
(logits [S, V] on the last stage, activations [S, D] before it) is the graph's static buffer: the schedule copies
it to the host for sampling, or sends it to the next stage, before the next replay can overwrite it. The graphs
hold the addresses of the pool they captured, so they live as long as it (one pool per run, or per batch of
schedules/pipeline.generate_batch).

What a captured step cannot hold is stated here, in the three checks at the end, each run where its facts are
known (every rank, before any weight is read): `check_config` when the config is read (config.py), `check_model`
once the checkpoint is open (MoE layers; job.py), `check_comm` once `comm = "auto"` is resolved (a tp group over
MPI; runtime.py).
"""

from __future__ import annotations

import logging

import numpy as np

from ..backend.cupy_graphs import DecodeGraph, batch_bucket
from ..backend.interface import StepLayout
from ..errors import ConfigError

log = logging.getLogger("hpcinfer")

SMALLEST_BUCKET = 64             # positions a captured decode step reads at least (cupy_graphs.kv_bucket)


class PagedDecodeGraphs:
    """The captured decode steps of one stage over one paged KV store, keyed by (padded rows, KV bucket):
    `applies(layout)` says which steps, `__call__(layout, inputs)` runs one (for generate/runner.Runner.step) -> the
    stage's output for the step's S real rows (logits [S, V] on the last stage, activations [S, D] before it: a
    view of the graph's static buffer, read before the next step). `forward(cache, inputs, step)` computes the
    stage's share of a step (generate/runner.Runner.forward), eagerly or under capture."""

    def __init__(self, model, cache, forward):
        self.model, self.cache, self.forward = model, cache, forward
        self.graph = DecodeGraph(model.ops, SMALLEST_BUCKET)
        self.steps = 0                                    # decode steps run through here (replayed or eager)
        self.recorded = (0, 0, 0)                         # (captures, replays, eager steps) at the last `record`

    def applies(self, step) -> bool:
        """A paged decode step with at least one sequence (the pool is on the device)."""
        return step.is_paged and step.is_decode and step.num_seqs > 0

    def __call__(self, step, inputs: dict):
        self.steps += 1
        step.flat_slots()                       # a new token without a block is an error, as on the eager path
        rows = batch_bucket(step.num_seqs)
        padded = pad_step(step, rows, self.cache.spare_block)
        out = self.graph.run(lambda static, device_step: self.forward(self.cache, static, device_step),
                             {name: pad_rows(self.model.ops, value, rows) for name, value in inputs.items()},
                             padded, eager=(inputs, step))
        return out[:step.num_seqs]

    @property
    def captures(self) -> int:
        return self.graph.captures

    @property
    def replays(self) -> int:
        """Decode steps run from a captured graph (a key's first step included: captured, then launched)."""
        return self.steps - self.graph.eager_steps

    @property
    def eager_steps(self) -> int:
        """Decode steps of keys that call cuBLAS (never captured), run eagerly."""
        return self.graph.eager_steps

    def record(self, times) -> None:
        """Add the captures, replays and eager steps since the last call to a StepTimes (the metrics' cuda_graphs
        section)."""
        now = (self.captures, self.replays, self.eager_steps)
        times.graph_captures += now[0] - self.recorded[0]
        times.graph_replays += now[1] - self.recorded[1]
        times.graph_eager_steps += now[2] - self.recorded[2]
        self.recorded = now

    def close(self) -> None:
        """Drop the graphs and hand their private memory pool back to the device."""
        self.graph.close()


def pad_step(step: StepLayout, rows: int, spare_block: int) -> StepLayout:
    """A paged decode step of S sequences as one of `rows` >= S: each padding row writes its one new position
    (start 0) into `spare_block` (its table [spare, -1, ...]) and attends to that position alone."""
    S, width = step.tables.shape
    tables = np.full((rows, max(width, 1)), -1, dtype=np.int32)                    # [rows, B]
    tables[:S, :width] = step.tables
    tables[S:, 0] = spare_block
    starts = np.concatenate([step.starts, np.zeros(rows - S, dtype=np.int64)])
    return StepLayout.paged(tables, step.block_size, starts, np.ones(rows, dtype=np.int64))


def pad_rows(ops, value, rows: int):
    """A step input ([S] token ids, or [S, D] activations; host or device) with zero rows up to `rows` (padding
    rows feed token 0)."""
    xp = ops.xp if isinstance(value, ops.xp.ndarray) else np
    pad = xp.zeros((rows - value.shape[0], *value.shape[1:]), dtype=value.dtype)
    return xp.concatenate([value, pad])


def paged_decode_graphs(runner, cache, cuda_graphs: bool):
    """The continuous schedule's captured decode steps over a paged cache (generate/paged_cache.PagedKVCache), when
    `[runtime] cuda_graphs` is on and the backend is cupy; else None (every paged step runs eagerly). The schedule
    adds its counters to the run's StepTimes (PagedDecodeGraphs.record) and closes it when the run ends. A pool of
    quantized rows (`[model] kv_cache`) is not captured yet: its steps gather the blocks through indices made on
    the host (paged_attention.through_dense), which a graph would keep from its capture; they run eagerly (said
    once in the log)."""
    if not cuda_graphs or runner.model.ops.name != "cupy":
        return None
    if cache.kv_format is not None:
        log.warning("cuda_graphs: the continuous schedule's decode steps over the %s KV pool run eagerly (paged "
                    "graphs take float32 pools only)", cache.kv_format.mode)
        return None
    return PagedDecodeGraphs(runner.model, cache, runner.forward)


def check_config(config) -> None:
    """When the config is read: what a captured decode step cannot hold, as far as the config says (host MPI
    calls, host-side routing, streamed weights or KV). MoE layers are known once the checkpoint is open
    (check_model), `comm = "auto"` once resolved (check_comm)."""
    rt, par = config.runtime, config.parallel
    if not rt.cuda_graphs:
        return
    why = None
    if rt.backend == "numpy":
        why = "needs the cupy backend (graphs are CUDA's); use backend = \"cupy\" or \"auto\""
    elif config.generate is None:
        why = "applies to [generate] jobs (the decode step); an [embed] job has none"
    elif rt.comm == "mpi" and par.tp > 1:
        why = (f"with tp = {par.tp} needs comm = \"nccl\" or \"auto\": the tp collectives run inside the graph, "
               f"and MPI calls cannot be captured")
    elif config.offload.active:
        why = "cannot capture layers whose weights or KV are streamed: remove [offload] (or its active keys)"
    elif 0 < config.generate.attention_topk < 1:
        why = ("cannot capture top-k sparse attention (generate.attention_topk): each step takes its kept counts "
               "from the host; set attention_topk = 0")
    elif config.schedule.kv_offload_bytes:
        why = ("cannot capture layers whose KV moves to host memory: set schedule.kv_offload_threshold = 0 "
               "(off)")
    if why:
        raise ConfigError(f"{config.path}: runtime.cuda_graphs = true {why}; or set cuda_graphs = false")


def check_model(config, arch, ops) -> None:
    """Set-up check, once the checkpoint's architecture and the backend are known (every rank, before loading)."""
    if not config.runtime.cuda_graphs:
        return
    if any(arch.moe_experts):
        raise ConfigError(f"{config.path}: runtime.cuda_graphs = true cannot capture MoE layers (this {arch.family} "
                          f"model has {sum(1 for e in arch.moe_experts if e)}): their per-expert row counts go to "
                          f"the host every step; set cuda_graphs = false")
    if ops.name != "cupy":
        log.info("runtime.cuda_graphs = true is ignored: backend = \"%s\" resolved to %s (no GPU here)",
                 config.runtime.backend, ops.name)


def check_comm(config, comm: str) -> None:
    """Set-up check, once `[runtime] comm` is resolved: tp collectives inside a graph must be NCCL's."""
    if config.runtime.cuda_graphs and comm == "mpi" and config.parallel.tp > 1:
        raise ConfigError(f"{config.path}: runtime.cuda_graphs = true with tp = {config.parallel.tp} needs NCCL "
                          f"for the collectives inside the graph, but comm = \"{config.runtime.comm}\" resolved to "
                          f"mpi (NCCL missing, or ranks share a GPU); MPI calls cannot be captured: set "
                          f"cuda_graphs = false, or give each rank its own GPU")
