"""`hpcinfer profile` and the cluster keys (gpus_per_node, intra/inter-node links): a 1-process run cannot measure
them, keeps the defaults and says so in `notes`; under mpiexec with >= 2 ranks it measures them
(perf/links.measure_ranks) and the notes say that instead."""

from __future__ import annotations

import dataclasses

import pytest

from hpcinfer import cli
from hpcinfer.offload.profile import LINK_FIELDS, HardwareProfile, load_profile

DEFAULTS = {f.name: f.default for f in dataclasses.fields(HardwareProfile) if f.name in LINK_FIELDS}


def test_one_process_profile_marks_its_link_figures_as_defaults(tmp_path):
    out = tmp_path / "one.toml"
    assert cli.main(["profile", "--backend", "numpy", "--out", str(out), "--size", "1MiB",
                     "--disk-dir", str(tmp_path)]) == 0
    profile = load_profile(str(out))
    assert {key: getattr(profile, key) for key in LINK_FIELDS} == DEFAULTS
    assert "defaults, not measured" in profile.notes
    for key in ("gpus_per_node", "intra_node_*", "inter_node_*"):
        assert key in profile.notes


@pytest.mark.mpi(min_size=2)
def test_profile_under_mpiexec_measures_the_links_and_ranks_per_node(tmp_path):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = comm.bcast(str(tmp_path / "ranks.toml") if comm.rank == 0 else None)      # rank 0 writes it
    assert cli.main(["profile", "--backend", "numpy", "--out", out, "--size", "1MiB",
                     "--disk-dir", str(tmp_path)]) == 0
    comm.Barrier()
    if comm.rank != 0:
        return
    profile = load_profile(out)
    assert profile.gpus_per_node == comm.size                      # one machine: every rank shares its memory
    assert "defaults, not measured" not in profile.notes and f"mpiexec -n {comm.size}" in profile.notes
    assert profile.intra_node_latency != DEFAULTS["intra_node_latency"]
    assert profile.intra_node_bandwidth != DEFAULTS["intra_node_bandwidth"]
    assert 0 < profile.intra_node_latency < 1e-2 and profile.intra_node_bandwidth > 1e6
