"""Resumable output (generate/resume.py, generate/commit.py), progress, rank-prefixed logging and the fault hook,
in one process. The end-to-end scenarios under mpiexec are in test_reliability_cli.py."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError
from hpcinfer.faults import Faults
from hpcinfer.generate.commit import ResultWriter, generation_fingerprint
from hpcinfer.generate.progress import Progress
from hpcinfer.generate.resume import JsonlLog, Sidecar, config_values, fingerprint
from hpcinfer.logs import setup_logging


def _config(tmp_path, extra=""):
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text('{"id": "a", "tokens": [1, 2]}\n{"id": "b", "tokens": [3]}\n')
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\npreset = "tiny-dense"\n\n[generate]\nprompts = "{prompts}"\n'
                    f'output = "{tmp_path / "out.jsonl"}"\n{extra}')
    return path


# --------------------------------------------------------------------------------------------------- the log

def test_append_then_recover_gives_the_records_back(tmp_path):
    log = JsonlLog(str(tmp_path / "out.jsonl"))
    log.append([{"id": 1, "x": "é"}])
    log.append([{"id": 2}, {"id": 3}])
    assert log.recover() == [{"id": 1, "x": "é"}, {"id": 2}, {"id": 3}]


@pytest.mark.parametrize("tail", [b'{"id": 3, "output_tok', b'{"id": 3}', b"garbage\n"])
def test_a_torn_last_line_is_cut_off_the_file(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    log = JsonlLog(str(path))
    log.append([{"id": 1}, {"id": 2}])
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(tail)
    assert log.recover() == [{"id": 1}, {"id": 2}]
    assert path.read_bytes() == whole                          # appends continue after whole lines
    log.append([{"id": 3}])
    assert log.recover() == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_a_bad_line_before_the_last_is_an_error(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(ConfigError, match=r"out.jsonl:2: not a JSON line.*--restart"):
        JsonlLog(str(path)).recover()


def test_finalize_replaces_the_file_whole(tmp_path):
    path = tmp_path / "out.jsonl"
    log = JsonlLog(str(path))
    log.append([{"id": 2}, {"id": 1}])
    log.finalize([{"id": 1}, {"id": 2}])
    assert path.read_text() == '{"id": 1}\n{"id": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


# ------------------------------------------------------------------------------------- fingerprint, sidecar

def test_the_fingerprint_ignores_output_paths_and_runtime_keys_only(tmp_path):
    base = generation_fingerprint(load_config(str(_config(tmp_path))))
    same = [f'generate.output="{tmp_path / "elsewhere.jsonl"}"', "runtime.threads=3", "runtime.comm_timeout=5",
            'runtime.log_level="debug"', 'runtime.progress="off"', f'generate.metrics="{tmp_path / "m.json"}"']
    for item in same:
        assert generation_fingerprint(load_config(str(_config(tmp_path)), [item]))["digest"] == base["digest"], item
    for item in ["generate.seed=1", "generate.max_new_tokens=7", "generate.batch_size=3", "parallel.tp=2"]:
        assert generation_fingerprint(load_config(str(_config(tmp_path)), [item]))["digest"] != base["digest"], item


def test_the_fingerprint_follows_the_prompt_file_content(tmp_path):
    config = load_config(str(_config(tmp_path)))
    before = generation_fingerprint(config)
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "tokens": [1, 2]}\n')
    assert generation_fingerprint(config)["digest"] != before["digest"]


def test_config_values_flattens_the_sections(tmp_path):
    values = config_values(load_config(str(_config(tmp_path))), exclude={"generate.output"})
    assert values["model.preset"] == "tiny-dense" and values["generate.max_new_tokens"] == 32
    assert "generate.output" not in values and "path" not in values


def test_the_sidecar_resumes_the_same_job_and_refuses_another(tmp_path):
    side = Sidecar(str(tmp_path / "out.jsonl"))
    fp = fingerprint({"config": {"generate.seed": 0}, "prompts": "sha256:1"})
    assert side.start(fp, restart=False) is False                # nothing to resume
    side.write(fp)
    assert side.start(fp, restart=False) is True
    other = fingerprint({"config": {"generate.seed": 1}, "prompts": "sha256:1"})
    with pytest.raises(ConfigError, match=r"config\.generate\.seed: 0 -> 1.*--restart"):
        side.start(other, restart=False)
    assert side.start(other, restart=True) is False


def test_a_damaged_sidecar_is_a_clear_error(tmp_path):
    (tmp_path / "out.jsonl.state.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"out.jsonl.state.json.*--restart"):
        Sidecar(str(tmp_path / "out.jsonl")).start(fingerprint({}), restart=False)


# ----------------------------------------------------------------------------------------------- the writer

def _prompts(n):
    return [SimpleNamespace(id=f"p{i}") for i in range(n)]


def test_the_writer_commits_resumes_and_finishes_in_input_order(tmp_path):
    out = str(tmp_path / "out.jsonl")
    fp = fingerprint({"x": 1})
    first = ResultWriter(out, _prompts(4), None, fp)
    first.commit([(3, [7], "length"), (2, [6], "eos")])            # a round finishes out of order
    again = ResultWriter(out, _prompts(4), None, fp)               # a re-run of the same job
    assert sorted(again.done) == [2, 3] and again.resumed
    again.commit([(0, [4], "length"), (1, [5], "length"), (2, [6], "eos")])    # 2 again: not duplicated
    records = again.finish()
    assert [r["id"] for r in records] == ["p0", "p1", "p2", "p3"]
    assert [json.loads(line)["id"] for line in open(out)] == ["p0", "p1", "p2", "p3"]
    assert json.load(open(out + ".state.json"))["complete"] is True


def test_a_fresh_run_replaces_an_output_without_state(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "p0", "output_tokens": [1], "finish_reason": "length"}\n')
    writer = ResultWriter(str(out), _prompts(1), None, fingerprint({"x": 1}))
    assert writer.done == {} and out.exists()                      # untouched until the first commit
    writer.commit([(0, [9], "eos")])
    assert json.loads(out.read_text())["output_tokens"] == [9]


# --------------------------------------------------------------------------------------- progress, logging

def test_progress_as_a_bar_and_as_log_lines(caplog):
    now = [0.0]
    stream = io.StringIO()
    bar = Progress(10, 2, "bar", stream=stream, clock=lambda: now[0])
    now[0] = 4.0
    bar.update(4, 400)
    assert stream.getvalue().startswith("\r") and "6/10 prompts, 100.0 tokens/s, 0:04 left" in stream.getvalue()
    logger = logging.getLogger("hpcinfer")
    logger.propagate = True
    now[0] = 0.0
    with caplog.at_level(logging.INFO, logger="hpcinfer"):
        lines = Progress(10, 0, "log", stream=io.StringIO(), interval_s=30, clock=lambda: now[0])
        now[0] = 10.0
        lines.update(1, 10)                                       # within the interval: quiet
        now[0] = 40.0
        lines.update(1, 10)
        lines.update(8, 80)                                       # the end always speaks
    assert [r.getMessage() for r in caplog.records] == ["progress: 2/10 prompts, 0.5 tokens/s, 2:40 left",
                                                        "progress: 10/10 prompts, 2.5 tokens/s, 0:00 left"]
    setup_logging(0)                                              # (restores the logger: no propagation)


@pytest.mark.parametrize("rank, level, shown", [(0, "info", ["info", "warning"]), (1, "info", ["warning"]),
                                                (1, "debug", ["debug", "info", "warning"]), (0, "error", [])])
def test_logging_is_rank_prefixed_and_quiet_off_rank_0(rank, level, shown):
    stream = io.StringIO()
    logger = setup_logging(rank, level, stream=stream)
    logger.debug("debug")
    logger.info("info")
    logger.warning("warning")
    assert stream.getvalue().splitlines() == [f"[rank {rank}] {m}" for m in shown]
    setup_logging(0)


# ------------------------------------------------------------------------------------------- the fault hook

def test_the_fault_hook_fires_at_its_point_on_its_rank_only():
    env = {"HPCINFER_FAIL_RANK": "1", "HPCINFER_FAIL_AT": "load"}
    Faults(0, env).at("load")                                      # another rank: nothing
    faults = Faults(1, env)
    faults.at("after_load")
    calls = []
    hook = faults.after_block(calls.append)
    with pytest.raises(RuntimeError, match=r"injected failure on rank 1 at load \(after block 0\)"):
        hook(0)
    assert calls == [0]
    assert Faults(1, {}).after_block(None) is None                 # no hook: no wrapper
    with pytest.raises(RuntimeError, match="HPCINFER_HANG_AT = 'nowhere' is not one of"):
        Faults(0, {"HPCINFER_HANG_RANK": "0", "HPCINFER_HANG_AT": "nowhere"})
