"""Shared test setup: markers, paths, the CLI runner, and the rule that one failed rank ends the MPI job.

Under `mpiexec -n N python -m pytest --with-mpi`, a rank whose test fails would go on into the next test's
collective while its peers wait in the failed test's one: the job hangs. So on any failed test report
(setup, call or teardown) with a world of more than one rank, the report goes to stderr and the rank calls
`MPI.COMM_WORLD.Abort(1)` then `os._exit(1)`, which brings every rank down in a few seconds.
"""

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
HELPERS_DIR = TESTS_DIR / "helpers"   # cli_helpers, hf_models, emu_cupy ...: imported by name from any test folder
if str(HELPERS_DIR) not in sys.path:
    sys.path.insert(0, str(HELPERS_DIR))

from cli_helpers import run_cli as _run_cli  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: run under mpiexec with --with-mpi (pytest-mpi; min_size=N ranks)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (real weights, many ranks)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU visible to cupy (skipped elsewhere)")
    config.addinivalue_line("markers", "exhaustive: a kernel's whole test matrix on the emulator (a g++ build per "
                            "variant) or a whole rehearsal of a GPU command; skipped unless HPCINFER_EXHAUSTIVE=1 "
                            "(make test-exhaustive)")
    # Ranks race on pytest's temp-dir cleanup: without an explicit --basetemp, give each rank its own.
    # (tests/run_all.sh passes one; this covers a hand-typed `mpiexec -n 2 python -m pytest --with-mpi`.)
    rank = os.environ.get("PMI_RANK")
    if _with_mpi(config) and rank is not None and config.option.basetemp is None:
        import tempfile

        # The parent (Hydra's proxy) is shared by the ranks of one job on one node.
        config.option.basetemp = str(Path(tempfile.gettempdir()) / f"pytest-mpi-{os.getppid()}-rank{rank}")


def pytest_collection_modifyitems(config, items):
    """`make test` keeps to each kernel's representative cases; `make test-exhaustive` (HPCINFER_EXHAUSTIVE=1) runs
    the whole matrices too (each variant its own g++ build of the emulated kernel: minutes on 2 cores), and the
    gpu-check rehearsal with its end-to-end step."""
    if os.environ.get("HPCINFER_EXHAUSTIVE") == "1":
        return
    skip = pytest.mark.skip(reason="exhaustive: HPCINFER_EXHAUSTIVE=1 (make test-exhaustive) runs it")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def emu_cupy(monkeypatch):
    """The CPU stand-in for cupy (tests/helpers/emu_cupy/), installed for one test: CupyOps(device=0) and
    make_ops("cupy", 0) build on it, its kernels run on the emulator. Yields the fake module."""
    import emu_cupy as emu

    return emu.install(monkeypatch)


def _with_mpi(config):
    try:
        return bool(config.getoption("--with-mpi"))
    except ValueError:  # pytest-mpi not installed
        return False


def _world_size():
    """Size of COMM_WORLD if mpi4py is already imported and MPI is initialised and not finalised, else 1."""
    mpi_module = sys.modules.get("mpi4py.MPI")
    if mpi_module is None:
        return 1
    try:
        if not mpi_module.Is_initialized() or mpi_module.Is_finalized():
            return 1
        return mpi_module.COMM_WORLD.Get_size()
    except Exception:  # noqa: BLE001 - a broken MPI here must not hide the test's own report
        return 1


def _abort_world(report):
    """Print the failed report, then end every rank of the job (never returns)."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    text = report.longreprtext or "(no traceback)"
    sys.stderr.write(
        f"\n=== rank {rank}: {report.nodeid} FAILED during {report.when}; aborting every rank ===\n"
        f"{text}\n"
    )
    for name in ("capstdout", "capstderr"):
        captured = getattr(report, name, "")
        if captured:
            sys.stderr.write(f"--- rank {rank}: captured {name[3:]} ---\n{captured}\n")
    sys.stderr.write(f"FAILED {report.nodeid} (rank {rank}, {report.when})\n")
    sys.stderr.flush()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    if report.failed and _world_size() > 1:
        _abort_world(report)


@pytest.fixture(scope="session")
def repo_root():
    """The repository root (holds pyproject.toml, inputs/, models/)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_bin():
    """The directory of the running interpreter: the venv's bin/, where its mpiexec lives."""
    return Path(sys.executable).parent


@pytest.fixture(scope="session")
def smollm2_float_conversion(tmp_path_factory):
    """SmolLM2's GGUF (models/, or HPCINFER_SMOLLM2_GGUF) converted once per run to a float32 hpcinfer checkpoint:
    (path, the arch convert_gguf returned). Read-only for its users: tests/checkpoint/test_gguf.py checks it against
    transformers, tests/quant/test_quant.py checks a kept-quantized conversion against it (about 4 s a conversion)."""
    gguf_path = REPO_ROOT / os.environ.get("HPCINFER_SMOLLM2_GGUF", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not gguf_path.is_file():
        pytest.skip(f"{gguf_path} not present (make model)")
    pytest.importorskip("gguf")
    from hpcinfer.checkpoint.gguf import convert_gguf

    out = tmp_path_factory.mktemp("smollm2-gguf") / "smollm2.h5"
    return out, convert_gguf(str(gguf_path), str(out))


@pytest.fixture(scope="session")
def run_cli():
    """`run_cli(args, n=1, timeout=120, cwd=None)`: run `python -m hpcinfer ...`, alone or on n ranks."""
    return _run_cli
