"""The jobs/ scripts under a real Slurm: a one-node cluster (and a two-node one) started for these tests and stopped
after (tests/helpers/slurm_cluster.py). Skipped, with the reason, where the Slurm packages are missing or the run is
not root: `make slurm-packages` installs them (.ci/run does).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, SlurmUnsupported, unavailable_reason


def _cluster(request, **kwargs) -> SlurmCluster:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(**kwargs)
    request.addfinalizer(cluster.stop)        # also atexit, and the daemons die with this process
    _stop_on_sigterm(request)
    try:
        return cluster.start()
    except SlurmUnsupported as e:
        pytest.skip(str(e))


def _stop_on_sigterm(request) -> None:
    """SIGTERM to this process (tests/run_all.sh's timeout) unwinds pytest like Ctrl-C, so the finalizers stop the
    cluster and its jobs; without this, only the daemons would go (parent-death signal) and job steps would stay."""
    previous = signal.getsignal(signal.SIGTERM)

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))


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


@pytest.fixture(scope="session")
def tiny_tp3_ckpt(tmp_path_factory) -> Path:
    """A tiny random Llama with 6 heads and 3 KV heads, 2 layers: tp = 3, pp = 2 as inputs/pipeline.toml asks."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp("slurm-tp3")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                                      num_key_value_heads=3, intermediate_size=96, max_position_embeddings=128,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "hf")
    convert_hf(str(root / "hf"), str(root / "tp3.h5"), "float32")
    return root / "tp3.h5"


@pytest.fixture(scope="session")
def tiny_bert_ckpt(tmp_path_factory) -> Path:
    """encoder_models' tiny BERT (with its tokenizer), converted."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from encoder_models import save_tiny_encoder
    from hpcinfer.checkpoint.hf import convert_hf

    root = tmp_path_factory.mktemp("slurm-bert")
    convert_hf(save_tiny_encoder("bert", root / "hf"), str(root / "bert.h5"), "float32")
    return root / "bert.h5"
