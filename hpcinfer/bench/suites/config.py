"""The bench config (TOML -> frozen dataclasses, checked once; docs/bench.md) and the papers' named suites.

A suite is a workload (prompt length, generated tokens, batch sizes) run on every layout of the config that fits
it; each (suite, layout, batch, variant) is one cell = one `hpcinfer run` job. Variants are hpcinfer itself and
the naive paths kept for comparison: "one-hot" MoE dispatch for an MoE model (outside the offload suite), "flat"
all-to-all for MoE layouts with an exchange, "row" offload for the offload suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...backend.interface import BACKENDS
from ...backend.ops import resolve_backend as resolve_ops_backend
from ...checkpoint.presets import PRESETS
from ...config import read_toml
from ...errors import ConfigError


@dataclass(frozen=True)
class SuiteDefaults:
    prompt_len: int
    new_tokens: int
    batches: tuple
    about: str


# The papers' settings; every value can be shrunk in a bench config's [suite.NAME] table.
SUITES = {
    "dense-latency": SuiteDefaults(128, 8, (1, 2, 4, 8, 16, 32, 64, 128),
                                   "DeepSpeed Inference: dense-model latency, prompt 128, generate 8, batch 1 to 128"),
    "moe-latency": SuiteDefaults(128, 100, (8,),
                                 "DeepSpeed Inference: MoE per-token latency, prompt 128, generate 100, batch 8"),
    "throughput": SuiteDefaults(512, 50, (1, 8, 32, 64, 128),
                                "DeepSpeed Inference: throughput, prompt 512, generate 50"),
    "offload-max-batch": SuiteDefaults(512, 32, (8, 16, 32, 64, 128, 256),
                                       "FlexGen: offload throughput at the largest batch that fits, prompt 512, "
                                       "generate 32"),
}
DEFAULT_OFFLOAD = {"weights_gpu": 0.0, "weights_cpu": 100.0, "schedule": "zigzag", "num_gpu_batches": 4}
LAYOUT_KEYS = ("ranks", "tp", "pp", "ep", "expert_tp", "all_to_all", "prompt_micro_batches", "gen_micro_batches",
               "ranks_per_node")


@dataclass(frozen=True)
class ModelSpec:
    checkpoint: str | None = None
    preset: str | None = None
    dtype: str = "float32"
    hf_source: str | None = None           # the GGUF file or HF folder the checkpoint came from (HF baseline)


@dataclass(frozen=True)
class Layout:
    name: str
    ranks: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    expert_tp: int = 1
    all_to_all: str = ""                   # "" = the run config's default (pcc+hierarchical)
    prompt_micro_batches: int = 0
    gen_micro_batches: int = 0
    ranks_per_node: int = 0

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    def overrides(self) -> list[str]:
        sets = [f"parallel.{k}={getattr(self, k)}" for k in ("tp", "pp", "ep", "expert_tp", "ranks_per_node")]
        sets += [f"schedule.{k}={getattr(self, k)}" for k in ("prompt_micro_batches", "gen_micro_batches")]
        return sets + ([f'moe.all_to_all="{self.all_to_all}"'] if self.all_to_all else [])


@dataclass(frozen=True)
class Suite:
    name: str
    prompt_len: int
    new_tokens: int
    batches: tuple
    layouts: tuple                          # layout names; () = every layout
    model: ModelSpec
    offload: dict = field(default_factory=dict)
    hf_baseline: bool = True


@dataclass(frozen=True)
class BenchConfig:
    path: str
    model: ModelSpec
    layouts: tuple                          # Layout
    suites: tuple                           # Suite, in run order
    repeats: int = 1
    quiet_wait_s: float = 10.0
    timeout_s: int = 300
    threads: int = 0                        # [runtime] threads of every job (0: cores / ranks)
    launcher: tuple = ()                    # argv before `python -m hpcinfer run`; {ranks} is filled in
    python: str = ""                        # "" = this interpreter
    backend: str = "auto"                   # [runtime] backend of every cell: auto (cupy when the driver sees a
                                            # GPU), numpy or cupy; resolved once and written into each cell


def _err(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


def _take(path: str, where: str, table: dict, key: str, kind, default, check=None):
    """table[key] checked against a type (or tuple of types) and an optional (ok, rule) check."""
    if key not in table:
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _err(path, f"{where}.{key} = {value!r} must be {' or '.join(k.__name__ for k in kinds)}")
    if check is not None:
        ok, rule = check(value)
        if not ok:
            raise _err(path, f"{where}.{key} = {value!r} {rule}")
    return value


def _only(path: str, where: str, table, allowed) -> dict:
    if not isinstance(table, dict):
        raise _err(path, f"{where} must be a table")
    for key in table:
        if key not in allowed:
            raise _err(path, f"unknown key '{key}' in {where}; allowed keys: {', '.join(allowed)}")
    return table


def _positive(v):
    return v >= 1, "must be >= 1"


def _int_list(v):
    return bool(v) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v), \
        "must be a non-empty list of integers >= 1"


MODEL_KEYS = ("checkpoint", "preset", "dtype", "hf_source")


def _model(path: str, where: str, table: dict, base: ModelSpec | None) -> ModelSpec:
    _only(path, where, table, MODEL_KEYS)
    values = {k: _take(path, where, table, k, str, None) for k in MODEL_KEYS if k in table}
    if base is not None and ("checkpoint" in values or "preset" in values):
        base = ModelSpec(dtype=base.dtype)             # a suite's own model drops the run's checkpoint/preset
    spec = replace(base or ModelSpec(), **values)
    if (spec.checkpoint is None) == (spec.preset is None):
        raise _err(path, f"{where} needs exactly one of 'checkpoint' (an HDF5 file) and 'preset' (docs/presets.md)")
    if spec.preset is not None:
        if spec.preset not in PRESETS:
            raise _err(path, f"{where}.preset = {spec.preset!r} is not a preset; presets: {', '.join(PRESETS)}")
    return spec


def _layout(path: str, i: int, table: dict) -> Layout:
    where = f"[[layout]] #{i + 1}"
    _only(path, where, table, ("name",) + LAYOUT_KEYS)
    ints = {k: _take(path, where, table, k, int, None, _positive if k in ("ranks", "tp", "pp", "ep", "expert_tp")
                     else lambda v: (v >= 0, "must be >= 0")) for k in LAYOUT_KEYS if k != "all_to_all"}
    lay = Layout(name=_take(path, where, table, "name", str, f"layout {i + 1}"),
                 all_to_all=_take(path, where, table, "all_to_all", str, ""),
                 **{k: v for k, v in ints.items() if v is not None})
    if lay.ranks % (lay.tp * lay.pp):
        raise _err(path, f"{where} ({lay.name}): ranks = {lay.ranks} must be a multiple of tp * pp = "
                         f"{lay.tp * lay.pp}")
    return lay


def _suite(path: str, name: str, table: dict, model: ModelSpec, layout_names: set) -> Suite:
    where = f"[suite.{name}]"
    if name not in SUITES:
        raise _err(path, f"unknown suite '{name}'; suites: {', '.join(SUITES)}")
    d = SUITES[name]
    _only(path, where, table, ("prompt_len", "new_tokens", "batches", "layouts", "model", "offload",
                               "hf_baseline"))
    layouts = tuple(_take(path, where, table, "layouts", list, []))
    unknown = [x for x in layouts if x not in layout_names]
    if unknown:
        raise _err(path, f"{where}.layouts names {unknown}, not a [[layout]] name; layouts: {sorted(layout_names)}")
    offload = dict(_take(path, where, table, "offload", dict, {}))
    if name == "offload-max-batch":
        offload = {**DEFAULT_OFFLOAD, **offload}
    elif offload:
        raise _err(path, f"{where}.offload applies to the offload-max-batch suite only")
    suite = Suite(name=name,
                  prompt_len=_take(path, where, table, "prompt_len", int, d.prompt_len, _positive),
                  new_tokens=_take(path, where, table, "new_tokens", int, d.new_tokens,
                                   lambda v: (v >= 2, "must be >= 2 (one decode step at least)")),
                  batches=tuple(sorted(_take(path, where, table, "batches", list, list(d.batches), _int_list))),
                  layouts=layouts, offload=offload,
                  model=_model(path, f"{where}.model", table["model"], model) if "model" in table else model,
                  hf_baseline=_take(path, where, table, "hf_baseline", bool, True))
    _check_positions(path, where, suite)
    return suite


def _check_positions(path: str, where: str, suite: Suite) -> None:
    if suite.model.preset is None:
        return                                          # a checkpoint's arch is read when the suite runs
    limit = PRESETS[suite.model.preset].max_positions
    if suite.prompt_len + suite.new_tokens > limit:
        raise _err(path, f"{where}: prompt_len + new_tokens = {suite.prompt_len + suite.new_tokens} is above "
                         f"{suite.model.preset}'s {limit} positions")


def load_bench_config(path: str, only: list[str] | None = None) -> BenchConfig:
    """Read and check a bench config; `only` keeps the named suites (--suite)."""
    raw = read_toml(path, "bench config")
    _only(path, "the file", raw, ("model", "run", "layout", "suite"))
    model = _model(path, "[model]", raw.get("model", {}), None)
    layouts = tuple(_layout(path, i, t) for i, t in enumerate(raw.get("layout", [{"name": "1 rank"}])))
    names = [lay.name for lay in layouts]
    if len(set(names)) != len(names):
        raise _err(path, f"[[layout]] names must differ: {names}")
    run = _only(path, "[run]", raw.get("run", {}), ("suites", "repeats", "quiet_wait_s", "timeout_s", "threads",
                                                      "launcher", "python", "backend"))
    tables = _only(path, "[suite]", raw.get("suite", {}), tuple(SUITES))
    order = _take(path, "[run]", run, "suites", list, list(tables) or list(SUITES))
    if only:
        missing = [s for s in only if s not in SUITES]
        if missing:
            raise ConfigError(f"--suite {missing[0]!r} is not a suite; suites: {', '.join(SUITES)}")
        order = [s for s in only]
    suites = tuple(_suite(path, s, tables.get(s, {}), model, set(names)) for s in order)
    launcher = _take(path, "[run]", run, "launcher", list, [])
    if launcher and not all(isinstance(x, str) for x in launcher):
        raise _err(path, f"[run].launcher = {launcher!r} must be a list of strings, e.g. [\"srun\", \"-n\", "
                         f"\"{{ranks}}\"]")
    return BenchConfig(path=path, model=model, layouts=layouts, suites=suites,
                       repeats=_take(path, "[run]", run, "repeats", int, 1, _positive),
                       quiet_wait_s=float(_take(path, "[run]", run, "quiet_wait_s", (int, float), 10.0,
                                                lambda v: (v >= 0, "must be >= 0"))),
                       timeout_s=_take(path, "[run]", run, "timeout_s", int, 300, _positive),
                       threads=_take(path, "[run]", run, "threads", int, 0, lambda v: (v >= 0, "must be >= 0")),
                       launcher=tuple(launcher), python=_take(path, "[run]", run, "python", str, ""),
                       backend=_take(path, "[run]", run, "backend", str, "auto",
                                     lambda v: (v in BACKENDS, f"must be one of {', '.join(BACKENDS)}")))


def resolve_backend(requested: str) -> str:
    """The backend every cell runs on: numpy, cupy, or for auto cupy when cupy sees a GPU here (as make_ops
    resolves it), else numpy. Resolved once in the driver so that the cells' configs name it and the suites can
    plan the GPU-only variants (CUDA graphs)."""
    return resolve_ops_backend(requested)
