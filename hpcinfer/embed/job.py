"""An embedding job (`[embed]`, docs/embed.md): set-up checks before any weight is read, batches bucketed by
length, data-parallel rounds and rank 0's batch-by-batch writes.

Batches: the inputs sorted by token count (stable), cut into batch_size runs, so a batch pads little. In round r,
data-parallel replica d embeds batch r * dp + d; its tp rank 0 sends the rows to world rank 0, which writes them
into the HDF5 file and flushes, so a re-run resumes after the last finished round.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..backend.ops import make_ops
from ..errors import ConfigError
from ..generate.resume import config_values, file_digest, file_identity, fingerprint
from ..model.encoder import encoder_layout
from ..parallel.layout import check_tensor_parallel
from ..preflight import check_quantization, check_writable, open_model_source
from .inputs import EncoderTokenizer, load_inputs
from .output import EmbeddingWriter
from .pooling import l2_normalize, pool

DEFAULT_MAX_LENGTH = 512
# keys that do not change any embedding: where results go, how work is split and run
_NOT_IN_FINGERPRINT = ("embed.output", "embed.metrics", "embed.batch_size")
log = logging.getLogger("hpcinfer")


@dataclass
class EmbedJob:
    config: object
    ckpt: object
    inputs: list                 # EmbedInput in input order
    max_length: int
    batches: list                # [[input index]] bucketed by length
    fingerprint: dict = field(default_factory=dict)
    load_quant: object = None    # what the model load quantizes (`[model] quantize`: quant.storage.load_quant)


def prepare_embed_job(config, world_size: int, rank: int) -> EmbedJob:
    """Everything that can be wrong, checked on every rank before any weight is read."""
    e, par = config.embed, config.parallel
    ckpt = open_model_source(config.model)
    try:
        arch = ckpt.arch
        where = config.model.checkpoint or f"preset {config.model.preset!r}"
        if not arch.is_encoder:
            raise ConfigError(f"{config.path}: [embed] needs an encoder checkpoint (BERT, RoBERTa, DistilBERT); "
                              f"{where} is a {arch.family} decoder: use a [generate] job for it")
        if par.pp > 1 or par.ep > 1 or par.expert_tp > 1:
            raise ConfigError(f"{config.path}: [embed] runs with tp and data parallelism only; set [parallel] "
                              f"pp = ep = expert_tp = 1")
        load_quant = _check_model_options(config, ckpt, rank, world_size)
        check_tensor_parallel(arch, par.tp, config.path)
        if world_size % par.tp:
            raise ConfigError(f"{config.path}: {world_size} ranks do not divide into tp = {par.tp} groups")
        if e.pooling == "pooler" and not arch.pooler:
            raise ConfigError(f"{config.path}: embed.pooling = 'pooler' needs pooler weights, and {where} has none;"
                              f" use mean or cls")
        max_length = resolve_max_length(config, arch)
        text = ckpt.tokenizer_json()
        tokenizer = EncoderTokenizer(text) if text is not None else None
        inputs = load_inputs(e.inputs, arch, tokenizer, max_length, e.truncate)
        if rank == 0:
            _warn_truncated(e.inputs, inputs, max_length)
            check_writable(e.output, "[embed] output")
            if e.metrics:
                check_writable(e.metrics, "[embed] metrics")
    except Exception:
        ckpt.close()
        raise
    return EmbedJob(config, ckpt, inputs, max_length, bucket_batches([len(x.tokens) for x in inputs], e.batch_size),
                    job_fingerprint(config), load_quant)


def _warn_truncated(path: str, inputs, max_length: int) -> None:
    """One warning at set-up (rank 0) when inputs were cut to max_length; the metrics count them too."""
    cut = sum(x.truncated for x in inputs)
    if cut:
        log.warning("%s: %d of %d inputs are longer than embed.max_length = %d tokens and are truncated to it "
                    "(truncate = false makes this an error)", path, cut, len(inputs), max_length)


def _check_model_options(config, ckpt, rank: int, world_size: int):
    """[model] quantize (int8/int4 matrices, as for decoders) and verify apply; an encoder has no KV cache.
    -> what the model load quantizes (preflight.check_quantization)."""
    if getattr(config.model, "kv_cache", "none") != "none":
        raise ConfigError(f"{config.path}: model.kv_cache = {config.model.kv_cache!r}: an encoder has no KV cache; "
                          f"remove the key for an [embed] job")
    load_quant = check_quantization(config, ckpt, make_ops(config.runtime.backend))
    if config.model.verify:
        ckpt.verify(rank, world_size)
    return load_quant


def resolve_max_length(config, arch) -> int:
    e = config.embed
    if e.max_length > arch.max_positions:
        raise ConfigError(f"{config.path}: embed.max_length = {e.max_length} is above the model's "
                          f"{arch.max_positions} positions")
    return e.max_length or min(DEFAULT_MAX_LENGTH, arch.max_positions)


def bucket_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Input indices sorted by length (stable), in runs of batch_size."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[a:a + batch_size] for a in range(0, len(order), batch_size)]


def job_fingerprint(config) -> dict:
    """What determines the embeddings: the config (not where results go), the checkpoint, the inputs' bytes."""
    exclude = _NOT_IN_FINGERPRINT + tuple(f"runtime.{k}" for k in ("threads", "backend", "comm", "comm_timeout",
                                                                       "log_level", "progress"))
    model = config.model.checkpoint
    return fingerprint({"config": config_values(config, exclude),
                        "checkpoint": file_identity(model) if model else config.model.preset,
                        "inputs": file_digest(config.embed.inputs)})


def open_writer(job: EmbedJob, restart: bool):
    """Rank 0's writer, started during set-up (so a changed job is refused before any weight is read)."""
    e = job.config.embed
    writer = EmbeddingWriter(e.output, job.inputs, job.ckpt.arch, e.pooling, e.normalize, job.max_length,
                             job.fingerprint, restart)
    writer.start()
    return writer


def embed_batch(model, inputs: list, pooling: str, normalize: bool) -> list[np.ndarray]:
    """Embed one batch (packed, no padding) -> one host array per input ([D], or [n, D] with pooling none)."""
    step = encoder_layout([len(x.tokens) for x in inputs])
    tokens = np.concatenate([np.asarray(x.tokens, dtype=np.int64) for x in inputs])
    hidden = model.forward(tokens, step)                                          # [T, D]
    pooled = model.ops.to_host(model.pool(hidden, step)) if pooling == "pooler" else None
    rows = pool(model.ops.to_host(hidden), step.offsets, pooling, pooled)
    return [l2_normalize(r) for r in rows] if normalize else [np.asarray(r, dtype=np.float32) for r in rows]


@dataclass
class EmbedStats:
    batches: int = 0
    inputs: int = 0
    tokens: int = 0
    padded_tokens: int = 0       # batch size * longest input, summed (what a padded layout would compute)
    compute_s: float = 0.0
    stopped: str | None = None   # the agreed reason (a signal on some rank) when the job stopped early


def run_rounds(world, mesh, model, job: EmbedJob, writer, stop=None) -> EmbedStats:
    """Every rank: the rounds of batches not yet done. World rank 0 (which holds `writer`) writes each round.
    `stop` (generate/rounds.StopFlag): a signal on any rank ends the job after the round in flight, every rank
    agreeing (stats.stopped says why); the rows written so far stay in the partial file for a re-run."""
    if writer is not None and writer.done is None:
        writer.start()
    done = world.bcast(writer.done if writer is not None else None, root=0)          # [N] bool
    batches = [b for b in job.batches if not all(done[i] for i in b)]
    _, dp_index, tp_index = mesh.coords
    rounds, stats = -(-len(batches) // mesh.shape.dp), EmbedStats()
    for r in range(rounds):
        mine = r * mesh.shape.dp + dp_index                  # this replica's batch in round r (none past the end)
        rows = _embed_one(model, job, batches[mine], stats) if mine < len(batches) else None
        sent = (batches[mine], rows) if rows is not None and tp_index == 0 else None
        received = world.gather((sent, getattr(stop, "reason", None)), root=0)
        decision = None
        if writer is not None:
            for part, _ in received:
                if part is not None:
                    writer.write_rows(*part)
            if r + 1 < rounds:                                # nothing to stop after the last round
                decision = next((f"{why} on rank {i}" for i, (_, why) in enumerate(received) if why), None)
        stats.stopped = world.bcast(decision, root=0)
        if stats.stopped:
            break
    return stats


def _embed_one(model, job: EmbedJob, batch: list, stats: EmbedStats) -> list:
    items = [job.inputs[i] for i in batch]
    lengths = [len(x.tokens) for x in items]
    t0 = time.perf_counter()
    rows = embed_batch(model, items, job.config.embed.pooling, job.config.embed.normalize)
    stats.compute_s += time.perf_counter() - t0
    stats.batches += 1
    stats.inputs += len(items)
    stats.tokens += sum(lengths)
    stats.padded_tokens += len(items) * max(lengths)
    return rows


def embed_metrics(job: EmbedJob, mesh, reports: list, load_s: float, embed_s: float, total_s: float,
                  threads: int) -> dict:
    """One JSON object: the job, the mesh, and the rates over every replica (tp rank 0 of each counts).
    embed_s: wall time of the rounds on rank 0 (writes included); compute_s: the busiest rank's model time."""
    counted = [s for coords, s in reports if coords[2] == 0]
    compute_s = max((s.compute_s for _, s in reports), default=0.0)
    tokens = sum(s.tokens for s in counted)
    padded = sum(s.padded_tokens for s in counted)
    return {"kind": "embed", "config": os.path.abspath(job.config.path),
            "mesh": {"dp": mesh.shape.dp, "tp": mesh.shape.tp, "ranks": mesh.shape.dp * mesh.shape.tp},
            "threads_per_rank": threads, "pooling": job.config.embed.pooling,
            "normalize": job.config.embed.normalize, "max_length": job.max_length,
            "inputs": len(job.inputs), "embedded_inputs": sum(s.inputs for s in counted),
            "truncated_inputs": sum(x.truncated for x in job.inputs), "tokens": tokens,
            "batches": sum(s.batches for s in counted),
            "attention_padding_fraction": 0.0 if not padded else 1.0 - tokens / padded,
            "load_s": load_s, "embed_s": embed_s, "compute_s": compute_s, "total_s": total_s,
            "inputs_per_s": sum(s.inputs for s in counted) / embed_s if embed_s else 0.0,
            "tokens_per_s": tokens / embed_s if embed_s else 0.0}
