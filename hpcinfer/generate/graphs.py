"""CUDA graphs in the decode schedule (`[runtime] cuda_graphs`; docs/gpu.md, Options).

A pure decode step (one new token per sequence) of one pipeline stage runs through a `DecodeGraph`
(backend/cupy_graphs.py): captured once per (micro-batch size, KV-length bucket) and replayed after its inputs (token
ids, or the activations from the previous stage) and the sequences' slots and positions are copied into the graph's
static device buffers. Prompt steps stay eager. The output (logits [S, V] on the last stage, activations [S, D]
before it) is the graph's static buffer: the schedule copies it to the host for sampling, or sends it to the next
stage on the same stream, before the next replay can overwrite it.

The graphs of a batch belong to its KV cache (they captured its arrays), so each batch captures its own. What a
captured step cannot hold is refused when the config is read (config._check_cuda_graphs) or, for what is known
only later, here: MoE layers once the checkpoint is open (`check_model`), a tp group over MPI once `comm = "auto"`
is resolved (`check_comm`).
"""

from __future__ import annotations

import logging

from ..errors import ConfigError

log = logging.getLogger("hpcinfer")


def stage_step(model, cache, inputs: dict, step):
    """This stage's share of one step, eagerly or under capture: inputs {"tokens": ids [T]} on the first stage,
    {"x": activations [T, D]} on the others -> logits [S, V] on the last stage, else activations [T, D]."""
    x = model.embed_tokens(inputs["tokens"], step) if "tokens" in inputs else model.ops.asarray(inputs["x"])
    x = model.run_layers(x, step, cache)
    return model.logits(x, step) if model.stage.is_last else x


class DecodeGraphs:
    """The captured decode steps of one batch (one KV cache) on one stage, keyed by (sequences, KV bucket)."""

    def __init__(self, model, cache):
        from ..backend.cupy_graphs import DecodeGraph

        self.model, self.cache = model, cache
        self.graph = DecodeGraph(model.ops)
        self.replays = 0

    def applies(self, step) -> bool:
        """A decode step with at least one sequence, over layers whose KV stays on the device."""
        return step.is_decode and step.num_seqs > 0 and not self.cache.offloading

    def __call__(self, step, inputs: dict):
        self.replays += 1
        return self.graph(lambda static, device_step: stage_step(self.model, self.cache, static, device_step),
                          inputs, step.slots, step.starts)

    @property
    def captures(self) -> int:
        return len(self.graph.captured)

    def close(self) -> None:
        """Drop the graphs and hand their private memory pool back to the device (the batch is done)."""
        self.graph.captured.clear()
        self.graph.pool.free_all_blocks()


def decode_graphs(model, cache, enabled: bool) -> DecodeGraphs | None:
    """The batch's DecodeGraphs when `[runtime] cuda_graphs` is on and the backend is cupy; None runs eagerly."""
    if not enabled or model.ops.name != "cupy":
        return None
    return DecodeGraphs(model, cache)


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
