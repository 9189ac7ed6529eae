"""`[runtime] cuda_graphs`: decode steps captured once per (micro-batch size, KV bucket) and replayed.

Checked here: every refusal is one ConfigError naming the key and what is allowed (config, then the set-up checks
that need the checkpoint or the resolved comm); on the NumPy backend the key changes nothing. The captured steps
on the CPU fake of cupy are tests/generate/test_paged_graphs.py's. What only a GPU can say (real capture, NCCL
inside the graph, the time saved) is in docs/gpu.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError
from hpcinfer.generate import graphs
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
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


def test_numpy_backend_ignores_the_key():
    source = tiny_models()["llama-like"]
    model = Decoder(NumpyOps(), Groups(), source.arch).load(source)
    prompts = prompts_for(source.arch.vocab_size)
    off, _ = run(model, prompts, False)
    on, times = run(model, prompts, True)
    assert on == off and (times.graph_captures, times.graph_replays) == (0, 0)


# The captured decode steps themselves (paged, the store of every CuPy schedule) are tests/generate/
# test_paged_graphs.py's: tokens equal eager and NumPy, padding rows, cuBLAS keys, quantized pools, later stages.


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
