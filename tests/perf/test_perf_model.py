"""The performance model's arithmetic against hand-computed cases (hpcinfer/perf, docs/planner.md)."""

from __future__ import annotations

import dataclasses

import pytest

from hpcinfer.arch import ModelArch
from hpcinfer.checkpoint.presets import PRESETS
from hpcinfer.errors import ConfigError
from pipeline_schedule import simulate
from hpcinfer.offload.profile import PRESETS as HARDWARE, HardwareProfile, load_profile
from hpcinfer.parallel.micro_batches import micro_batches
from hpcinfer.perf.comm_cost import Link, Links, all_gather, all_reduce, all_to_all, all_to_all_latency_terms
from hpcinfer.perf.layout import Layout
from hpcinfer.perf.memory import weight_bytes
from hpcinfer.perf.step import Workload, experts_hit, layer_time, predict


def _tiny(**changes) -> ModelArch:
    """D 4, one head of 4, MLP 8, no biases: attention 4 * (4 + 4 + 4) + 4 * 4 = 64 params, MLP 2 * 4 * 8 = 64."""
    base = dict(family="t", vocab_size=16, hidden_size=4, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=4,
                intermediate_size=8, max_positions=64, position="rotary", rotary_dim=4, norm="rmsnorm")
    base.update(changes)
    return ModelArch(**base)


def _hw(flops: float, bandwidth: float, **links) -> HardwareProfile:
    return dataclasses.replace(HARDWARE["dgx-a100-40gb"], device_flops=flops, device_bandwidth=bandwidth, **links)


NO_LINK = Links(Link(0.0, 1e30), Link(0.0, 1e30))
F32 = Workload(1, 1, 1, "float32")               # layer_time reads only its itemsize (and quantization: none)


def test_one_layer_matmuls_compute_bound_and_memory_bound():
    # decode: t = 1 token, m = 1 sequence, c = 10 cached positions, float32
    # FLOPs = 2 * 128 params + 4 * t * c * q = 256 + 160 = 416; bytes = 4 * 128 + c * 2 * kv * 4 = 512 + 320 = 832
    arch, layout = _tiny(), Layout(tp=1, pp=1, dp=1)
    compute, comm = layer_time(arch, 0, layout, 1, 1, 10, F32, _hw(1e3, 1e12), NO_LINK)
    assert compute == pytest.approx(0.416) and comm == 0.0
    compute, _ = layer_time(arch, 0, layout, 1, 1, 10, F32, _hw(1e12, 1e3), NO_LINK)
    assert compute == pytest.approx(0.832)


def test_tensor_parallel_layer_splits_work_and_adds_two_all_reduces():
    arch = _tiny(num_heads=2, num_kv_heads=2, head_dim=2, rotary_dim=2)
    links = Links(Link(1e-3, 1e6), Link(1.0, 1.0))
    compute, comm = layer_time(arch, 0, Layout(tp=2, pp=1, dp=1, ranks_per_node=2), 1, 1, 10, F32, _hw(1e3, 1e12),
                               links)
    assert compute == pytest.approx(0.208)                                 # half of the tp = 1 FLOPs
    # two ring all-reduces of 16 bytes over 2 ranks: 2 messages and 16 bytes each
    assert comm == pytest.approx(2 * (2 * 1e-3 + 16 / 1e6))


def test_ring_all_reduce_and_all_gather():
    link = Link(1e-6, 1e9)
    assert all_reduce(1000, 4, link) == pytest.approx(6e-6 + 1500 / 1e9)   # 2 (p - 1) steps of n / p bytes
    assert all_gather(1000, 4, link) == pytest.approx(3e-6 + 750 / 1e9)
    assert all_reduce(1000, 1, link) == 0.0


def test_flat_all_to_all_splits_peers_by_node():
    # 4 ranks, 2 a node: 3 peers, 1 on the node; 100 bytes each; dispatch and combine
    links = Links(Link(1e-6, 1e9), Link(1e-5, 1e8))
    seconds = all_to_all("flat", 4, 2, 1, 1, 100, links)
    assert seconds == pytest.approx(2 * ((1e-6 + 100 / 1e9) + (2e-5 + 200 / 1e8)))


def test_pcc_cuts_the_latency_term_at_128_gpus_tp8():
    # DeepSpeed Inference V-B: 128 GPUs, tp 8, ep 128: the all-to-all goes from 128 C1 to 16 C1 (+ tp all-gather)
    assert all_to_all_latency_terms("flat", 128, 8, 8) == 127
    assert all_to_all_latency_terms("pcc", 128, 8, 8) == 15 + 7
    links = Links.of(HARDWARE["dgx-a100-40gb"])
    small = dict(rows_per_pair=1 / 128, row_bytes=2 * 2048)               # one token a rank: latency-bound
    assert all_to_all("pcc", 128, 8, 8, links=links, **small) < all_to_all("flat", 128, 8, 8, links=links,
                                                                           **small) / 3


def test_experts_hit():
    assert experts_hit(4, 4, 0) == 0.0
    assert experts_hit(4, 4, 1) == pytest.approx(1.0)
    assert experts_hit(2, 8, 10**6) == pytest.approx(2.0)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("gen_mb", [1, 2, 3, 5])
def test_token_step_matches_the_pipeline_schedule(pp, gen_mb):
    """The closed form max(gen_mb, pp) stage steps per token against pipeline_schedule.simulate's unit play."""
    seqs = 6
    groups = micro_batches(seqs, gen_mb)
    events = simulate(pp, micro_batches(seqs, pp), groups, {s: 6 for s in range(seqs)})
    starts = [e.time for e in events if e.phase == "gen" and e.stage == 0 and e.micro_batch == 0]
    assert all(b - a == max(len(groups), pp) for a, b in zip(starts, starts[1:]))


def test_predict_token_step_is_max_of_micro_batches_and_stages():
    arch = PRESETS["gpt-13b"]
    hw = HARDWARE["dgx-a100-40gb"]
    work = Workload(8, 128, 16, "float16")
    for gmb in (1, 2, 4, 8):
        p = predict(arch, Layout(tp=1, pp=4, dp=1, gen_micro_batches=gmb, prompt_micro_batches=4), work, hw)
        assert p.token_s == pytest.approx(max(gmb, 4) * (p.stage_compute_s + p.stage_comm_s))
        assert p.bubble == pytest.approx(1 - gmb / max(gmb, 4))


def test_decode_of_a_big_dense_model_is_memory_bound():
    # one token of gpt-13b on one A100 reads every weight once: about 26 GB / 1.3 TB/s = 20 ms
    arch, hw = PRESETS["gpt-13b"], HARDWARE["dgx-a100-40gb"]
    p = predict(arch, Layout(tp=1, pp=1, dp=1), Workload(1, 8, 2, "float16"), hw)
    assert p.token_s == pytest.approx(2 * arch.param_count() / hw.device_bandwidth, rel=0.02)


def test_weight_bytes_add_up_over_tp_ranks():
    arch = PRESETS["gpt-13b"]
    whole = weight_bytes(arch, Layout(tp=1, pp=1, dp=1), range(arch.num_layers), True, True, Workload(1, 1, 1))
    assert whole == pytest.approx(2 * arch.param_count(), rel=0.01)
    shard = weight_bytes(arch, Layout(tp=8, pp=1, dp=1), range(arch.num_layers), True, True, Workload(1, 1, 1))
    assert shard == pytest.approx(whole / 8, rel=0.02)


def test_hardware_toml_round_trip_with_links(tmp_path):
    hw = HARDWARE["dgx-h100-80gb"]
    path = tmp_path / "hw.toml"
    path.write_text(hw.to_toml())
    assert load_profile(str(path)) == hw
    path.write_text(hw.to_toml().replace("gpus_per_node = 8", "gpus_per_node = 8.5"))
    with pytest.raises(ConfigError, match="gpus_per_node"):
        load_profile(str(path))


def test_old_profile_files_get_default_links(tmp_path):
    text = "\n".join(line for line in HARDWARE["t4-16gb"].to_toml().splitlines()
                     if not line.startswith(("gpus_per_node", "intra_", "inter_")))
    path = tmp_path / "old.toml"
    path.write_text(text + "\n")
    assert load_profile(str(path)).gpus_per_node == 1


@pytest.mark.mpi(min_size=2)
def test_ping_pong_measures_a_positive_latency_on_ranks_0_and_1():
    from mpi4py import MPI

    from hpcinfer.perf.links import ping_pong

    comm = MPI.COMM_WORLD
    small, large = ping_pong(comm, 8, 20), ping_pong(comm, 4 * 2**20, 3)
    if comm.rank < 2:
        assert 0 < small < large < 5.0                     # a 4 MiB message takes longer than 8 bytes
    else:
        assert small == large == 0.0
