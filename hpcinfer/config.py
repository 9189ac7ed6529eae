"""The job config: TOML -> frozen dataclasses, validated once, in one place (docs/config.md lists every key).

Unknown sections and keys are errors (a typo must not pass silently); every value is type- and range-checked.
`--set section.key=value` overrides are applied before validation, so they are checked the same way.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
import tomllib
from dataclasses import dataclass, field

from .backend.interface import BACKENDS
from .checkpoint.presets import PRESETS
from .comm.nccl_group import COMMS
from .errors import ConfigError
from .generate.graphs import check_config as check_graphs_config
from .generate.paged_cache import supports as paged_supports
from .offload.placement import PAIRS, PERCENT_RULE, SCHEDULES, fills_100, is_percent, over_100
from .quant.formats import DEFAULT_EMBEDDING, EMBEDDINGS, LOAD_MODES

DTYPES = ("float32", "float16", "bfloat16")


def _meta(help: str, check=None, choices=None):
    return {"help": help, "check": check, "choices": choices}


def _preset_check(v):
    return v in PRESETS, f"is not a preset; presets: {', '.join(PRESETS)}"


def _path(v):
    return v.strip() != "" and "\0" not in v, "must be a non-empty path without NUL characters"


def _positive(v):
    return v >= 1, "must be >= 1"


def _non_negative(v):
    return v >= 0, "must be >= 0"


def _probability(v):
    return 0.0 < v <= 1.0, "must be in (0, 1]"


@dataclass(frozen=True)
class ModelSection:
    checkpoint: str | None = field(default=None, metadata=_meta(
        "path of the hpcinfer HDF5 checkpoint (made by `hpcinfer convert`)", _path))
    preset: str | None = field(default=None, metadata=_meta(
        "a named model shape with random weights made on each rank (docs/presets.md), instead of a checkpoint",
        lambda v: _preset_check(v)))
    dtype: str = field(default="float32", metadata=_meta("weight storage dtype on the device", choices=DTYPES))
    quantize: str = field(default="none", metadata=_meta(
        "quantize a float checkpoint's matrices while loading: int8 (symmetric per output channel), int4 / asym8 "
        "(group-wise asymmetric 4 / 8 bits; docs/quantization.md)",
        choices=LOAD_MODES))
    quantize_group: int = field(default=0, metadata=_meta(
        "int4 / asym8 group size along each matrix's input dimension; 0 = the source's block grid (32 for a "
        "checkpoint from a Q4_0 / Q4_1 / Q8_0 GGUF, whose blocks are then kept where they have the target's bits), "
        "else 64", _non_negative))
    quantize_embedding: str = field(default=DEFAULT_EMBEDDING, metadata=_meta(
        "with quantize = \"int4\": the token embedding and LM head at 8 bits (int8 per row, or a GGUF's Q8_0 blocks "
        "kept) or int4 like the other matrices (same)", choices=EMBEDDINGS))
    kv_cache: str = field(default="none", metadata=_meta(
        "KV cache storage: none (float32), int8 or int4 (group-wise asymmetric along head_dim; docs/quantization.md)",
        choices=("none", "int8", "int4")))
    kv_dtype: str = field(default="auto", metadata=_meta(
        "storage of a float KV cache (kv_cache = none) on the GPU: auto = the model's dtype when it is float16 or "
        "bfloat16 and no KV row goes to host memory (schedule.kv_offload_threshold, [offload]), else float32; or "
        "float32 / float16 / bfloat16. The NumPy backend keeps float32 (docs/gpu.md)",
        choices=("auto", "float32", "float16", "bfloat16")))
    kv_cache_group: int = field(default=64, metadata=_meta(
        "values per scale/min group of the quantized KV cache; clamped to head_dim, must divide it", _positive))
    verify: bool = field(default=False, metadata=_meta(
        "check the checkpoint's CRC-32s and metadata manifest before loading (docs/checkpoint-format.md)"))


@dataclass(frozen=True)
class ParallelSection:
    tp: int = field(default=1, metadata=_meta("tensor-parallel degree", _positive))
    pp: int = field(default=1, metadata=_meta("pipeline stages", _positive))
    ranks_per_node: int = field(default=0, metadata=_meta("ranks per node; 0 = from MPI's shared-memory split",
                                                          _non_negative))
    ep: int = field(default=1, metadata=_meta("expert-parallel degree (MoE models)", _positive))
    expert_tp: int = field(default=1, metadata=_meta("expert-slicing degree: each expert split over this many "
                                                     "ranks (MoE models)", _positive))


def _percent(v):
    return is_percent(v), PERCENT_RULE


@dataclass(frozen=True)
class OffloadSection:
    weights_gpu: float = field(default=100.0, metadata=_meta("percent of layers whose weights stay on the device",
                                                             _percent))
    weights_cpu: float = field(default=0.0, metadata=_meta("percent of layers in host memory (disk: the rest)",
                                                           _percent))
    cache_gpu: float = field(default=100.0, metadata=_meta(
        "percent of every GPU batch's KV cache on the device, at tensor granularity: of each layer's N x Hkv "
        "rows (sequence, KV head), the nearest whole number of rows", _percent))
    cache_cpu: float = field(default=0.0, metadata=_meta(
        "percent of every GPU batch's KV cache rows in host memory; cache_gpu + cache_cpu = 100 (no disk tier "
        "for the cache)", _percent))
    act_gpu: float = field(default=100.0, metadata=_meta(
        "percent of every GPU batch's activations (hidden states between layers, [T, D]) on the device, at "
        "tensor granularity: the nearest whole number of its T token rows; below 100 needs schedule = zigzag",
        _percent))
    act_cpu: float = field(default=0.0, metadata=_meta(
        "percent of every GPU batch's activation rows in host memory, stored after each layer and loaded before "
        "the next; act_gpu + act_cpu = 100 (no disk tier for activations)", _percent))
    device_memory: int | str = field(default=0, metadata=_meta("device byte budget per rank; 0 = unlimited",
                                                               lambda v: _bytes_check(v)))
    host_memory: int | str = field(default=0, metadata=_meta("host byte budget per rank; 0 = unlimited",
                                                             lambda v: _bytes_check(v)))
    disk_dir: str | None = field(default=None, metadata=_meta("directory for weights on disk", _path))
    prefetch_layers: int = field(default=1, metadata=_meta("layers fetched ahead of use", _non_negative))
    schedule: str = field(default="row", metadata=_meta("row (ZeRO-Inference) or zigzag (FlexGen block schedule)",
                                                        choices=SCHEDULES))
    gpu_batch_size: int = field(default=0, metadata=_meta("sequences per GPU batch; 0 = batch_size / "
                                                          "num_gpu_batches", _non_negative))
    num_gpu_batches: int = field(default=1, metadata=_meta("GPU batches per block (zig-zag)", _positive))
    cpu_attention: bool = field(default=False, metadata=_meta("decode attention on the host for host-resident KV"))
    partitioned_fetch: bool = field(default=False, metadata=_meta(
        "data-parallel replicas on one node each keep and read 1/N of every streamed layer; an all-gather "
        "assembles it (ZeRO-Inference's partitioned fetch)"))
    profile: str | None = field(default=None, metadata=_meta(
        "hardware profile (a `hpcinfer profile` TOML file or a preset) for the predicted-vs-measured report"))

    @property
    def active(self) -> bool:
        return (self.weights_gpu < 100 or self.cache_gpu < 100 or self.schedule == "zigzag" or
                self.num_gpu_batches > 1 or bool(parse_bytes(self.device_memory)))


MOE_DISPATCH = ("indexed", "one-hot")
ALL_TO_ALL = ("flat", "hierarchical", "pcc", "pcc+hierarchical")
BATCHING = ("auto", "continuous", "static")


@dataclass(frozen=True)
class MoESection:
    all_to_all: str = field(default="pcc+hierarchical", metadata=_meta(
        "expert all-to-all: flat, hierarchical (intra- then inter-node), pcc (parallelism-coordinated), or both",
        choices=ALL_TO_ALL))
    capacity_factor: float | None = field(default=None, metadata=_meta(
        "expert capacity factor (> 0); unset: the checkpoint's (0 there: no capacity limit)",
        lambda v: (v > 0, "must be > 0")))
    dispatch: str = field(default="indexed", metadata=_meta(
        "token dispatch to experts: indexed (gather/scatter by index tables, the fast path) or one-hot (the "
        "GShard / DeepSpeed one-hot einsum formulation, kept as the benchmark baseline; docs/moe.md)",
        choices=MOE_DISPATCH))


@dataclass(frozen=True)
class ScheduleSection:
    prompt_micro_batches: int = field(default=0, metadata=_meta("static batching: steps a batch's prompts are prefilled in; 0 = pp",
                                                                _non_negative))
    gen_micro_batches: int = field(default=0, metadata=_meta("steps in flight down the pipeline; 0 = pp",
                                                             _non_negative))
    kv_offload_threshold: int | str = field(default=0, metadata=_meta(
        "static batching: device KV bytes per rank above which idle sequences' KV goes to host memory; 0 = off",
        lambda v: _bytes_check(v)))
    batching: str = field(default="auto", metadata=_meta(
        "the scheduler's policy: continuous (a running set of up to batch_size sequences: a finished sequence's "
        "place is refilled at the next step, long prompts are prefilled in chunks), static (batch_size prompts "
        "enter when the running set is empty and run to their longest sequence), or auto (continuous, but static "
        "with [offload], kv_offload_threshold or prompt_micro_batches; docs/scheduling.md)", choices=BATCHING))
    max_batch_tokens: int = field(default=0, metadata=_meta(
        "continuous batching: tokens per step, the running sequences' decode tokens first, then chunks of "
        "prompts; at least [generate] batch_size; 0 = max(512, batch_size)", _non_negative))
    kv_block_size: int = field(default=16, metadata=_meta("positions per KV-cache block",
                                                          _positive))
    kv_cache_memory: int | str = field(default=0, metadata=_meta(
        "bytes of the KV pool per rank (\"2GiB\"), or \"N%\" of the memory left after "
        "the weights; 0 = enough for batch_size sequences at their longest (never preempts)",
        lambda v: _kv_memory_check(v)))

    @property
    def kv_offload_bytes(self) -> int:
        return parse_bytes(self.kv_offload_threshold)

    def kv_memory_bytes(self, free_bytes=None) -> int:
        """kv_cache_memory in bytes (0 = the default sizing); "N%" takes that share of free_bytes(), the memory
        left after the weights (None where the backend cannot say: an error)."""
        memory = self.kv_cache_memory
        if isinstance(memory, str) and memory.strip().endswith("%"):
            if free_bytes is None:
                raise ConfigError(f"schedule.kv_cache_memory = {memory!r}: this backend cannot say how much memory "
                                  f"is left after the weights; give bytes (\"2GiB\")")
            return int(free_bytes() * float(memory.strip()[:-1]) / 100)
        return parse_bytes(memory)

    def step_tokens(self, batch_size: int) -> int:
        """Tokens of a continuous step: max_batch_tokens, or max(512, batch_size) when it is 0."""
        return self.max_batch_tokens or max(512, batch_size)


@dataclass(frozen=True)
class RuntimeSection:
    backend: str = field(default="auto", metadata=_meta(
        "compute backend: numpy, cupy (the GPU of the node-local rank), auto (cupy when a GPU is visible)",
        choices=BACKENDS))
    comm: str = field(default="auto", metadata=_meta(
        "communicators: nccl (device arrays over NCCL; cupy backend, one GPU per rank), mpi (mpi4py; with cupy, "
        "device arrays go through host memory), auto (nccl with cupy when NCCL loads and no GPU is shared, else "
        "mpi)", choices=COMMS))
    threads: int = field(default=0, metadata=_meta("BLAS threads per rank; 0 = cores / ranks on the node",
                                                   _non_negative))
    cpu_kernels: str = field(default="auto", metadata=_meta(
        "the NumPy backend's kernels: numba (compiled CPU kernels, backend/cpu_kernels), numpy (NumPy/BLAS only: "
        "the reference), auto (numba wherever it imports); on cupy, CPU attention delegation's",
        choices=("auto", "numba", "numpy")))
    comm_timeout: float = field(default=600.0, metadata=_meta(
        "seconds a collective or point-to-point transfer may take before the watchdog ends the job (exit code 3; "
        "docs/reliability.md)", lambda v: (v > 0, "must be > 0 (seconds)")))
    log_level: str = field(default="info", metadata=_meta(
        "debug, info, warning, error; rank 0 prints info, every rank prints warnings and errors",
        choices=("debug", "info", "warning", "error")))
    progress: str = field(default="auto", metadata=_meta(
        "progress on rank 0: bar (carriage return), log (periodic lines), off, auto (bar on a terminal, else log)",
        choices=("auto", "bar", "log", "off")))
    cuda_graphs: bool = field(default=False, metadata=_meta(
        "replay each decode step from a CUDA graph captured once per (micro-batch size, KV-length bucket) "
        "(docs/gpu.md); cupy backend only (ignored, with a log line, where backend = \"auto\" finds no GPU)"))


@dataclass(frozen=True)
class GenerateSection:
    prompts: str = field(metadata=_meta("JSON Lines prompt file", _path))
    output: str = field(metadata=_meta("JSON Lines result file (written by rank 0, atomically)", _path))
    max_new_tokens: int = field(default=32, metadata=_meta("tokens to generate per prompt", _positive))
    batch_size: int = field(default=8, metadata=_meta("running sequences of a step at most, on each data-parallel replica (MoE "
                                                          "replicas stepping together: on all of them)", _positive))
    temperature: float = field(default=0.0, metadata=_meta("0 = greedy", _non_negative))
    top_k: int = field(default=0, metadata=_meta("0 = off", _non_negative))
    top_p: float = field(default=1.0, metadata=_meta("1.0 = off", _probability))
    seed: int = field(default=0, metadata=_meta("sampling seed", _non_negative))
    ignore_eos: bool = field(default=False, metadata=_meta("true: always generate max_new_tokens"))
    attention_topk: float = field(default=0.0, metadata=_meta(
        "top-k sparse decode attention: fraction of cached positions each query head keeps, in (0, 1]; 0 = off",
        lambda v: (0.0 <= v <= 1.0, "must be 0 (off) or a fraction in (0, 1]")))
    metrics: str | None = field(default=None, metadata=_meta("optional JSON metrics file", _path))
    echo: bool = field(default=False, metadata=_meta(
        "also print every answer on rank 0's console at the end, in input order (the output file always has them)"))


POOLINGS = ("mean", "cls", "pooler", "none")


@dataclass(frozen=True)
class EmbedSection:
    inputs: str = field(metadata=_meta("JSON Lines input file: {\"id\", \"text\"} or {\"id\", \"tokens\"} per line",
                                       _path))
    output: str = field(metadata=_meta("HDF5 embeddings file (written by rank 0, atomically; docs/embed.md)", _path))
    pooling: str = field(default="mean", metadata=_meta(
        "mean over the tokens, cls (the first token's state), pooler (BERT's tanh dense on [CLS]), none (every "
        "token's state)", choices=POOLINGS))
    normalize: bool = field(default=True, metadata=_meta("L2-normalize each embedding (each token's with none)"))
    max_length: int = field(default=0, metadata=_meta("tokens per input at most; 0 = min(512, the model's "
                                                      "positions)", _non_negative))
    batch_size: int = field(default=32, metadata=_meta("inputs per batch on each data-parallel replica "
                                                       "(batches are bucketed by length)", _positive))
    truncate: bool = field(default=True, metadata=_meta(
        "true: cut inputs longer than max_length (counted in the metrics); false: such an input is an error"))
    metrics: str | None = field(default=None, metadata=_meta("optional JSON metrics file", _path))


SECTIONS = {"model": ModelSection, "parallel": ParallelSection, "schedule": ScheduleSection, "moe": MoESection,
            "offload": OffloadSection, "runtime": RuntimeSection, "generate": GenerateSection,
            "embed": EmbedSection}
REQUIRED_SECTIONS = ("model",)
JOB_SECTIONS = ("generate", "embed")     # exactly one: the job kind


@dataclass(frozen=True)
class Config:
    path: str
    model: ModelSection
    parallel: ParallelSection
    schedule: ScheduleSection
    moe: MoESection
    offload: OffloadSection
    runtime: RuntimeSection
    generate: GenerateSection | None = None     # exactly one of generate and embed is set
    embed: EmbedSection | None = None


def read_toml(path: str, what: str = "config file") -> dict:
    """The TOML document at `path`; ConfigError naming `what` and the file on anything wrong (job configs,
    hardware profiles and bench configs all read through here)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start}); TOML files are UTF-8") from None
    except (ValueError, RecursionError) as exc:        # tomllib: an integer over 4300 digits, arrays nested too deep
        raise ConfigError(f"{what} '{path}' is not valid TOML for hpcinfer: {_toml_limit(exc)}") from None


def load_config(path: str, overrides: list[str] = ()) -> Config:
    """Read, override and validate. Raises ConfigError naming the file, the key and what is allowed."""
    raw = read_toml(path)
    for item in overrides:
        _apply_override(raw, item)
    return _build(path, raw)


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set generate.max_new_tokens=64")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text                                   # a bare string such as a path needs no quotes
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"--set {item!r}: the value is not valid TOML for hpcinfer: {_toml_limit(exc)}") from None
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise ConfigError(f"--set {item!r}: [{section}] is not a section")
    raw[section][name] = value


def _toml_limit(exc: Exception) -> str:
    return "values nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]


def _build(path: str, raw: dict) -> Config:
    for name in raw:
        if name not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{name}]; allowed sections: {', '.join(SECTIONS)}")
    for name in REQUIRED_SECTIONS:
        if name not in raw:
            raise ConfigError(f"{path}: missing section [{name}]")
    kinds = [name for name in JOB_SECTIONS if name in raw]
    if not kinds:
        raise ConfigError(f"{path}: missing section [generate] or [embed]: a job needs exactly one of them")
    if len(kinds) > 1:
        raise ConfigError(f"{path}: both [generate] and [embed] are given; a job is exactly one of them "
                          f"(generation or embeddings): remove one")
    sections = {name: _build_section(path, name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()
                if name in raw or name not in JOB_SECTIONS}
    config = Config(path=path, **sections)
    if (config.model.checkpoint is None) == (config.model.preset is None):
        raise ConfigError(f"{path}: [model] needs exactly one of 'checkpoint' (an HDF5 file) and 'preset' "
                          f"(random weights of a named shape)")
    if config.model.verify and config.model.preset is not None:
        raise ConfigError(f"{path}: [model] verify = true checks a checkpoint file; preset {config.model.preset!r} "
                          f"has none (its weights are made on each rank): remove verify or give a checkpoint")
    if config.runtime.comm == "nccl" and config.runtime.backend == "numpy":
        raise ConfigError(f"{path}: runtime.comm = 'nccl' needs device arrays; use backend = \"cupy\" (or \"auto\" "
                          f"on a GPU), or comm = \"mpi\"")
    _check_offload(path, config)
    _check_kv_cache(path, config)
    check_graphs_config(config)
    if config.generate is not None:
        batching_choice(config)                   # a key of the other batching mode is an error naming it
    batch = config.generate.batch_size if config.generate is not None else config.embed.batch_size
    if config.generate is not None and 0 < config.schedule.max_batch_tokens < config.generate.batch_size:
        raise ConfigError(f"{path}: schedule.max_batch_tokens = {config.schedule.max_batch_tokens} is below "
                          f"[generate] batch_size = {batch}: a continuous step holds one decode token of every "
                          f"running sequence; raise it (or lower batch_size)")
    for key in ("prompt_micro_batches", "gen_micro_batches"):
        value = getattr(config.schedule, key)
        if value > batch:
            raise ConfigError(f"{path}: schedule.{key} = {value} is above [generate] batch_size = {batch}; "
                              f"a micro-batch needs at least one prompt")
    return config


def unsupported(config) -> list[str]:
    """Why this [generate] job cannot batch continuously (empty: it can)."""
    why = []
    if config.offload.active:
        why.append("[offload] runs fixed blocks by design (FlexGen's zig-zag and ZeRO-Inference's row schedules)")
    if config.schedule.kv_offload_bytes:
        why.append("[schedule] kv_offload_threshold moves whole batches' KV slots by layer parity (static only)")
    return why + paged_supports(config.model.kv_cache, config.generate.attention_topk)


def batching_mode(config) -> str:
    """"continuous" or "static": what `[schedule] batching` runs (batching_choice)."""
    return batching_choice(config)[0]


def batching_choice(config) -> tuple[str, str]:
    """(the batching a [generate] job runs, why `auto` chose it when that is not plain continuous; the runtime logs
    it). auto: static where continuous is not supported ([offload], kv_offload_threshold) or where
    prompt_micro_batches (a static key) is set, else continuous. A key of the other mode is a ConfigError naming it:
    max_batch_tokens under static (a static step takes each prompt whole), prompt_micro_batches under continuous
    (its prompts are chunked into the gen_micro_batches steps in flight); with [offload] kv_block_size and
    kv_cache_memory too (its schedules size their own caches)."""
    sch, path, why = config.schedule, config.path, unsupported(config)
    if sch.batching == "continuous" and why:
        raise ConfigError(f"{path}: schedule.batching = \"continuous\" is not supported here: {'; '.join(why)}; use "
                          f"batching = \"static\" (or \"auto\")")
    given = {"max_batch_tokens": sch.max_batch_tokens != 0, "prompt_micro_batches": sch.prompt_micro_batches != 0,
             "kv_block_size": sch.kv_block_size != 16, "kv_cache_memory": parse_bytes_or_share(sch.kv_cache_memory)}
    if sch.batching == "auto" and why:
        mode, reason = "static", "; ".join(why)
    elif sch.batching == "auto" and given["prompt_micro_batches"] and not given["max_batch_tokens"]:
        mode, reason = "static", "schedule.prompt_micro_batches is set (it splits a static batch's prompts)"
    else:
        mode, reason = ("continuous" if sch.batching == "auto" else sch.batching), ""
    wrong = {"static": ["max_batch_tokens"], "continuous": ["prompt_micro_batches"]}[mode]
    if config.offload.active:
        wrong += ["kv_block_size", "kv_cache_memory"]
    for key in wrong:
        if given[key]:
            raise ConfigError(f"{path}: schedule.{key} = {getattr(sch, key)!r} does not apply: the job batches "
                              f"{mode}{' (' + reason + ')' if reason else ''}, and {key} is "
                              f"{'a continuous' if key != 'prompt_micro_batches' else 'a static'} batching key"
                              f"{' of the scheduler' if config.offload.active else ''}; remove it, or change "
                              f"schedule.batching")
    return mode, reason


def parse_bytes_or_share(value) -> bool:
    """kv_cache_memory given: a share ("N%") or bytes other than 0."""
    return isinstance(value, str) and value.strip().endswith("%") or parse_bytes(value) != 0


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _kv_host_tier(config) -> bool:
    """KV rows of the job may live in host memory: idle micro-batches offloaded, the cache's rows placed there
    (offload.cache_gpu < 100, CPU attention), or the zig-zag schedule's blocks."""
    off = config.offload
    return (bool(config.schedule.kv_offload_bytes) or off.cache_gpu < 100 or off.cpu_attention or
            off.schedule == "zigzag")


def gpu_kv_dtype(config) -> str:
    """[model] kv_dtype resolved for the GPU: "auto" -> [model] dtype when it is float16 or bfloat16 and the job
    keeps every KV row on the device, else float32; an explicit choice as given (the NumPy backend ignores it)."""
    choice = config.model.kv_dtype
    if choice != "auto":
        return choice
    half = config.model.dtype in ("float16", "bfloat16")
    return config.model.dtype if half and not _kv_host_tier(config) else "float32"


def _check_kv_cache(path: str, config) -> None:
    """A quantized KV cache needs a cache (a [generate] job); every schedule builds it (zig-zag moves it quantized).
    A half-precision float cache stays on the GPU: the host tiers keep float32 rows."""
    if config.model.kv_dtype in ("float16", "bfloat16"):
        if config.runtime.backend == "numpy":
            raise ConfigError(f"{path}: model.kv_dtype = {config.model.kv_dtype!r} applies to the GPU (backend = "
                              f"\"cupy\" or \"auto\"); the NumPy backend keeps a float32 KV cache: use \"auto\" "
                              f"or \"float32\"")
        if _kv_host_tier(config):
            raise ConfigError(f"{path}: model.kv_dtype = {config.model.kv_dtype!r} with KV rows in host memory "
                              f"(schedule.kv_offload_threshold or [offload]): the host tiers keep float32 rows; use "
                              f"\"auto\" or \"float32\"")
    if config.model.kv_cache == "none":
        return
    if config.generate is None:
        raise ConfigError(f"{path}: model.kv_cache = {config.model.kv_cache!r} applies to [generate] jobs; an "
                          f"[embed] job keeps no KV cache: remove it")


def _check_offload(path: str, config) -> None:
    """The placement rules (offload/placement.py) and what the runtime's schedules can hold."""
    off = config.offload
    for a, b in PAIRS:
        if over_100(getattr(off, a), getattr(off, b)):
            raise ConfigError(f"{path}: offload.{a} + offload.{b} = {getattr(off, a) + getattr(off, b)} is above "
                              f"100 (percent)")
    if not fills_100(off.cache_gpu, off.cache_cpu):
        raise ConfigError(f"{path}: offload.cache_gpu + offload.cache_cpu = {off.cache_gpu + off.cache_cpu:g} must "
                          f"be 100: the KV cache has no disk tier in this runtime (rows on the device, the rest in "
                          f"host memory)")
    if not fills_100(off.act_gpu, off.act_cpu):
        raise ConfigError(f"{path}: offload.act_gpu + offload.act_cpu = {off.act_gpu + off.act_cpu:g} must be 100: "
                          f"activations have no disk tier in this runtime (rows on the device, the rest in host "
                          f"memory)")
    if off.cpu_attention and off.cache_gpu >= 100:
        raise ConfigError(f"{path}: offload.cpu_attention = true with offload.cache_gpu = {off.cache_gpu:g} has no "
                          f"host cache to attend over (it would do nothing): CPU attention attends the KV rows in "
                          f"host memory, so it needs cache_gpu < 100 (a split, or cache_gpu = 0, cache_cpu = 100 "
                          f"for the whole cache); otherwise set cpu_attention = false")
    if off.weights_gpu + off.weights_cpu < 100 and off.disk_dir is None:
        raise ConfigError(f"{path}: offload.weights_gpu + weights_cpu < 100 puts weights on disk: set "
                          f"offload.disk_dir")
    if off.schedule == "row" and (off.cache_gpu < 100 or off.cpu_attention):
        raise ConfigError(f"{path}: offload.cache_gpu < 100 and offload.cpu_attention place the KV cache of GPU "
                          f"batches in host memory, which the zig-zag schedule does; set offload.schedule = "
                          f"\"zigzag\" (the row schedule runs one GPU batch at a time, its cache on the device)")
    if off.schedule == "row" and off.act_gpu < 100:
        raise ConfigError(f"{path}: offload.act_gpu = {off.act_gpu:g} places activation rows in host memory, which "
                          f"the zig-zag schedule does; set offload.schedule = \"zigzag\" (the row schedule keeps "
                          f"its activations on the device), or act_gpu = 100")
    if off.active and config.parallel.pp > 1:
        raise ConfigError(f"{path}: [offload] streams the layers of one pipeline stage; use pp = 1 with it")
    if off.active and config.generate is None:
        raise ConfigError(f"{path}: [offload] applies to [generate] jobs; an [embed] job keeps its weights in place")
    if config.generate is None:
        return
    if off.gpu_batch_size and off.gpu_batch_size * off.num_gpu_batches != config.generate.batch_size:
        raise ConfigError(f"{path}: offload.gpu_batch_size * num_gpu_batches = "
                          f"{off.gpu_batch_size * off.num_gpu_batches} must equal [generate] batch_size = "
                          f"{config.generate.batch_size} (the block)")


class FractionalBytes(ValueError):
    """A size that is not a whole number of bytes ("1.5B", "0.3KiB")."""


def parse_bytes(value) -> int:
    """An integer number of bytes, or a string with a unit: "512MB", "2GiB", "1.5 GB" (decimal or binary). A
    fraction with a unit is allowed when it makes whole bytes ("1.5GB", "0.5KiB"); a fractional byte count
    ("1.5B", "2.5", "1.1KiB" = 1126.4 bytes) raises FractionalBytes, never rounded down."""
    if isinstance(value, int):
        return value
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(value)
    if not math.isfinite(float(number)) or abs(float(number) * _UNITS[unit]) > 2**80:   # "inf", "1e400GB"
        raise ValueError(value)
    size = Fraction(number) * _UNITS[unit]             # exact: "2.3GB" is 2,300,000,000, not 2,299,999,999
    if size.denominator != 1:
        raise FractionalBytes(f"{float(size):g} bytes is not a whole number of bytes")
    return int(size)


def _kv_memory_check(value):
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return 0 < float(value.strip()[:-1]) <= 100, "must be a percentage in (0, 100]"
        except ValueError:
            return False, "must be a number of bytes, a size such as \"2GiB\", or a percentage such as \"50%\""
    return _bytes_check(value)


def _bytes_check(value):
    try:
        return parse_bytes(value) >= 0, "must be >= 0"
    except FractionalBytes as exc:
        return False, f"is a fractional byte count ({exc}); give whole bytes, e.g. \"2\" or \"1.5KB\""
    except ValueError:
        return False, "must be a number of bytes or a size such as \"512MB\" or \"2GiB\""


def _build_section(path: str, name: str, cls, values) -> object:
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: '{name}' must be a section [{name}], not a value")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            raise ConfigError(f"{path}: unknown key '{key}' in [{name}]; allowed keys: {', '.join(fields)}")
    kwargs = {}
    for key, f in fields.items():
        if key not in values:
            if f.default is dataclasses.MISSING:
                raise ConfigError(f"{path}: [{name}] is missing the required key '{key}' ({f.metadata['help']})")
            continue
        kwargs[key] = _check_value(path, f"{name}.{key}", f, values[key])
    return cls(**kwargs)


_TYPES = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,), "str | None": (str,),
          "int | str": (int, str), "float | None": (float, int)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "str | None": "a string", "int | str": "a number of bytes or a size string such as \"512MB\"",
               "float | None": "a number"}


def _check_value(path: str, key: str, f: dataclasses.Field, value):
    allowed = _TYPES[f.type]
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        raise ConfigError(f"{path}: {key} = {value!r} must be {_TYPE_WORDS[f.type]}")
    if f.type in ("float", "float | None"):
        value = float(value) if not isinstance(value, int) or abs(value) < 2**1000 else math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{path}: {key} = {value!r} must be a finite number")
    choices, check = f.metadata["choices"], f.metadata["check"]
    if choices and value not in choices:
        raise ConfigError(f"{path}: {key} = {value!r} is not allowed; choose one of {', '.join(choices)}")
    if check:
        ok, rule = check(value)
        if not ok:
            raise ConfigError(f"{path}: {key} = {value!r} {rule}")
    return value
