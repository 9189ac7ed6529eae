"""The tiny-dense model under [offload], built and run as `hpcinfer run` builds and runs it, for the offload tests
(tests/offload/, tests/mpi/test_mpi_offload_kv_quant.py) and the bench's figures test.

`build` places the Decoder's blocks in their tiers as they load (runtime._weight_tiers); `generate` runs one batch
as job.generate_share does (generate/schedules.run_block: the row or zig-zag schedule of [offload], or the plain
pipeline executor without it). Presets give the weights: no file, no torch. PROMPT_LENGTHS x MAX_NEW greedy tokens
are the workload of every offload test; `window_positions` counts what the zig-zag staging buffers move for it.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.backend.numpy_ops import NumpyOps
from hpcinfer.checkpoint.presets import PRESETS, PresetSource
from hpcinfer.comm.group import Groups
from hpcinfer.config import OffloadSection, load_config
from hpcinfer.generate.engine import GenerationParams, ScheduleParams, StepTimes
from hpcinfer.generate.runner import Runner
from hpcinfer.generate.schedules import run_block, zigzag
from hpcinfer.generate.schedules.pipeline import generate_batch
import kernel_emulator as emulate
from hpcinfer.model.transformer import Decoder
from hpcinfer.runtime import _weight_tiers

PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11, 4, 7)
MAX_NEW = 6
N = len(PROMPT_LENGTHS)
GREEDY = GenerationParams(MAX_NEW, ignore_eos=True)


def preset(name: str, layers: int | None = None) -> PresetSource:
    """A preset's random weights; `layers` narrows or deepens a dense preset (the same init rules)."""
    arch = PRESETS[name]
    if layers is not None:
        arch = dataclasses.replace(arch, num_layers=layers)
    return PresetSource(f"{name}-{layers or arch.num_layers}", arch)


def build(source: PresetSource, off: OffloadSection | None = None, ops=None) -> Decoder:
    """The model as runtime._run builds it: tiers from [offload] (None when inactive), placed block by block."""
    ops = ops or NumpyOps()
    model = Decoder(ops, Groups(), source.arch, "float32")
    if off is not None:
        model.weights = _weight_tiers(types.SimpleNamespace(offload=off), model, ops, 0)
    model.load(source, after_block=model.weights.place if model.weights is not None else None)
    return model


def generate(model: Decoder, prompts: list, off: OffloadSection | None = None, params=GREEDY):
    """Generation as job.generate_share runs one batch: offloaded (row or zig-zag) when [offload] is active."""
    times = StepTimes()
    if off is not None and off.active:
        out = run_block(Runner(model, params), prompts, list(range(len(prompts))), times, ScheduleParams(), off)
    else:
        out = generate_batch(model, prompts, list(range(len(prompts))), params, times)
    if model.weights is not None:
        model.weights.close()
    return out, times


def offload(tmp_path: Path | None = None, **keys) -> OffloadSection:
    """An [offload] section, validated as a config file would be; disk_dir under tmp_path when disk is used."""
    off = OffloadSection(**keys)
    if off.weights_gpu + off.weights_cpu < 100 and off.disk_dir is None:
        off = dataclasses.replace(off, disk_dir=str(tmp_path / "disk"))
    assert off.weights_gpu + off.weights_cpu <= 100 and off.cache_gpu + off.cache_cpu <= 100
    return off


def make_prompts() -> list:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENGTHS]


def config_for(tmp_path: Path, batch_size: int = N, **offload_keys):
    """A job config with this [offload] (the preset name is only for validation; the arch is passed apart)."""
    lines = [f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else
             f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in offload_keys.items()]
    path = tmp_path / "job.toml"
    path.write_text('[model]\npreset = "tiny-dense"\n\n'
                    f'[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\nmax_new_tokens = {MAX_NEW}\n'
                    f"batch_size = {batch_size}\n\n[offload]\n" + "\n".join(lines) + "\n")
    return load_config(str(path))


def host_kvs(monkeypatch) -> list:
    """Instrument zigzag.HostKV: every host KV store a run makes, in order."""
    made = []
    init = zigzag.HostKV.__init__

    def logged(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(zigzag.HostKV, "__init__", logged)
    return made


def window_positions(prompt_lengths=PROMPT_LENGTHS, max_new: int = MAX_NEW) -> tuple[int, int]:
    """Positions per sequence the staging buffers move over a run (loads, stores), summed over the 4 GPU batches
    of 2 and the steps (ignore_eos): a step loads [0, max start) of its batch and stores [min start, max end)."""
    loads = stores = 0
    for k in range(0, len(prompt_lengths), 2):
        lengths = np.array(prompt_lengths[k:k + 2])
        for t in range(max_new):
            starts = np.zeros(2, int) if t == 0 else lengths + t - 1
            ends = lengths if t == 0 else starts + 1
            loads += 2 * starts.max()
            stores += 2 * (ends.max() - starts.min())
    return int(loads), int(stores)


def emulated_cupy_matches_numpy(off, counter: str) -> None:
    """Run tiny-dense under `off` on NumPy and on the stand-in for cupy: the same tokens; the copies the zig-zag
    counts under `counter` ("kv" or "act": <counter>_bytes_to_device / _to_host / _peak_device_bytes) equal
    NumPy's, are > 0, and are exactly the stand-in's asynchronous copies, all from pinned buffers."""
    emu = pytest.importorskip("emu_cupy")
    if emulate.unavailable() is not None:
        pytest.skip(f"kernel emulator unavailable: {emulate.unavailable()}")
    prompts = make_prompts()[:4]
    moved = lambda t: (getattr(t, f"{counter}_bytes_to_device"), getattr(t, f"{counter}_bytes_to_host"))
    want, cpu_times = generate(build(preset("tiny-dense"), off, NumpyOps()), prompts, off)
    with emu.installed():
        from hpcinfer.backend.cupy_ops import CupyOps

        got, gpu_times = generate(build(preset("tiny-dense"), off, CupyOps(device=0)), prompts, off)
        assert emu._state.pageable_async_copies == 0
        assert emu._state.async_copy_bytes == sum(moved(gpu_times)) > 0
    assert got == want
    assert moved(gpu_times) == moved(cpu_times)
    peak = f"{counter}_peak_device_bytes"
    assert np.isclose(getattr(gpu_times, peak), getattr(cpu_times, peak))
