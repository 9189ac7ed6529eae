"""How deep a decode step runs (issue 30: at most 12 frames from the entry point to the first matmul): a one-rank
job in this process, the frames counted at the first matmul of its first decode step. docs/design.md prints the
same path ("One decode step, through the files")."""

from __future__ import annotations

import inspect
import json

import pytest

from hpcinfer import runtime
from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.comm.mpi_library import load_mpi
from hpcinfer.generate.rounds import StopFlag

# runtime._generate down to the op: 12 calls (docs/design.md)
DECODE_PATH = ["_generate", "generate_share", "run_share", "run_sequences", "ContinuousScheduler.run",
               "LocalStage.launch", "Runner.step", "Runner.forward", "Decoder.run_layers", "Block.__call__",
               "Attention.__call__", "ColumnParallelLinear.__call__", "NumpyOps.fused_linear"]


def test_a_decode_step_reaches_its_first_matmul_in_12_frames(tmp_path, monkeypatch):
    paths = []
    fused_linear = NumpyOps.fused_linear

    def recording(self, *args, **kwargs):
        frames = [f.frame for f in inspect.stack(context=0)[1:]]                 # callers of this stand-in
        step = next(f for f in frames if f.f_code.co_name == "step" and "layout" in f.f_locals)
        if step.f_locals["layout"].is_decode and not paths:
            names = [f.f_code.co_qualname for f in reversed(frames)]
            paths.append(names[names.index("_generate"):] + ["NumpyOps.fused_linear"])
        return fused_linear(self, *args, **kwargs)

    monkeypatch.setattr(NumpyOps, "fused_linear", recording)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [i + 1, 2, 3]}) + "\n" for i in range(2)))
    config = tmp_path / "job.toml"
    config.write_text(f'[model]\npreset = "tiny-dense"\n\n[generate]\nprompts = "{prompts}"\n'
                      f'output = "{tmp_path / "out.jsonl"}"\nmax_new_tokens = 3\nbatch_size = 2\nignore_eos = true\n'
                      f'[runtime]\nprogress = "off"\n')
    runtime._run(load_mpi().COMM_WORLD, str(config), [], stop=StopFlag())
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert paths, "no decode step reached NumpyOps.fused_linear"
    assert paths[0] == DECODE_PATH
    assert len(paths[0]) - 1 <= 12                                           # issue 30: at most 12 calls
