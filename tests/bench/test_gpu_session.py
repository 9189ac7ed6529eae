"""The GPU session's tools, on this machine (docs/gpu.md, "Later calls"): gpu/carry.py
splits the GGUF into parts that join back to the same bytes (sha256 recorded) and writes MiniLM in float16;
gpu/session.sh runs steps in order, records each one's exit code, moves carried parts aside, and refuses a
GGUF whose parts do not join to the recorded sha256 (a part lost when the machine went back between calls).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gpu import carry as gpu_carry

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "gpu" / "session.sh"


def test_gguf_parts_join_to_the_recorded_sha256(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=100_003, dtype=np.uint8).tobytes()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data)
    gpu_carry.split_gguf(gguf, tmp_path / "carry")
    parts = [tmp_path / "carry" / f"part{k + 1}" / f"gguf.part-{k}" for k in range(gpu_carry.GGUF_PARTS)]
    assert all(p.stat().st_size < len(data) for p in parts)
    joined = b"".join(p.read_bytes() for p in parts)
    recorded = (tmp_path / "carry" / "part1" / "gguf.sha256").read_text().split()
    assert joined == data and recorded == [hashlib.sha256(data).hexdigest(), "model.gguf"]


def test_minilm_is_carried_in_float16_with_its_other_files(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "minilm"
    folder.mkdir()
    weights = {"w": np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32),
               "ids": np.arange(5, dtype=np.int64)}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    gpu_carry.minilm_float16(folder, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got["w"].dtype == np.float16 and np.array_equal(got["w"], weights["w"].astype(np.float16))
    assert got["ids"].dtype == np.int64 and np.array_equal(got["ids"], weights["ids"])
    assert (tmp_path / "out" / "config.json").read_text() == "{}"


def session(tmp_path, *steps, cwd=None):
    env = dict(os.environ, OUT=str(tmp_path / "out"), CARRY=str(tmp_path / "stash"), STEP_TIMEOUT="60",
               COMMIT="abc123")
    done = subprocess.run(["bash", str(SCRIPT), *steps], cwd=cwd or tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    summary = [line.split() for line in (tmp_path / "out" / "summary.txt").read_text().splitlines()]
    return done, summary, (tmp_path / "out" / "session.log").read_text()


@pytest.mark.skipif(subprocess.run(["which", "bash"], capture_output=True).returncode != 0, reason="no bash")
def test_the_session_stashes_parts_and_records_every_step(tmp_path):
    (tmp_path / ".carry" / "part2").mkdir(parents=True)
    (tmp_path / ".carry" / "part2" / "gguf.part-1").write_bytes(b"xyz")
    done, summary, log = session(tmp_path, "stash", "nonsense", "models")
    assert [row[:2] for row in summary] == [["stash", "0"], ["nonsense", "unknown"], ["models", "1"]]
    assert (tmp_path / "stash" / "gguf.part-1").read_bytes() == b"xyz"          # moved aside, kept
    assert not (tmp_path / ".carry" / "part2" / "gguf.part-1").exists()
    assert "unknown step 'nonsense'" in log


def test_a_lost_part_is_refused_before_any_conversion(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 40
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(data)
    gpu_carry.split_gguf(gguf, tmp_path / ".carry")
    (tmp_path / ".carry" / "part2" / "gguf.part-1").unlink()                   # the machine went back
    done, summary, log = session(tmp_path, "stash", "models")
    assert summary[-1][:2] == ["models", "1"]
    assert "does not match gguf.sha256" in log and "converted" not in log
    assert not (tmp_path / "stash" / gguf.name).exists()


def test_truncated_checkpoint_keeps_the_first_layers_and_verifies(tmp_path):
    """make gpu-carry's SmolLM2 for the gpu-check call: a checkpoint cut to its first layers opens, verifies (the
    integrity manifest made anew) and runs as a shallower model of the same architecture."""
    import numpy as np

    from hpcinfer.api import generate, load_model
    from hpcinfer.arch import tensor_shapes
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.checkpoint.presets import PRESETS
    from hpcinfer.checkpoint.writer import CheckpointWriter

    arch, rng = PRESETS["tiny-dense"], np.random.default_rng(0)
    whole = tmp_path / "whole.h5"
    with CheckpointWriter(str(whole), arch) as writer:
        for name, shape in tensor_shapes(arch).items():
            writer.add(name, rng.standard_normal(shape, dtype=np.float32) * 0.1)
    cut = tmp_path / "cut.h5"
    gpu_carry.truncated_checkpoint(whole, cut, 2)
    with open_checkpoint(str(cut)) as ckpt:
        assert ckpt.arch.num_layers == 2
        assert ckpt.verify()["datasets"] == len(tensor_shapes(ckpt.arch))
        assert not any(name.startswith(("layers.2.", "layers.3.")) for name in ckpt.file)
    assert len(generate(load_model(str(cut)), [[5, 17, 200]], 4)[0]) == 4
