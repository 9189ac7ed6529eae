"""The jobs/ scripts under a real Slurm: a one-node cluster (and a two-node one) started for these tests and stopped
after (tests/helpers/slurm_cluster.py). Skipped, with the reason, where the Slurm packages are missing or the run is
not root: `make slurm-packages` installs them (.ci/run does).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, unavailable_reason


def _cluster(request, **kwargs) -> SlurmCluster:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(**kwargs)
    request.addfinalizer(cluster.stop)        # also atexit, and the daemons die with this process
    return cluster.start()


@pytest.fixture(scope="session")
def slurm(request) -> SlurmCluster:
    """One node as big as jobs/offload-1gpu.slurm asks (16 CPUs, 100 GB, one GPU: declared, not real; the ranks
    share this machine's cores): every one-node script fits unchanged."""
    return _cluster(request, nodes=1, cpus=16, memory_mb=100_000, gpu=True)


@pytest.fixture(scope="session")
def slurm_2node(request) -> SlurmCluster:
    """Two slurmd on this host (NodeName n1, n2, each its own port), 3 CPUs each: the two-node scripts' shape."""
    return _cluster(request, nodes=2, cpus=3, memory_mb=8000)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """hf_models' tiny llama_mha (4 heads, vocab 256), converted: a checkpoint that loads in a blink."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp("slurm-tiny")
    ckpt = root / "tiny.h5"
    convert_hf(save_tiny_model("llama_mha", root / "hf"), str(ckpt), "float32")
    return ckpt
