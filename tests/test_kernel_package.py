"""The CUDA kernels are package data (issue 20): a wheel carries every cuda_src/ file inside the package, an
installed wheel finds them there, and the CuPy backend with kernels on never runs plain CuPy in place of a kernel
it cannot find or compile.

1. `pip wheel --no-deps --no-build-isolation` of the project holds every cuda_src/*.cu and *.cuh under
   hpcinfer/cuda_src/, and every module of hpcinfer/ (the CPU kernel emulator is test-only: tests/helpers/).
2. That wheel, installed with `pip install --target`, imported from another folder: the loader's CUDA_SRC is in
   the install, not the repository, and every kernel's source (headers inlined) is read from there.
3. CupyOps(kernels=True) on the CPU stand-in of cupy, with the loader pointed at a copy of cuda_src/ lacking a file
   (or a header, or holding a kernel that does not compile): an HpcinferError naming that file.
4. CupyOps(kernels=False) with the loader pointed at an empty folder (and the loader's entry point refusing to be
   called): the tiny presets still give NumPy's greedy tokens.

The wheel is built from a copy of the project's build inputs (setup.cfg, pyproject.toml, hpcinfer/, cuda_src/):
an in-tree build would write build/ and hpcinfer.egg-info/ in the shared checkout. About 7 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.errors import HpcinferError
from hpcinfer.kernels import loader

REPO = Path(__file__).resolve().parents[1]
REPO_CUDA_SRC = REPO / "cuda_src"
KERNEL_FILES = sorted(p.relative_to(REPO_CUDA_SRC).as_posix()
                      for pattern in ("*.cu", "*.cuh") for p in REPO_CUDA_SRC.glob(pattern))
BUILD_INPUTS = ("setup.cfg", "pyproject.toml", "MANIFEST.in", "hpcinfer", "cuda_src")


def _pip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"pip {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("kernel-package")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.is_file():
            shutil.copy2(path, src / name)
    _pip("wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"),
         cwd=tmp)
    (found,) = (tmp / "dist").glob("hpcinfer-*.whl")
    return found


def test_the_wheel_holds_every_kernel_file_inside_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert KERNEL_FILES and all(f.endswith((".cu", ".cuh", ".h")) for f in KERNEL_FILES)
    missing = [f for f in KERNEL_FILES if f"hpcinfer/cuda_src/{f}" not in names]
    assert not missing, f"{wheel.name} lacks hpcinfer/cuda_src/ {missing}"
    assert {f"{name}.cu" for name in loader.KERNELS} <= set(KERNEL_FILES)
    assert not [n for n in names if n.startswith("cuda_src/")]             # inside the package, not beside it
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "hpcinfer").rglob("*.py"))
    assert [m for m in modules if m not in names] == []                      # namespace folders included


_PROBE = """
import json, sys
import hpcinfer
from hpcinfer.kernels import loader
sources = {name: str(loader.source_path(name)) for name in loader.KERNELS}
inlined = {name: loader._INCLUDE.search(loader.kernel_source(name)) is None for name in loader.KERNELS}
print(json.dumps({"package": hpcinfer.__file__, "cuda_src": str(loader.CUDA_SRC), "sources": sources,
                  "inlined": inlined,
                  "headers": sorted(p.name for p in loader.CUDA_SRC.glob("*.cuh"))}))
"""


def test_an_installed_wheel_finds_every_kernel_in_the_install(wheel, tmp_path):
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel), cwd=tmp_path)
    away = tmp_path / "elsewhere"                       # neither the repository nor the install
    away.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=away, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    site = site.resolve()
    assert Path(got["package"]).resolve().parent == site / "hpcinfer"
    assert Path(got["cuda_src"]) == site / "hpcinfer" / "cuda_src"
    assert set(got["sources"]) == set(loader.KERNELS)
    for name, path in got["sources"].items():
        assert Path(path) == site / "hpcinfer" / "cuda_src" / f"{name}.cu"
    assert all(got["inlined"].values()), got["inlined"]           # every local #include found beside the .cu
    assert got["headers"] == sorted(p.name for p in REPO_CUDA_SRC.glob("*.cuh"))


def test_the_source_checkout_uses_its_own_cuda_src():
    assert loader.CUDA_SRC == REPO_CUDA_SRC


# ---- the CuPy backend: a missing or broken kernel is an error, kernels=False never reads one ---------------------
@pytest.fixture
def fake_cupy(monkeypatch):
    """The CPU stand-in for cupy (tests/helpers/emu_cupy/), installed for one test (fresh kernel-loader caches)."""
    emu = pytest.importorskip("emu_cupy", reason="tests/helpers/emu_cupy/ (the CPU stand-in for cupy) is not there")
    return emu.install(monkeypatch)


def _kernel_copy(tmp_path: Path, drop: str | None = None) -> Path:
    copy = tmp_path / "cuda_src"
    shutil.copytree(REPO_CUDA_SRC, copy)
    if drop:
        (copy / drop).unlink()
    return copy


def _norm_inputs(ops):
    rng = np.random.default_rng(0)
    x = ops.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    w = ops.asarray(rng.standard_normal(64).astype(np.float32))
    return x, w


def test_a_missing_kernel_file_is_an_error_naming_it(fake_cupy, monkeypatch, tmp_path):
    from hpcinfer.backend.cupy_ops import CupyOps

    folder = _kernel_copy(tmp_path, drop="rms_norm.cu")
    monkeypatch.setattr(loader, "CUDA_SRC", folder)
    ops = CupyOps(device=0)
    x, w = _norm_inputs(ops)
    with pytest.raises(loader.KernelSourceError) as info:
        ops.rms_norm(x, w, 1e-5)
    assert isinstance(info.value, HpcinferError)
    assert str(folder / "rms_norm.cu") in str(info.value) and "kernels=False" in str(info.value)
    ops.layer_norm(x, w, None, 1e-5)                   # the other kernels load from the substituted folder


def test_a_missing_header_is_an_error_naming_it(fake_cupy, monkeypatch, tmp_path):
    from hpcinfer.backend.cupy_ops import CupyOps

    folder = _kernel_copy(tmp_path, drop="common.cuh")
    monkeypatch.setattr(loader, "CUDA_SRC", folder)
    x, w = _norm_inputs(ops := CupyOps(device=0))
    with pytest.raises(loader.KernelSourceError, match="common.cuh") as info:
        ops.rms_norm(x, w, 1e-5)
    assert str(folder / "common.cuh") in str(info.value)


def test_a_kernel_that_does_not_compile_is_an_error_naming_it(fake_cupy, monkeypatch, tmp_path):
    from hpcinfer.backend.cupy_ops import CupyOps

    folder = _kernel_copy(tmp_path)
    with open(folder / "rms_norm.cu", "a") as f:
        f.write("\n#error broken on purpose (tests/test_kernel_package.py)\n")
    monkeypatch.setattr(loader, "CUDA_SRC", folder)
    x, w = _norm_inputs(ops := CupyOps(device=0))
    with pytest.raises(loader.KernelCompileError) as info:
        ops.rms_norm(x, w, 1e-5)
    assert isinstance(info.value, HpcinferError)
    assert str(folder / "rms_norm.cu") in str(info.value)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_plain_cupy_never_reads_a_kernel_file(fake_cupy, monkeypatch, tmp_path, preset):
    from hpcinfer.api import generate
    from hpcinfer.backend.cupy_ops import CupyOps
    from hpcinfer.backend.numpy_ops import NumpyOps
    from hpcinfer.checkpoint.presets import PRESETS, open_preset
    from hpcinfer.comm.group import Groups
    from hpcinfer.model.transformer import Decoder

    def refuse(*args, **kwargs):
        raise AssertionError(f"kernels=False loaded a kernel: {args}")

    monkeypatch.setattr(loader, "CUDA_SRC", tmp_path)              # empty: any kernel lookup would fail
    monkeypatch.setattr(loader, "kernel", refuse)
    monkeypatch.setattr(loader, "load_module", refuse)
    prompts = [[1, 2, 3, 4, 5], [200, 7]]
    cpu = Decoder(NumpyOps(), Groups(), PRESETS[preset]).load(open_preset(preset))
    gpu = Decoder(CupyOps(device=0, kernels=False), Groups(), PRESETS[preset]).load(open_preset(preset))
    assert generate(gpu, prompts, 4) == generate(cpu, prompts, 4)
