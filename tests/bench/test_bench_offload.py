"""bench/offload.py (`make bench-offload`) with --backend cupy, without a GPU: the benchmark's whole
path (bandwidth probes, every setup built as `hpcinfer run` builds it, the record) on the CPU stand-in for cupy
(tests/helpers/emu_cupy/) with the tiny-dense preset written as a checkpoint, next to the same benchmark on the NumPy
backend. The times mean nothing here; the tokens, the copies and the record do.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import emu_cupy as emu
import kernel_emulator as emulate
from bench import offload
from hpcinfer.offload import profile_gpu
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.offload.profile import PRESETS as PROFILES
from moe_models import write_checkpoint

pytestmark = pytest.mark.skipif(emulate.unavailable() is not None,
                                reason=f"kernel emulator unavailable: {emulate.unavailable()}")

TINY = PRESETS["tiny-dense"]          # 4 layers of 192 KiB, 0.9 MB in all: 1.3x the 700 KB budget
ARGS = ["--batch", "4", "--gpu-batches", "2", "--prompt-len", "6", "--new-tokens", "3", "--device-memory", "700KB",
        "--repeats", "1", "--quiet-wait", "0", "--probe-mb", "1", "--no-policy", "--threads", "1"]


def run_bench(backend: str, checkpoint, out, monkeypatch) -> dict:
    """bench.offload.bench on the tiny checkpoint; every run_setup call spied on: its tokens, figures, the
    stand-in's copy counters around it and the device syncs inside it."""
    runs: dict = {}
    real_run, real_sync = offload.run_setup, offload.sync_device
    syncs = []

    def sync(ops):
        syncs.append(ops.name)
        real_sync(ops)

    def spy(setup, prompts, args, work):
        state = emu._state
        del syncs[:]
        before = (state.pageable_async_copies, state.async_copies, state.async_copy_bytes)
        figures = real_run(setup, prompts, args, work)
        after = (emu._state.pageable_async_copies, emu._state.async_copies, emu._state.async_copy_bytes)
        runs[setup.name] = dict(figures, pageable=after[0] - before[0], copies=after[1] - before[1],
                                copy_bytes=after[2] - before[2], syncs=list(syncs))
        return figures

    monkeypatch.setattr(offload, "run_setup", spy)
    monkeypatch.setattr(offload, "sync_device", sync)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, TINY.vocab_size, 6).tolist() for _ in range(4)]
    args = offload.parse_args(["--checkpoint", str(checkpoint), "--out", str(out), "--backend", backend, *ARGS])
    rc = offload.bench(args, TINY, prompts)
    stem = "offload-gpu-*" if backend == "cupy" else "offload-2*"
    (path,) = out.glob(f"{stem}.json")
    return {"rc": rc, "record": json.loads(path.read_text()), "markdown": path.with_suffix(".md").read_text(),
            "runs": runs, "pageable_total": emu._state.pageable_async_copies}


@pytest.fixture(scope="module")
def benches(tmp_path_factory):
    """The same benchmark on the NumPy backend and on CupyOps over the stand-in (about 30 s)."""
    tmp = tmp_path_factory.mktemp("bench-offload")
    checkpoint = tmp / "tiny.h5"
    write_checkpoint(checkpoint, TINY)
    with pytest.MonkeyPatch.context() as mp:
        numpy = run_bench("numpy", checkpoint, tmp / "numpy", mp)
    with emu.installed(), pytest.MonkeyPatch.context() as mp:
        cupy = run_bench("cupy", checkpoint, tmp / "cupy", mp)
    return numpy, cupy


def test_every_setup_runs_on_cupy_with_numpys_tokens(benches):
    numpy, cupy = benches
    assert numpy["rc"] == 0 and cupy["rc"] == 0
    names = {s.name for s in offload.setups(offload.parse_args(ARGS))}
    assert set(cupy["runs"]) == set(numpy["runs"]) == names
    for name, run in cupy["runs"].items():
        assert run["tokens"] == numpy["runs"][name]["tokens"], name
        assert len(run["tokens"]) == 4 and all(len(t) == 3 for t in run["tokens"])
    assert sorted(cupy["record"]["checks"]["same_tokens_as_all_on_device"]) == sorted(names)
    assert cupy["record"]["checks"]["peak_weights_within_budget"]


def test_offloaded_runs_copy_only_from_pinned_memory_on_the_copy_stream(benches):
    """No pageable async copy during any run (the probe's deliberate ones happened before them, and counted); every
    byte the tiers, the KV cache and CPU attention delegation (its q, k, v down, outputs up) moved went through the
    stand-in's queued copies."""
    _, cupy = benches
    assert cupy["pageable_total"] > 0                          # the pageable probe: the counter works
    offloaded = {k: v for k, v in cupy["runs"].items() if v["group"] != "reference"}
    assert offloaded
    for name, run in offloaded.items():
        assert run["pageable"] == 0, name
        moved = run["weights_bytes_from_host"] + run["weights_bytes_from_disk"] + run["kv_bytes_to_device"] + \
            run["kv_bytes_to_host"] + run["attention_bytes_to_host"] + run["attention_bytes_to_device"]
        assert moved > 0 and run["copies"] > 0 and run["copy_bytes"] == moved, name
    assert cupy["runs"]["cache host: zig-zag"]["kv_bytes_to_host"] > 0


def test_every_run_synchronizes_the_device_around_its_clocks(benches):
    numpy, cupy = benches
    for run in cupy["runs"].values():
        assert run["syncs"] == ["cupy"] * 3          # before the load, before the run, before the run's end
    assert all(run["syncs"] == ["numpy"] * 3 for run in numpy["runs"].values())


def test_record_names_the_backend_its_device_and_the_gpu_links(benches):
    numpy, cupy = benches
    rec = cupy["record"]
    assert rec["backend"] == rec["settings"]["backend"] == "cupy"
    assert rec["device"]["backend"] == "cupy" and rec["device"]["device_name"] and rec["device"]["cuda_driver"]
    bw = rec["bandwidth"]
    for key in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "device_flops", "device_copy", "host_read",
                "disk_read_warm", "disk_read_cold"):
        assert bw[key] > 0, key
    assert rec["settings"]["model_bytes"] > rec["settings"]["device_memory"]        # a budget, not the GPU
    assert "pinned host memory on a non-blocking copy stream" in cupy["markdown"]
    assert "on the NumPy backend the device and the host are the same memory" not in cupy["markdown"]
    assert rec["device"]["device_name"] in cupy["markdown"]
    # the NumPy backend's record is as before: no GPU links, its own note
    assert numpy["record"]["backend"] == "numpy" and "h2d_pinned" not in numpy["record"]["bandwidth"]
    assert "on the NumPy backend the device and the host are the same memory" in numpy["markdown"]


def test_gpu_transfer_floor_counts_each_link_once():
    bw = {"h2d_pinned": 10.0, "d2h_pinned": 5.0, "disk_read_warm": 2.0, "disk_read_cold": 1.0, "host_read": 1e9}
    run = {"weights_bytes_from_host": 100, "kv_bytes_to_device": 20, "kv_bytes_to_host": 10,
           "weights_bytes_from_disk": 40, "run_s": 40.0}
    offload.add_floor(run, bw)
    # host: (100 + 20) / 10 + 10 / 5 = 14; disk: 40 / 2 read + 40 / 10 over the link = 24 (cold: 40 + 4)
    assert run["floor_s"] == pytest.approx(14 + 24) and run["floor_cold_s"] == pytest.approx(14 + 44)
    assert run["floor_fraction"] == pytest.approx(38 / 40)
    numpy_bw = {"host_read": 10.0, "disk_read_warm": 2.0, "disk_read_cold": 1.0}
    offload.add_floor(run, numpy_bw)                 # the NumPy backend's floor is unchanged: every host byte, read
    assert run["floor_s"] == pytest.approx(130 / 10 + 40 / 2)


def test_planner_profile_takes_the_gpu_links():
    base = next(iter(PROFILES.values()))
    bw = {"h2d_pinned": 2.5e10, "d2h_pinned": 2.0e10, "device_flops": 5e13, "device_copy": 2e12}
    gpu = profile_gpu.gpu_profile(base, bw)
    assert (gpu.host_to_device, gpu.device_to_host, gpu.device_flops, gpu.device_bandwidth) == \
        (2.5e10, 2.0e10, 5e13, 2e12)
    assert (gpu.disk_to_host, gpu.host_flops, gpu.device_memory) == \
        (base.disk_to_host, base.host_flops, base.device_memory)


def test_policy_search_plans_with_the_gpu_links(tmp_path):
    """On a GPU the LP's profile is the measured one with the GPU's links and compute (bw from the probes), and
    the policy it gives passes the runtime's budget check: a setup to run, not a reported failure."""
    write_checkpoint(tmp_path / "tiny.h5", TINY)
    args = offload.parse_args(["--checkpoint", str(tmp_path / "tiny.h5"), *ARGS])
    bw = {"h2d_pinned": 2.5e10, "d2h_pinned": 2.0e10, "device_flops": 5e13, "device_copy": 2e12}
    setup, details = offload.recommended(args, TINY, 6, 700_000, tmp_path, bw)
    assert setup is not None, details
    assert "GPU links" in details["profile"] and "host->device 25 GB/s" in details["profile"]
    assert setup.keys["gpu_batch_size"] * setup.keys["num_gpu_batches"] == 4
