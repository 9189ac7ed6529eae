"""The command line end to end, in subprocesses: convert, inspect, and run alone and under mpiexec.

One tiny llama_mha model (4 heads, 4 KV heads, MLP 96: tp 1, 2 and 4 all fit) is converted once per module.
Every layout (dp, tp, both) must write the very same results as one rank; sampling is seeded per prompt, so it
must too. Every bad input must end the job within the timeout, with exactly one message naming the culprit, exit
status 2 and no output file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import h5py  # noqa: E402

from hf_models import save_tiny_model  # noqa: E402

VOCAB, POSITIONS, HIDDEN = 256, 128, 64           # the tiny llama_mha (tests/helpers/hf_models.py)
PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11)
MAX_NEW = 5
ERROR = "hpcinfer: error"
BAD_TIMEOUT = 60


class Job:
    """The module's converted model, prompts and config; `run` runs the job with extra --set overrides."""

    def __init__(self, root: Path, run_cli, cwd: Path):
        self.root, self._run_cli, self.cwd = root, run_cli, cwd
        self.hf = save_tiny_model("llama_mha", root / "hf")
        self.ckpt = root / "tiny.h5"
        self.prompts = root / "prompts.jsonl"
        self.config = root / "job.toml"

    def cli(self, args, n=1, timeout=120):
        return self._run_cli([str(a) for a in args], n=n, timeout=timeout, cwd=self.cwd)

    def run(self, out_dir: Path, *overrides, n=1, config=None, timeout=120):
        """Run with results in out_dir (output.jsonl, metrics.json); returns the CompletedProcess."""
        sets = [f'generate.output="{out_dir / "output.jsonl"}"', f'generate.metrics="{out_dir / "metrics.json"}"',
                *overrides]
        args = ["run", config or self.config]
        for item in sets:
            args += ["--set", item]
        return self.cli(args, n=n, timeout=timeout)


def config_text(ckpt, prompts, extra: str = "") -> str:
    return (f'[model]\ncheckpoint = "{ckpt}"\n\n'
            f'[generate]\nprompts = "{prompts}"\noutput = "unused.jsonl"\nmax_new_tokens = {MAX_NEW}\n'
            f"batch_size = 2\nignore_eos = true\n{extra}")


@pytest.fixture(scope="module")
def job(tmp_path_factory, run_cli, repo_root):
    job = Job(tmp_path_factory.mktemp("cli"), run_cli, repo_root)
    done = job.cli(["convert", job.hf, job.ckpt])
    assert done.returncode == 0, done.stderr
    assert "converted" in done.stdout and job.ckpt.exists()
    rng = np.random.default_rng(7)
    tokens = [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    job.prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": t}) + "\n" for i, t in enumerate(tokens)))
    job.config.write_text(config_text(job.ckpt, job.prompts))
    return job


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "output.jsonl").read_text().splitlines()]


def mesh_lines(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith("rank ")]


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """The greedy job on one rank: (CompletedProcess, output folder)."""
    out = tmp_path_factory.mktemp("reference")
    return job.run(out), out


# ------------------------------------------------------------------------------------------ convert, inspect

def test_inspect_prints_architecture_tensors_and_ok(job):
    done = job.cli(["inspect", job.ckpt])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert 'family = "llama"' in out and f"vocab_size = {VOCAB}" in out and "tokenizer: none" in out
    for name in ("embed.tokens", "layers.0.attn.q.weight", "layers.1.mlp.down.weight", "final_norm.weight"):
        assert name in out
    assert "tensors (" in out and "check: OK" in out


def test_inspect_of_a_file_that_is_not_a_checkpoint(job, tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["weights"] = np.zeros(4)
    done = job.cli(["inspect", path])
    assert done.returncode == 2
    assert done.stderr.count(ERROR) == 1 and str(path) in done.stderr
    assert "not an hpcinfer checkpoint" in done.stderr and "Traceback" not in done.stderr


def test_convert_of_a_missing_source(job, tmp_path):
    out = tmp_path / "x.h5"
    done = job.cli(["convert", tmp_path / "no-such-model", out])
    assert done.returncode == 2
    assert done.stderr.count(ERROR) == 1 and "no-such-model" in done.stderr
    assert "neither a .gguf file nor a Hugging Face model folder" in done.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------- run

def test_run_alone_writes_results_in_input_order(job, reference):
    done, out = reference
    assert done.returncode == 0, done.stderr
    got = records(out)
    assert [r["id"] for r in got] == [f"p{i}" for i in range(len(PROMPT_LENGTHS))]
    for r in got:
        assert set(r) == {"id", "output_tokens", "finish_reason"}                  # no tokenizer: no text
        assert len(r["output_tokens"]) == MAX_NEW and r["finish_reason"] == "length"
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in r["output_tokens"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["tokens_per_s"] > 0 and metrics["generated_tokens"] == MAX_NEW * len(PROMPT_LENGTHS)
    assert {k: metrics["mesh"][k] for k in ("world", "pp", "dp", "tp")} == {"world": 1, "pp": 1, "dp": 1, "tp": 1}
    assert mesh_lines(done.stdout) == ["rank 0 (node 0): stage 0, dp replica 0, tp rank 0"]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "output.jsonl",   # no temp file left
                                                     "output.jsonl.state.json"]     # (resume state: reliability.md)


def answer_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[p")]


def test_the_console_shows_answers_only_with_echo(job, reference, tmp_path):
    """A batch job's console has the mesh and the summary, not the answers (they are in the output file); with
    [generate] echo it has every answer too, in input order, as the output file holds them. echo is not part of
    the resume fingerprint: the finished job run again with it resumes (nothing left to do) and echoes."""
    done, out = reference
    assert "tokens generated for 6 prompts" in done.stdout and answer_lines(done.stdout) == []
    want = [f"[{r['id']}] {' '.join(map(str, r['output_tokens']))!r} ({r['finish_reason']})" for r in records(out)]
    echoed = job.run(tmp_path / "echo", "generate.echo=true")
    assert echoed.returncode == 0, echoed.stderr
    assert answer_lines(echoed.stdout) == want and records(tmp_path / "echo") == records(out)
    shutil.copytree(out, tmp_path / "again")
    again = job.run(tmp_path / "again", "generate.echo=true")
    assert again.returncode == 0, again.stderr
    assert "6 of them done by an earlier run" in again.stdout and answer_lines(again.stdout) == want


LAYOUTS = {
    "n2-dp2": (2, 1, ["rank 0 (node 0): stage 0, dp replica 0, tp rank 0", "rank 1 (node 0): stage 0, dp replica 1, tp rank 0"]),
    "n2-tp2": (2, 2, ["rank 0 (node 0): stage 0, dp replica 0, tp rank 0", "rank 1 (node 0): stage 0, dp replica 0, tp rank 1"]),
    "n4-tp2-dp2": (4, 2, ["rank 0 (node 0): stage 0, dp replica 0, tp rank 0", "rank 1 (node 0): stage 0, dp replica 0, tp rank 1",
                          "rank 2 (node 0): stage 0, dp replica 1, tp rank 0", "rank 3 (node 0): stage 0, dp replica 1, tp rank 1"]),
}


@pytest.mark.parametrize("n, tp, expected_mesh", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_writes_the_same_results(job, reference, tmp_path, n, tp, expected_mesh):
    done = job.run(tmp_path, f"parallel.tp={tp}", n=n)
    assert done.returncode == 0, done.stderr
    assert f"{n} ranks on 1 node(s), mesh pp=1 dp={n // tp} tp={tp}" in done.stdout
    assert mesh_lines(done.stdout) == expected_mesh
    assert records(tmp_path) == records(reference[1])
    assert (tmp_path / "output.jsonl").read_text() == (reference[1] / "output.jsonl").read_text()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["mesh"]["world"], metrics["mesh"]["dp"], metrics["mesh"]["tp"]) == (n, n // tp, tp)
    assert metrics["generated_tokens"] == MAX_NEW * len(PROMPT_LENGTHS)


# -------------------------------------------------------------------------------------------------- sampling

SAMPLING = ("generate.temperature=0.8", "generate.top_k=20")


@pytest.fixture(scope="module")
def sampled(job, tmp_path_factory):
    """Sampled results with seed 3 on one rank."""
    out = tmp_path_factory.mktemp("sampled")
    done = job.run(out, *SAMPLING, "generate.seed=3")
    assert done.returncode == 0, done.stderr
    return records(out)


@pytest.mark.parametrize("n, tp", [(2, 1), (2, 2)], ids=["dp2", "tp2"])
def test_sampling_is_the_same_on_every_layout(job, sampled, tmp_path, n, tp):
    done = job.run(tmp_path, *SAMPLING, "generate.seed=3", f"parallel.tp={tp}", n=n)
    assert done.returncode == 0, done.stderr
    assert records(tmp_path) == sampled


def test_sampling_depends_on_the_seed(job, sampled, reference, tmp_path):
    greedy = records(reference[1])
    assert sampled != greedy                                         # sampling did sample
    done = job.run(tmp_path, *SAMPLING, "generate.seed=4")
    assert done.returncode == 0, done.stderr
    other = records(tmp_path)
    assert other != sampled
    assert all(len(r["output_tokens"]) == MAX_NEW for r in other)


# ---------------------------------------------------------------------------------------------- bad inputs
# Each case builds its inputs in `tmp` and returns (config path or None, overrides, ranks, fragments the error
# message must hold). All are set-up errors: found on every rank, agreed, reported once by rank 0, exit 2.

def _copy_checkpoint(job, tmp: Path, edit) -> Path:
    path = tmp / "edited.h5"
    path.write_bytes(job.ckpt.read_bytes())
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def _prompt_file(tmp: Path, lines: list[str]) -> Path:
    path = tmp / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def case_malformed_toml(job, tmp):
    path = tmp / "bad.toml"
    path.write_text(config_text(job.ckpt, job.prompts).replace("[generate]", "[generate"))
    return path, [], 2, [str(path), "not valid TOML"]


def case_unknown_key(job, tmp):
    path = tmp / "bad.toml"
    path.write_text(config_text(job.ckpt, job.prompts, "max_new_token = 4\n"))
    return path, [], 2, [str(path), "unknown key 'max_new_token' in [generate]", "max_new_tokens"]


def case_wrong_type(job, tmp):
    path = tmp / "bad.toml"
    path.write_text(config_text(job.ckpt, job.prompts, '\n[parallel]\ntp = "2"\n'))
    return path, [], 2, [str(path), "parallel.tp = '2'", "must be an integer"]


def case_world_not_divisible_by_tp(job, tmp):
    return None, ["parallel.tp=2"], 3, ["world size 3", "[parallel] tp * pp = 2 * 1", "multiple of 2"]


def case_missing_checkpoint(job, tmp):
    path = tmp / "missing.h5"
    return None, [f'model.checkpoint="{path}"'], 2, [f"checkpoint '{path}' does not exist"]


def case_not_a_checkpoint(job, tmp):
    path = tmp / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    return None, [f'model.checkpoint="{path}"'], 2, [str(path), "not an hpcinfer checkpoint"]


def case_not_hdf5(job, tmp):
    path = tmp / "text.h5"
    path.write_text("not hdf5\n")
    return None, [f'model.checkpoint="{path}"'], 2, [str(path), "not a readable HDF5 file"]


def case_other_format_version(job, tmp):
    path = _copy_checkpoint(job, tmp, lambda f: f.attrs.modify("format_version", 3))
    return None, [f'model.checkpoint="{path}"'], 2, [str(path), "format_version 3", "reads versions 1, 2"]


def case_missing_tensor(job, tmp):
    def edit(f):
        del f["layers.1.mlp.down.weight"]

    path = _copy_checkpoint(job, tmp, edit)
    return None, [f'model.checkpoint="{path}"'], 2, [str(path), "missing tensor 'layers.1.mlp.down.weight'"]


def case_wrong_shape(job, tmp):
    def edit(f):
        del f["final_norm.weight"]
        f["final_norm.weight"] = np.ones(HIDDEN - 1, dtype=np.float32)

    path = _copy_checkpoint(job, tmp, edit)
    return None, [f'model.checkpoint="{path}"'], 2, [
        str(path), f"'final_norm.weight' has shape ({HIDDEN - 1},), expected ({HIDDEN},)"]


def case_prompt_not_json(job, tmp):
    path = _prompt_file(tmp, ['{"id": "a", "tokens": [1, 2]}', '{"id": "b", "tokens": [1, 2'])
    return None, [f'generate.prompts="{path}"'], 2, [f"{path}:2:", "not valid JSON"]


def case_token_outside_vocabulary(job, tmp):
    path = _prompt_file(tmp, [json.dumps({"id": "a", "tokens": [1, VOCAB, 2]})])
    return None, [f'generate.prompts="{path}"'], 2, [f"{path}:1:", f"token id {VOCAB}", f"[0, {VOCAB})"]


def case_prompt_too_long(job, tmp):
    path = _prompt_file(tmp, ['{"id": "a", "tokens": [1]}', json.dumps({"id": "b", "tokens": [3] * POSITIONS})])
    return None, [f'generate.prompts="{path}"'], 2, [f"{path}:2:", f"{POSITIONS} tokens",
                                                     f"at most {POSITIONS} positions"]


def case_text_without_tokenizer(job, tmp):
    path = _prompt_file(tmp, ['{"id": "a", "text": "Hello there"}'])
    return None, [f'generate.prompts="{path}"'], 2, [f"{path}:1:", "needs a tokenizer", "the checkpoint has none"]


def case_tp_not_dividing_heads(job, tmp):
    return None, ["parallel.tp=3"], 2, ["tp = 3", "does not divide the model's 4 attention heads",
                                        "tp must be one of [1, 2, 4]"]


def case_output_is_a_directory(job, tmp):
    folder = tmp / "a-folder"
    folder.mkdir()
    return None, [f'generate.output="{folder}"'], 1, ["output", str(folder)]


def case_output_empty(job, tmp):
    return None, ['generate.output=""'], 1, ["output", "''"]


BAD_CASES = [
    case_malformed_toml, case_unknown_key, case_wrong_type, case_world_not_divisible_by_tp,
    case_missing_checkpoint, case_not_a_checkpoint, case_not_hdf5, case_other_format_version, case_missing_tensor,
    case_wrong_shape, case_prompt_not_json, case_token_outside_vocabulary, case_prompt_too_long,
    case_text_without_tokenizer,
    case_tp_not_dividing_heads, case_output_is_a_directory, case_output_empty,
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_bad_input_fails_once_and_clearly(job, tmp_path, case):
    config, overrides, n, fragments = case(job, tmp_path)
    out = tmp_path / "out"
    done = job.run(out, *overrides, n=n, config=config, timeout=BAD_TIMEOUT)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count(ERROR) == 1, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, f"{fragment!r} not in {done.stderr!r}"
    assert "Traceback" not in done.stderr
    assert not (out / "output.jsonl").exists() and not (out / "metrics.json").exists()


def test_tp_not_dividing_heads_lists_the_allowed_values(job):
    """The model check itself (reached on 3 ranks, or first once the order above is fixed)."""
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.errors import ConfigError
    from hpcinfer.parallel.layout import check_tensor_parallel

    with open_checkpoint(str(job.ckpt)) as ckpt:
        for tp in (1, 2, 4):
            check_tensor_parallel(ckpt.arch, tp, "job.toml")
        with pytest.raises(ConfigError, match=r"job.toml: \[parallel\] tp = 3 .* 4 attention heads; "
                                              r"tp must be one of \[1, 2, 4\]"):
            check_tensor_parallel(ckpt.arch, 3, "job.toml")
