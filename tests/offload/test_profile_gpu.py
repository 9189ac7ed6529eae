"""`hpcinfer profile --backend cupy` (hpcinfer/offload/profile_gpu.py): the device terms of the profile come from
the GPU (the link from pinned memory on a copy stream, its matmul and memory bandwidth, its memory), the host terms
stay profile.measure's; run in process on the CPU stand-in for cupy (tests/helpers/emu_cupy/: a subprocess would not see
it). Without a GPU, `--backend cupy` is one clear error."""

from __future__ import annotations

from hpcinfer import cli
from hpcinfer.offload.profile import load_profile


def test_profile_on_cupy_measures_the_gpus_side(emu_cupy, tmp_path, monkeypatch):
    import emu_cupy as emu

    out = tmp_path / "gpu.toml"
    assert cli.main(["profile", "--backend", "cupy", "--out", str(out), "--size", "1MiB",
                     "--disk-dir", str(tmp_path), "--host-memory", "8GiB"]) == 0
    profile = load_profile(str(out))
    assert "Emulated CUDA device" in profile.name and "pinned memory" in profile.notes
    assert "numpy backend" not in profile.notes                    # the memcpy note is replaced, not kept
    assert profile.device_memory == 80 << 30                       # the GPU's memory (the stand-in's total)
    assert profile.host_memory == 8 << 30
    assert profile.host_to_device > 0 and profile.device_to_host > 0 and profile.device_flops > 0
    assert emu._state.async_copies > 0                             # the link was measured with async copies
    assert profile.overlap                                         # the copy engine runs beside the GPU's compute
    assert profile.gemv_bandwidth is None                          # decode reads at the GPU's own bandwidth
    pinned = cli.main(["profile", "--backend", "cupy", "--out", str(tmp_path / "budget.toml"), "--size", "1MiB",
                       "--disk-dir", str(tmp_path), "--device-memory", "2GB"])
    assert pinned == 0 and load_profile(str(tmp_path / "budget.toml")).device_memory == 2 * 10**9


def test_profile_on_numpy_keeps_the_memcpy_figures(tmp_path):
    out = tmp_path / "cpu.toml"
    assert cli.main(["profile", "--backend", "numpy", "--out", str(out), "--size", "1MiB",
                     "--disk-dir", str(tmp_path)]) == 0
    cpu = load_profile(str(out))
    assert "numpy backend" in cpu.notes and not cpu.overlap        # a memcpy shares the cores with the compute


def test_profile_on_cupy_without_a_gpu_is_one_clear_error(tmp_path, capsys, monkeypatch):
    from hpcinfer.backend import cupy_ops

    monkeypatch.setattr(cupy_ops, "gpu_available", lambda: False)
    code = cli.main(["profile", "--backend", "cupy", "--out", str(tmp_path / "x.toml"), "--size", "1MiB"])
    err = capsys.readouterr().err
    assert code == 2 and "backend" in err and "cupy" in err and not (tmp_path / "x.toml").exists()
