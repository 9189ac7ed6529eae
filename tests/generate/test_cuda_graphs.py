"""`[runtime] cuda_graphs`: decode steps captured once per (micro-batch size, KV bucket) and replayed.

Checked here: every refusal is one ConfigError naming the key and what is allowed (config, then the set-up checks
that need the checkpoint or the resolved comm); on the NumPy backend the key changes nothing; and on the CPU fake
of cupy (tests/helpers/emu_cupy/: streams record what runs during a capture and replay it on `graph.launch()`, and any
host <-> device copy during a capture raises, as CUDA does) tiny models generate the same greedy tokens with graphs
on, off and on NumPy, over decode steps that cross a KV bucket and replay every graph several times, with one
capture per (batch, bucket) key seen; over the batches of a run, one kept KV cache and its graphs (each key
captured once per run, a longer batch replacing them, a smaller one reusing them). What only a GPU can say (real
capture, NCCL inside the graph, the time saved) is in docs/gpu.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from hpcinfer.backend.cupy_graphs import kv_bucket
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError
from hpcinfer.generate import graphs
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules.pipeline import generate_batch
from hpcinfer.model.transformer import Decoder

BASE = '[model]\ncheckpoint = "m.h5"\n\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n'


def config_of(tmp_path, *sets, base=BASE):
    path = tmp_path / "job.toml"
    path.write_text(base)
    return load_config(str(path), ["runtime.cuda_graphs=true", *sets])


# ------------------------------------------------------------------------------------------------- the config

@pytest.mark.parametrize("sets, fragments", [
    (["runtime.backend='numpy'"], ["backend = \"cupy\""]),
    (["runtime.backend='cupy'", "runtime.comm='mpi'", "parallel.tp=2"], ["tp = 2", "comm = \"nccl\""]),
    (["runtime.backend='cupy'", "offload.schedule='zigzag'"], ["[offload]"]),
    (["runtime.backend='cupy'", "schedule.kv_offload_threshold='1GB'"], ["kv_offload_threshold = 0"]),
    (["runtime.backend='cupy'", "generate.attention_topk=0.25"], ["top-k", "attention_topk = 0"]),
])
def test_refusals_name_the_key_and_what_is_allowed(tmp_path, sets, fragments):
    with pytest.raises(ConfigError) as info:
        config_of(tmp_path, *sets)
    message = str(info.value)
    for fragment in ["job.toml", "runtime.cuda_graphs = true", "cuda_graphs = false", *fragments]:
        assert fragment in message, (fragment, message)


def test_embed_jobs_are_refused(tmp_path):
    base = '[model]\ncheckpoint = "m.h5"\n\n[embed]\ninputs = "i.jsonl"\noutput = "e.h5"\n'
    try:
        config_of(tmp_path, "runtime.backend='cupy'", base=base)
    except ConfigError as exc:
        assert "runtime.cuda_graphs = true applies to [generate] jobs" in str(exc)
    else:
        pytest.fail("an [embed] job with cuda_graphs = true must be refused")


@pytest.mark.parametrize("sets", [
    [],                                                              # backend auto: ignored where it means numpy
    ["runtime.backend='cupy'"],
    ["runtime.backend='cupy'", "parallel.tp=2"],                     # comm auto: checked once resolved
    ["runtime.backend='cupy'", "runtime.comm='nccl'", "parallel.tp=2", "parallel.pp=2"],
    ["runtime.backend='cupy'", "runtime.comm='mpi'", "parallel.pp=2"],   # the pipeline sends stay outside
])
def test_allowed_configs(tmp_path, sets):
    assert config_of(tmp_path, *sets).runtime.cuda_graphs is True


def test_off_by_default_and_out_of_the_resume_fingerprint(tmp_path):
    from hpcinfer.generate.commit import NOT_IN_FINGERPRINT

    path = tmp_path / "job.toml"
    path.write_text(BASE)
    assert load_config(str(path), []).runtime.cuda_graphs is False
    assert "runtime.cuda_graphs" in NOT_IN_FINGERPRINT          # the same tokens either way: a job may resume


def test_moe_models_are_refused_and_numpy_ignores_the_key(tmp_path, caplog):
    config = config_of(tmp_path)
    with pytest.raises(ConfigError, match=r"runtime.cuda_graphs = true cannot capture MoE layers .* set "
                                          r"cuda_graphs = false"):
        graphs.check_model(config, PRESETS["tiny-moe"], NumpyOps())
    with caplog.at_level(logging.INFO, logger="hpcinfer"):
        graphs.check_model(config, PRESETS["tiny-dense"], NumpyOps())
    assert "cuda_graphs = true is ignored" in caplog.text


def test_tp_over_mpi_after_auto_is_refused(tmp_path):
    config = config_of(tmp_path, "runtime.backend='cupy'", "parallel.tp=2")
    graphs.check_comm(config, "nccl")
    graphs.check_comm(config_of(tmp_path, "runtime.backend='cupy'"), "mpi")     # tp = 1: no collective inside
    with pytest.raises(ConfigError, match=r"tp = 2 needs NCCL .* comm = \"auto\" resolved to mpi .* "
                                          r"cuda_graphs = false"):
        graphs.check_comm(config, "mpi")


# ------------------------------------------------------------------------------------------------ the schedule

def tiny_models() -> dict:
    """The GPT-2-like tiny preset (learned positions, LayerNorm, tied head) and a Llama-like one (rotary, RMSNorm,
    GQA, SiLU-gated MLP, untied head)."""
    llama = dataclasses.replace(PRESETS["tiny-dense"], norm="rmsnorm", position="rotary", rotary_dim=16,
                                tied_embeddings=False, num_kv_heads=2, gated_mlp=True, activation="silu",
                                qkv_bias=False, out_bias=False, mlp_bias=False)
    return {"gpt2-like": PresetSource("tiny-dense", PRESETS["tiny-dense"]),
            "llama-like": PresetSource("tiny-llama-gqa", llama)}


# prompt lengths around the first bucket (64): decode steps cross it into 128
PROMPT_LENGTHS = (50, 61, 40)
NEW_TOKENS = 20


def prompts_for(vocab: int, lengths=PROMPT_LENGTHS) -> list:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def run(model, prompts, cuda_graphs: bool, gen_micro_batches: int = 1, new_tokens: int = NEW_TOKENS):
    times = StepTimes()
    out = generate_batch(model, prompts, list(range(len(prompts))), GenerationParams(new_tokens, ignore_eos=True),
                         times, ScheduleParams(1, gen_micro_batches, None, cuda_graphs))
    return [tokens for tokens, _ in out], times


def expected_keys(gen_micro_batches: int, lengths=PROMPT_LENGTHS, new_tokens: int = NEW_TOKENS) -> set:
    """(sequences, bucket) of every decode step: after the prompt step, step j of micro-batch g starts each of its
    sequences at len(prompt) + j - 1."""
    from hpcinfer.parallel.micro_batches import micro_batches

    keys = set()
    for group in micro_batches(len(lengths), gen_micro_batches):
        for j in range(1, new_tokens):
            keys.add((len(group), kv_bucket(max(lengths[i] + j - 1 for i in group) + 1)))
    return keys


def test_numpy_backend_ignores_the_key():
    source = tiny_models()["llama-like"]
    model = Decoder(NumpyOps(), Groups(), source.arch).load(source)
    prompts = prompts_for(source.arch.vocab_size)
    off, _ = run(model, prompts, False)
    on, times = run(model, prompts, True)
    assert on == off and (times.graph_captures, times.graph_replays) == (0, 0)


@pytest.fixture
def fake_cupy(monkeypatch):
    """The CPU fake of cupy (tests/helpers/emu_cupy/), installed for one test."""
    emu = pytest.importorskip("emu_cupy", reason="tests/helpers/emu_cupy/ (the CPU fake of cupy) is not there yet")
    return emu.install(monkeypatch)


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
@pytest.mark.parametrize("gen_micro_batches", [1, 2])
def test_plain_cupy_decode_steps_run_eagerly_and_say_so(fake_cupy, caplog, name, gen_micro_batches):
    """CupyOps' plain-CuPy path calls cuBLAS (matmul) in every decode step, which CuPy refuses under capture: with
    graphs on, every key runs eagerly (nothing captured, nothing replayed), the tokens are NumPy's, one warning
    says why, and the steps are counted as eager."""
    from hpcinfer.backend.cupy_ops import CupyOps

    source = tiny_models()[name]
    prompts = prompts_for(source.arch.vocab_size)
    want, _ = run(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, False, gen_micro_batches)
    model = Decoder(CupyOps(device=0, kernels=False), Groups(), source.arch).load(source)
    eager, eager_times = run(model, prompts, False, gen_micro_batches)
    caplog.clear()
    got, times = run(model, prompts, True, gen_micro_batches)
    assert eager == want and eager_times.graph_eager_steps == 0
    assert got == want
    assert (times.graph_captures, times.graph_replays) == (0, 0)
    assert times.graph_eager_steps == (NEW_TOKENS - 1) * gen_micro_batches
    warnings = [r.getMessage() for r in caplog.records if "run eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "calls cuBLAS" in warnings[0], warnings


def test_more_sequences_than_the_gemv_kernel_takes_run_eagerly_with_the_kernels(fake_cupy):
    """With the kernels on, a decode step of more than SBI_MAX_TOKENS sequences leaves sbi_gemv for cuBLAS: that
    key runs eagerly (no crash, NumPy's tokens), while a smaller micro-batch of the same run is captured."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.backend.cupy_sbi import SBI_MAX_TOKENS

    source, new_tokens = tiny_models()["llama-like"], 3
    lengths = (2,) * (SBI_MAX_TOKENS + 1) + (3,) * 2
    prompts = prompts_for(source.arch.vocab_size, lengths)
    want, _ = run(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, False, new_tokens=new_tokens)
    model = Decoder(CupyOps(device=0, kernels=True), Groups(), source.arch).load(source)
    times = StepTimes()
    schedule = ScheduleParams(1, 1, None, True)
    params = GenerationParams(new_tokens, ignore_eos=True)
    big = generate_batch(model, prompts[:SBI_MAX_TOKENS + 1], list(range(SBI_MAX_TOKENS + 1)), params, times,
                         schedule)
    small = generate_batch(model, prompts[SBI_MAX_TOKENS + 1:], [0, 1], params, times, schedule)
    assert [t for t, _ in big + small] == want
    assert times.graph_eager_steps == new_tokens - 1                  # the 17-sequence key: eager
    assert (times.graph_captures, times.graph_replays) == (1, new_tokens - 1)   # the 2-sequence key: captured


@pytest.mark.parametrize("kv_cache", ["none", "int8"])
def test_graphs_with_the_kernels_give_numpy_tokens(fake_cupy, kv_cache):
    """The cuda_src/ kernels (decode_attention, or decode_attention_quant on an int8 cache, reading the graph's
    device slots and starts; rotary, embedding, norms) captured and replayed; kept short, as the kernel emulator is
    slow: 2 prompts that cross 64 soon."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.quant.kv import kv_format

    source, lengths, new_tokens = tiny_models()["llama-like"], (60, 62), 6
    fmt = kv_format(kv_cache, 16, source.arch.head_dim)
    prompts = prompts_for(source.arch.vocab_size, lengths)
    want, _ = run(Decoder(NumpyOps(), Groups(), source.arch).load(source).set_attention(fmt), prompts, False,
                  new_tokens=new_tokens)
    model = Decoder(CupyOps(device=0, kernels=True), Groups(), source.arch).load(source).set_attention(fmt)
    got, times = run(model, prompts, True, new_tokens=new_tokens)
    assert got == want
    assert expected_keys(1, lengths, new_tokens) == {(2, 64), (2, 128)}
    assert (times.graph_captures, times.graph_replays) == (2, new_tokens - 1)


def test_a_pipeline_stage_replays_from_received_activations(fake_cupy):
    """pp = 2 by hand: stage 0 (embedding, 2 layers) hands its activations to stage 1 (2 layers, head); both run
    their decode steps through graphs, and the logits equal one eager stage's."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.backend.interface import StepLayout
    from hpcinfer.generate.kv_cache import KVCache
    from hpcinfer.parallel.stages import StageSpec

    source = tiny_models()["llama-like"]
    arch, ops = source.arch, CupyOps(device=0, kernels=True)     # the plain path calls cuBLAS: never captured
    whole = Decoder(ops, Groups(), arch).load(source)
    stages = [Decoder(ops, Groups(), arch, stage=StageSpec(s, 2, 2 * s, 2 * s + 2)).load(source) for s in (0, 1)]

    def cache_of(model):
        return KVCache(ops, model.num_local_layers, 2, model.kv_heads_local, 128, arch.head_dim)

    caches = [cache_of(whole)] + [cache_of(m) for m in stages]
    steppers = [Runner(m, GenerationParams(1)) for m in stages]
    runners = [graphs.DecodeGraphs(m, c, s.forward) for m, c, s in zip(stages, caches[1:], steppers)]
    prompts = prompts_for(arch.vocab_size)[:2]
    step = StepLayout.build([0, 1], [0, 0], [len(p) for p in prompts])
    tokens = np.concatenate([np.asarray(p) for p in prompts])
    want = whole.forward(tokens, step, caches[0])
    x = steppers[0].forward(caches[1], {"tokens": tokens}, step)
    got = steppers[1].forward(caches[2], {"x": ops.to_host(x)}, step)
    np.testing.assert_allclose(ops.to_host(got), ops.to_host(want), rtol=1e-5, atol=1e-5)
    for j in range(5):                                             # prompts of 50 and 61: buckets 64, then 128
        next_tokens = np.argmax(ops.to_host(want), axis=-1)
        step = StepLayout.build([0, 1], [len(p) + j for p in prompts], [1, 1])
        want = whole.forward(next_tokens, step, caches[0])
        x = runners[0](step, {"tokens": next_tokens})
        x = ops.to_host(x) if j % 2 else x.copy()                  # as over MPI (host) or NCCL (device)
        got = runners[1](step, {"x": x})
        np.testing.assert_allclose(ops.to_host(got), ops.to_host(want), rtol=1e-5, atol=1e-5)
    assert [r.captures for r in runners] == [2, 2]                  # (2, 64) and (2, 128)


# ------------------------------------------------------------------------------- graphs kept across batches

def run_batches(model, prompts, batch_size: int, cuda_graphs: bool, gen_micro_batches: int = 1,
                new_tokens: int = NEW_TOKENS):
    """As job.generate_share: one Runner, ScheduleParams and StepTimes for the run, one run_batch per batch of
    `batch_size` prompts (the last one may be smaller). Returns the tokens, the times, and the kept KV cache after
    each batch (None with graphs off); the run's graphs are closed at the end."""
    from hpcinfer.generate.runner import Runner
    from hpcinfer.generate.schedules.pipeline import run_batch

    schedule = ScheduleParams(1, gen_micro_batches, None, cuda_graphs)
    runner = Runner(model, GenerationParams(new_tokens, ignore_eos=True))
    times, tokens, caches = StepTimes(), [], []
    for first in range(0, len(prompts), batch_size):
        ids = list(range(first, min(first + batch_size, len(prompts))))
        out = run_batch(runner, [prompts[i] for i in ids], ids, times, schedule)
        tokens += [t for t, _ in out]
        kept = runner.graphs.graphs
        caches.append(None if kept is None else kept.cache)
    kept = runner.graphs.graphs
    runner.close()
    assert runner.graphs.graphs is None and (kept is None or not kept.graph.captured)
    return tokens, times, caches


def decode_keys(lengths, new_tokens: int, positions: int = 128) -> set:
    """(running sequences, bucket) of every decode step of one micro-batch of prompts `lengths`: a sequence makes
    min(new_tokens, positions - length) tokens (it stops at the model's positions), the first from the prompt
    step; decode step j reads positions up to length + j - 1."""
    made = [min(new_tokens, positions - n) for n in lengths]
    keys = set()
    for j in range(1, max(made)):
        running = [n for n, m in zip(lengths, made) if j < m]
        keys.add((len(running), kv_bucket(max(running) + j)))
    return keys


@pytest.mark.parametrize("name, gen_micro_batches", [("gpt2-like", 1), ("llama-like", 2)])
def test_batches_of_one_size_capture_each_key_once_per_run(fake_cupy, name, gen_micro_batches):
    """6 prompts in 3 batches of 2 on one kept cache (every batch's longest sequence rounds up to 128 positions),
    with the kernels (the plain path is never captured): NumPy's tokens, and one capture per (sequences, bucket) key of the whole run, not one
    per key and batch; every decode step replayed."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.parallel.micro_batches import micro_batches

    source, lengths, new_tokens = tiny_models()[name], (50, 61, 40, 58, 55, 62), 8
    prompts = prompts_for(source.arch.vocab_size, lengths)
    want, _, _ = run_batches(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, 2, False,
                             gen_micro_batches, new_tokens)
    model = Decoder(CupyOps(device=0, kernels=True), Groups(), source.arch).load(source)
    got, times, caches = run_batches(model, prompts, 2, True, gen_micro_batches, new_tokens)
    assert got == want
    assert caches[0] is caches[1] is caches[2] and caches[0].max_len == 128        # reset, not reallocated
    per_batch = [set().union(*(decode_keys([lengths[b + i] for i in group], new_tokens)
                               for group in micro_batches(2, gen_micro_batches))) for b in (0, 2, 4)]
    keys = set().union(*per_batch)
    assert any(bucket > 64 for _, bucket in keys)                   # the run crosses a bucket boundary
    assert sum(len(k) for k in per_batch) > len(keys)                # a capture per batch would count more
    assert times.graph_captures == len(keys)
    assert times.graph_replays == 3 * (new_tokens - 1) * gen_micro_batches


@pytest.mark.parametrize("kv_cache", ["none", "int8"])
def test_kept_graphs_with_the_kernels_give_numpy_tokens(fake_cupy, kv_cache):
    """The kernels' path (as test_graphs_with_the_kernels_give_numpy_tokens) over 2 batches of 2 on one kept
    cache, zeroed in place in between (a float or an int8 cache): NumPy's tokens, and the 2 keys captured once."""
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.quant.kv import kv_format

    source, lengths, new_tokens = tiny_models()["llama-like"], (60, 62, 61, 59), 6
    fmt = kv_format(kv_cache, 16, source.arch.head_dim)
    prompts = prompts_for(source.arch.vocab_size, lengths)
    want, _, _ = run_batches(Decoder(NumpyOps(), Groups(), source.arch).load(source).set_attention(fmt), prompts,
                             2, False, new_tokens=new_tokens)
    model = Decoder(CupyOps(device=0, kernels=True), Groups(), source.arch).load(source).set_attention(fmt)
    got, times, caches = run_batches(model, prompts, 2, True, new_tokens=new_tokens)
    assert got == want and caches[0] is caches[1]
    assert (times.graph_captures, times.graph_replays) == (2, 2 * (new_tokens - 1))


@pytest.mark.parametrize("order, captures, cache_of_batch", [
    ("longest first", 4, [0, 0, 0, 0]),         # (2,128) (1,128); + (2,64); (2,64) kept; + (1,64)
    ("shorter first", 5, [0, 1, 1, 1]),         # (2,64) on 64 positions; a cache of 128: (2,128) (1,128), (2,64)
])                                              # again; + (1,64)
def test_smaller_and_longer_batches(fake_cupy, order, captures, cache_of_batch):
    """7 prompts in batches of 2, 2, 2 and 1; one batch has a prompt that stops early at the model's 128 positions
    (its partner goes on alone: keys with 1 sequence). A batch that fits the kept cache (fewer sequences, shorter
    ones) reuses it and its graphs; a longer one replaces it (a new cache, captured again). Tokens as NumPy's."""
    from hpcinfer.backend.cupy_ops import CupyOps

    source, new_tokens = tiny_models()["llama-like"], 10
    long, short, reuse, last = (60, 122), (40, 45), (62, 57), (50,)
    lengths = (*long, *short, *reuse, *last) if order == "longest first" else (*short, *long, *reuse, *last)
    prompts = prompts_for(source.arch.vocab_size, lengths)
    want, _, _ = run_batches(Decoder(NumpyOps(), Groups(), source.arch).load(source), prompts, 2, False,
                             new_tokens=new_tokens)
    model = Decoder(CupyOps(device=0, kernels=True), Groups(), source.arch).load(source)
    got, times, caches = run_batches(model, prompts, 2, True, new_tokens=new_tokens)
    assert got == want
    assert [[c is d for d in caches].index(True) for c in caches] == cache_of_batch
    assert caches[-1].n_seqs == 2 and caches[-1].max_len == 128
    assert (1, 128) in decode_keys(long, new_tokens)                 # the early stop is in the run
    assert times.graph_captures == captures                          # a capture per batch and key: 6
    assert times.graph_replays == sum(max(min(new_tokens, 128 - n) for n in lengths[b:b + 2]) - 1
                                      for b in range(0, 7, 2))


# ------------------------------------------------------------------------------------------------ hpcinfer run

def _job(root, preset: str) -> str:
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "a", "tokens": [5, 17, 200, 3]}\n{"id": "b", "tokens": [9, 8]}\n')
    config = root / "job.toml"
    config.write_text(f'[model]\npreset = "{preset}"\n\n[generate]\nprompts = "{prompts}"\n'
                      f'output = "{root / "out.jsonl"}"\nmax_new_tokens = 4\nignore_eos = true\n'
                      f'metrics = "{root / "metrics.json"}"\n\n'
                      f'[runtime]\ncuda_graphs = true\nlog_level = "info"\n')
    return str(config)


def test_hpcinfer_run_checks_the_model_and_ignores_the_key_without_a_gpu(tmp_path, run_cli, repo_root):
    from hpcinfer.backend.cupy_ops import gpu_available

    done = run_cli(["run", _job(tmp_path, "tiny-moe")], n=1, cwd=repo_root)
    assert done.returncode == 2 and "cannot capture MoE layers" in done.stderr, done.stderr
    done = run_cli(["run", _job(tmp_path, "tiny-dense")], n=1, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    if not gpu_available():
        assert "cuda_graphs = true is ignored" in done.stderr
        metrics = json.loads((tmp_path / "metrics.json").read_text())
        assert metrics["cuda_graphs"] == {"captures_per_rank": 0, "replays_per_rank": 0, "eager_steps_per_rank": 0}
