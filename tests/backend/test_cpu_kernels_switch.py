"""`[runtime] cpu_kernels`: resolved once into NumpyOps.cpu_kernels (backend/cpu_kernels)."""

import pytest

from hpcinfer.backend import cpu_kernels
from hpcinfer.backend.ops import make_ops
from hpcinfer.errors import ConfigError


def test_auto_is_numba_where_it_imports(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "NUMBA_ERROR", None)
    assert cpu_kernels.resolve("auto") == "numba"
    monkeypatch.setattr(cpu_kernels, "NUMBA_ERROR", "ImportError: no numba")
    assert cpu_kernels.resolve("auto") == "numpy"
    assert cpu_kernels.resolve("numpy") == "numpy"


def test_numba_asked_where_it_does_not_import_names_why(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "NUMBA_ERROR", "ImportError: no numba")
    with pytest.raises(ConfigError, match=r"cpu_kernels = \"numba\".*no numba"):
        cpu_kernels.resolve("numba")


def test_unknown_choice_is_an_error():
    with pytest.raises(ConfigError, match=r"cpu_kernels = 'fast' is not one of auto, numba, numpy"):
        cpu_kernels.resolve("fast")


def test_make_ops_passes_the_choice():
    assert make_ops("numpy", cpu_kernels="numpy").cpu_kernels == "numpy"
