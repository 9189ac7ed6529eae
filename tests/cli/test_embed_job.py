"""`[embed]` jobs through the CLI: the HDF5 output against transformers, the same file at dp=2 and tp=2
(mpiexec -n 2), dp=2 against transformers for every family (and MiniLM) and per token, pooling none, truncation, resumable writes, and the bad inputs (both job sections, a decoder
checkpoint given to [embed] and an encoder to [generate], too-long inputs with truncate = false, empty texts)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import clean_env, run_command
from encoder_models import (MINILM, SENTENCES, hf_hidden_states, mean_pool, minilm_available,
                            save_tiny_encoder)
from hf_models import save_tiny_model
from hpcinfer.checkpoint.hf import convert_hf
from hpcinfer.embed.inputs import EncoderTokenizer
from hpcinfer.embed.output import read_embeddings

REPO = Path(__file__).resolve().parents[2]
TEXTS = SENTENCES + ["the same words again, the same words again and again"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    bert = save_tiny_encoder("bert", root / "bert")
    convert_hf(bert, str(root / "bert.h5"))
    convert_hf(save_tiny_model("gpt2", root / "gpt2"), str(root / "gpt2.h5"))
    lines = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)] + [{"id": "tok", "tokens": [2, 40, 41, 3]}]
    (root / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, bert


def write_config(root, name, model="bert.h5", section="embed", extra="", parallel=""):
    path = root / f"{name}.toml"
    body = (f'inputs = "{root}/in.jsonl"\noutput = "{root}/{name}.h5"\nbatch_size = 3\n'
            f'metrics = "{root}/{name}.json"\n' if section == "embed" else
            f'prompts = "{root}/in.jsonl"\noutput = "{root}/{name}.jsonl"\n')
    path.write_text(f'[model]\ncheckpoint = "{root}/{model}"\n[parallel]\n{parallel}\n[runtime]\nbackend = "numpy"\n'
                    f'threads = 1\n[{section}]\n{body}{extra}')
    return str(path)


def run_ok(run_cli, config, n=1):
    result = run_cli(["run", config], n=n, timeout=120)
    assert result.returncode == 0, result.stderr
    return read_embeddings(config.replace(".toml", ".h5"))


def references(root, bert):
    tokenizer = EncoderTokenizer((root / "bert" / "tokenizer.json").read_text())
    sequences = [tokenizer.encode(t) for t in TEXTS] + [[2, 40, 41, 3]]
    return sequences, hf_hidden_states(bert, sequences)


def test_embed_job_matches_transformers_in_input_order(files, run_cli):
    root, bert = files
    out = run_ok(run_cli, write_config(root, "single"))
    sequences, states = references(root, bert)
    assert out["ids"] == [f"t{i}" for i in range(len(TEXTS))] + ["tok"]
    assert out["lengths"].tolist() == [len(s) for s in sequences]
    assert out["embeddings"].shape == (len(sequences), 64) and out["embeddings"].dtype == np.float32
    assert np.sum(out["embeddings"] * mean_pool(states), axis=1).min() > 0.99999
    assert out["lengths"][TEXTS.index("")] == 2                       # an empty text is [CLS] [SEP]
    metrics = json.loads((root / "single.json").read_text())
    assert metrics["inputs"] == len(sequences) and metrics["truncated_inputs"] == 0
    assert metrics["batches"] == -(-len(sequences) // 3)


@pytest.mark.parametrize("parallel", ["tp = 2", "tp = 1"], ids=["tp2", "dp2"])
def test_two_ranks_write_the_single_rank_file(files, run_cli, parallel):
    root, _ = files
    single = run_ok(run_cli, write_config(root, "ref"))
    name = parallel.replace(" = ", "")
    both = run_ok(run_cli, write_config(root, name, parallel=parallel), n=2)
    assert both["ids"] == single["ids"]
    assert np.abs(both["embeddings"] - single["embeddings"]).max() < 1e-5
    metrics = json.loads((root / f"{name}.json").read_text())
    assert metrics["mesh"] == {"dp": 2 if name == "tp1" else 1, "tp": 2 if name == "tp2" else 1, "ranks": 2}


def dp2_model(files, family):
    """(checkpoint .h5 relative to the module's folder, HF folder) of `family` for a dp = 2 run: the module's
    tiny BERT, a tiny RoBERTa or DistilBERT converted here, or the real MiniLM (skipped without `make minilm`)."""
    root, bert = files
    if family == "bert":
        return "bert.h5", bert
    if family == "minilm":
        if not minilm_available() or not (MINILM.parent / "minilm.h5").is_file():
            pytest.skip(f"needs {MINILM} and models/minilm.h5 (run `make minilm`)")
        return os.path.relpath(MINILM.parent / "minilm.h5", root), str(MINILM)
    folder = save_tiny_encoder(family, root / family)
    convert_hf(folder, str(root / f"{family}.h5"))
    return f"{family}.h5", folder


@pytest.mark.parametrize("family, pooling", [("roberta", "mean"), ("distilbert", "mean"), ("minilm", "mean"),
                                             ("bert", "none")])
def test_data_parallel_matches_transformers(files, run_cli, family, pooling):
    """dp = 2 (each replica embeds every other batch; rank 0 writes) against transformers: mean-pooled
    normalized embeddings by cosine, or pooling none per token within 1e-4 with zero padding."""
    root, _ = files
    h5, folder = dp2_model(files, family)
    name = f"dp2-{family}-{pooling}"
    extra = f'pooling = "{pooling}"\nnormalize = {"true" if pooling == "mean" else "false"}\n'
    out = run_ok(run_cli, write_config(root, name, model=h5, extra=extra, parallel="tp = 1"), n=2)
    assert json.loads((root / f"{name}.json").read_text())["mesh"]["dp"] == 2
    tokenizer = EncoderTokenizer((Path(folder) / "tokenizer.json").read_text())
    sequences = [tokenizer.encode(t) for t in TEXTS] + [[2, 40, 41, 3]]
    states = hf_hidden_states(folder, sequences)
    assert out["ids"] == [f"t{i}" for i in range(len(TEXTS))] + ["tok"]
    assert out["lengths"].tolist() == [len(s) for s in sequences]
    if pooling == "mean":
        assert np.sum(out["embeddings"] * mean_pool(states), axis=1).min() > 0.99999
        return
    for row, n, ref in zip(out["embeddings"], out["lengths"], states):
        assert np.abs(row[:n] - ref).max() < 1e-4 and not row[n:].any()


def test_pooling_none_keeps_every_token_state(files, run_cli):
    root, bert = files
    out = run_ok(run_cli, write_config(root, "none", extra='pooling = "none"\nnormalize = false\n'))
    sequences, states = references(root, bert)
    assert out["embeddings"].shape == (len(sequences), max(map(len, sequences)), 64)
    for row, n, ref in zip(out["embeddings"], out["lengths"], states):
        assert np.abs(row[:n] - ref).max() < 1e-4 and not row[n:].any()


def test_too_long_inputs_truncate_or_fail_naming_the_line(files, run_cli):
    root, bert = files
    config = write_config(root, "cut", extra="max_length = 8\n")
    result = run_cli(["run", config], timeout=120)
    assert result.returncode == 0, result.stderr
    out = read_embeddings(config.replace(".toml", ".h5"))
    long = [i for i, n in enumerate(out["lengths"]) if n == 8]
    assert f"{len(long)} of {len(TEXTS) + 1} inputs are longer than embed.max_length = 8" in result.stderr
    assert long and out["truncated"].sum() == len(long)
    assert json.loads((root / "cut.json").read_text())["truncated_inputs"] == len(long)
    tokenizer = EncoderTokenizer((root / "bert" / "tokenizer.json").read_text())
    assert tokenizer.encode(TEXTS[long[0]], 8)[-1] == 3                # the cut text keeps its [SEP]
    result = run_cli(["run", write_config(root, "strict", extra="max_length = 8\ntruncate = false\n")])
    assert result.returncode == 2
    assert f"in.jsonl:{long[0] + 1}:" in result.stderr and "max_length = 8" in result.stderr


@pytest.mark.parametrize("case", ["both", "decoder-to-embed", "encoder-to-generate", "pooler-missing"])
def test_bad_jobs_fail_clearly(files, run_cli, case):
    root, _ = files
    if case == "both":
        config = write_config(root, "both", extra=f'[generate]\nprompts = "{root}/in.jsonl"\noutput = "x.jsonl"\n')
        expected = ["both [generate] and [embed]"]
    elif case == "decoder-to-embed":
        config = write_config(root, "dec", model="gpt2.h5")
        expected = ["[embed] needs an encoder checkpoint", "gpt2 decoder", "[generate]"]
    elif case == "encoder-to-generate":
        config = write_config(root, "gen", section="generate")
        expected = ["[generate] needs a decoder checkpoint", "bert encoder", "[embed]"]
    else:
        convert_hf(save_tiny_encoder("distilbert", root / "distil"), str(root / "distil.h5"))
        config = write_config(root, "pool", model="distil.h5", extra='pooling = "pooler"\n')
        expected = ["pooling = 'pooler' needs pooler weights"]
    result = run_cli(["run", config], n=2 if case == "decoder-to-embed" else 1, timeout=60)   # n=2: no rank waits
    assert result.returncode == 2, result.stderr
    for text in expected:
        assert text in result.stderr


def test_slurm_script_embeds_with_dp_through_run_local(files):
    """jobs/embed-dp.slurm through jobs/run_local.sh (mpiexec -n 2 instead of srun): dp = 2 replicas."""
    root, _ = files
    env = {"HPCINFER_MODEL": str(root / "bert.h5"), "HPCINFER_OUT": str(root / "slurm"),
           "EMBED_INPUTS": str(root / "in.jsonl"), "HPCINFER_SET": "embed.max_length=128 runtime.backend=\"numpy\""}
    done = run_command(["bash", "jobs/run_local.sh", "-n", "2", "jobs/embed-dp.slurm"], timeout=120,
                       env=clean_env(extra=env), cwd=str(REPO))
    assert done.returncode == 0, done.stdout + done.stderr
    out = read_embeddings(str(root / "slurm" / "embeddings.h5"))
    assert out["ids"][-1] == "tok" and len(out["ids"]) == len(TEXTS) + 1
    assert json.loads((root / "slurm" / "embed-metrics.json").read_text())["mesh"]["dp"] == 2


def test_a_rerun_resumes_and_restart_starts_over(files, run_cli):
    root, _ = files
    config = write_config(root, "again")
    first = run_ok(run_cli, config)
    second = run_ok(run_cli, config)                                   # complete: nothing left to embed
    assert json.loads((root / "again.json").read_text())["embedded_inputs"] == 0
    assert np.array_equal(first["embeddings"], second["embeddings"])
    result = run_cli(["run", config, "--restart"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads((root / "again.json").read_text())["embedded_inputs"] == len(TEXTS) + 1
    changed = run_cli(["run", config, "--set", 'embed.pooling="cls"'], n=2, timeout=120)   # refused at set-up
    assert changed.returncode == 2, changed.stderr
    assert "holds results of a different job" in changed.stderr and "embed.pooling" in changed.stderr
