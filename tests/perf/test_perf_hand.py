"""More of the performance model against hand-computed cases (hpcinfer/perf): the hierarchical, PCC and
pcc+hierarchical all-to-all times, an MoE layer's expert term, the bytes on a rank, and the prompt phase."""

from __future__ import annotations

import dataclasses

import pytest

from hpcinfer.arch import ModelArch
from hpcinfer.offload.profile import PRESETS as HARDWARE
from hpcinfer.perf.comm_cost import Link, Links, all_to_all
from hpcinfer.perf.layout import Layout
from hpcinfer.perf.memory import kv_bytes, rank_memory, weight_bytes, work_bytes
from hpcinfer.perf.step import Workload, layer_time, predict

INTRA, INTER = Link(1e-6, 1e9), Link(1e-5, 1e8)
LINKS = Links(INTRA, INTER)
NO_LINK = Links(Link(0.0, 1e30), Link(0.0, 1e30))
F32 = Workload(1, 1, 1, "float32")               # layer_time reads only its itemsize (and quantization: none)


def _tiny(**changes) -> ModelArch:
    """D 4, one head of 4, MLP 8, vocabulary 16, 2 layers, no biases, untied: attention 4 * 4 * 4 = 64 params,
    MLP 2 * 4 * 8 = 64 (an expert is the same MLP)."""
    base = dict(family="t", vocab_size=16, hidden_size=4, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=4,
                intermediate_size=8, max_positions=64, position="rotary", rotary_dim=4, norm="rmsnorm")
    base.update(changes)
    return ModelArch(**base)


def _hw(flops: float, bandwidth: float, **links):
    return dataclasses.replace(HARDWARE["dgx-a100-40gb"], device_flops=flops, device_bandwidth=bandwidth, **links)


# ---- all-to-all variants: 8 ranks, 4 a node, 1 row of 100 bytes to each peer of a flat exchange ----------------

def test_hierarchical_all_to_all_time():
    # step 1, inside the node: 3 peers, 2 rows each (one per node) = 3 messages, 600 bytes, intra
    # step 2, across nodes: 1 peer (same local index), 4 rows (one per local source) = 1 message, 400 bytes, inter
    # dispatch and combine each run both steps
    expected = 2 * ((3 * 1e-6 + 600 / 1e9) + (1e-5 + 400 / 1e8))
    assert all_to_all("hierarchical", 8, 4, 1, 1, 100, LINKS) == pytest.approx(expected)


def test_pcc_all_to_all_time():
    # tp 2: the exchange runs among 8 / 2 = 4 ranks, 2 of them a node: 3 peers, 1 row each; 1 of the 3 is local
    # (intra: 1 message, 100 bytes; inter: 2 messages, 200 bytes), dispatch and combine; then the combine's
    # all-gather in the tp group (inside the node): 1 message of 4 rows = 400 bytes, once
    expected = 2 * ((1e-6 + 100 / 1e9) + (2 * 1e-5 + 200 / 1e8)) + (1e-6 + 400 / 1e9)
    assert all_to_all("pcc", 8, 4, 2, 1, 100, LINKS) == pytest.approx(expected)


def test_pcc_hierarchical_all_to_all_time():
    # the 4-rank subset exchange done hierarchically, 2 subset ranks a node: intra 1 peer x 2 rows (200 bytes),
    # inter 1 peer x 2 rows (200 bytes), both twice; then the tp all-gather, 1 message of 400 bytes, once
    expected = 2 * (1e-6 + 200 / 1e9) + 2 * (1e-5 + 200 / 1e8) + (1e-6 + 400 / 1e9)
    assert all_to_all("pcc+hierarchical", 8, 4, 2, 1, 100, LINKS) == pytest.approx(expected)


def test_variants_rank_as_the_paper_says_when_latency_bound():
    # tiny messages, slow inter-node latency: fewer inter-node messages win (flat sends 4 inter-node messages)
    times = {kind: all_to_all(kind, 8, 4, 2, 1, 1, LINKS) for kind in ("flat", "hierarchical", "pcc+hierarchical")}
    assert times["pcc+hierarchical"] < times["hierarchical"] < times["flat"]


# ---- an MoE layer -----------------------------------------------------------------------------------------------

def test_moe_layer_adds_the_experts_flops_and_bytes():
    # layer 0 has 4 experts (D 4, F 8: 64 params each); dense part = attention only (64 params)
    # decode: t = 1, m = 1, c = 10, float32, one rank: N = 1 token-choice
    # FLOPs = 2 * 64 + 4 * 1 * 10 * 4 (attention) + 2 * 1 * 64 (one expert) + 2 * 1 * 4 * 4 (gate) = 448
    # bytes = 4 * 64 + 10 * 2 * 4 * 4 (K, V) + 4 * 64 * 1 (experts hit: 4 (1 - (3/4)^1) = 1) = 832
    arch, layout = _tiny(moe_experts=(4, 0)), Layout(tp=1, pp=1, dp=1)
    compute, comm = layer_time(arch, 0, layout, 1, 1, 10, F32, _hw(1e3, 1e12), NO_LINK)
    assert compute == pytest.approx(0.448) and comm == 0.0
    compute, _ = layer_time(arch, 0, layout, 1, 1, 10, F32, _hw(1e12, 1e3), NO_LINK)
    assert compute == pytest.approx(0.832)


def test_moe_layer_over_two_expert_parallel_ranks():
    # dp 2 = ep 2: N = 2 token-choices over the stage, each rank computes 2 / 2 = 1 of them on its 2 experts
    # FLOPs = 128 + 160 + 2 * 2 / 2 * 64 + 32 = 448; expert bytes = 4 * 64 * 2 (1 - (3/4)^2) = 224
    # comm: flat all-to-all between the 2 ranks (one node): 1 message of 1 * 1 / 2 rows x 16 bytes, twice
    arch = _tiny(moe_experts=(4, 0))
    layout = Layout(tp=1, pp=1, dp=2, ep=2, ranks_per_node=2)
    compute, comm = layer_time(arch, 0, layout, 1, 1, 10, F32, _hw(1e3, 1e12), LINKS)
    assert compute == pytest.approx(0.448)
    assert comm == pytest.approx(2 * (1e-6 + 0.5 * 16 / 1e9))
    compute, _ = layer_time(arch, 0, layout, 1, 1, 10, F32, _hw(1e12, 1e3), LINKS)
    assert compute == pytest.approx((256 + 320 + 224) / 1e3)


# ---- bytes on a rank ---------------------------------------------------------------------------------------------

def test_memory_per_rank():
    arch, layout = _tiny(), Layout(tp=1, pp=1, dp=2)
    work = Workload(batch=4, prompt_len=8, gen_len=4, dtype="float32")           # 2 sequences a replica
    # weights: 2 layers x (128 matrix + 4 D norm) + embedding V D + final norm 2 D + LM head V D, float32
    weights = 4 * (2 * (128 + 16) + 64 + 8 + 64)
    assert weight_bytes(arch, layout, range(2), True, True, F32) == weights
    # KV: 4 bytes x K and V x 4 (Hkv hd) x 2 layers x 2 sequences x (8 + 4) positions
    kv = 4 * 2 * 4 * 2 * 2 * 12
    assert kv_bytes(arch, layout, 2, work) == kv
    # workspace, one prompt micro-batch of 2 sequences (16 tokens): 4 x 16 x (4 D + 3 q + 2 F) + float32 scores
    # 4 x 2 x 1 head x 8^2 + float32 logits 4 x 2 x 16
    work_total = 4 * 16 * (16 + 12 + 16) + 4 * 2 * 1 * 64 + 4 * 2 * 16
    assert work_bytes(arch, layout, work) == work_total
    assert rank_memory(arch, layout, work) == weights + kv + work_total
    halves = rank_memory(arch, Layout(tp=1, pp=1, dp=2, prompt_micro_batches=2), work)
    assert halves < weights + kv + work_total                 # smaller prompt micro-batches, smaller workspace


# ---- the prompt phase -----------------------------------------------------------------------------------------

def test_prompt_phase_one_rank():
    # 1 sequence of 8 tokens: per layer 2 * 8 * 128 + 4 * 8 * 8 * 4 = 3072 FLOPs, x 2 layers, + the LM head for the
    # last position 2 * 1 * 64 = 128: 6272 FLOPs at 1000 FLOP/s
    p = predict(_tiny(), Layout(tp=1, pp=1, dp=1), Workload(1, 8, 2, "float32"), _hw(1e3, 1e12))
    assert p.prompt_s == pytest.approx(6.272)


def test_prompt_phase_two_stages_with_the_pipeline_send():
    # pp 2, 2 prompt micro-batches of 1 sequence: (2 + 2 - 1) stage steps of the slowest stage (layer 1 + the
    # head: 3072 + 128 FLOPs = 3.2 s) plus its send of 8 tokens x 4 x 4 bytes = 128 bytes at 0.5 s + 128 B/s
    hw = _hw(1e3, 1e12, intra_node_latency=0.5, intra_node_bandwidth=128.0, inter_node_latency=0.5,
             inter_node_bandwidth=128.0)
    layout = Layout(tp=1, pp=2, dp=1, prompt_micro_batches=2, gen_micro_batches=2)
    p = predict(_tiny(), layout, Workload(2, 8, 2, "float32"), hw)
    assert p.prompt_s == pytest.approx(3 * (3.2 + 0.5 + 1.0))


def test_pipeline_send_across_nodes_uses_the_inter_node_link():
    # 2 stages of 1 rank on nodes of 1 rank: the send between stages crosses nodes
    hw = _hw(1e12, 1e15, intra_node_latency=0.0, intra_node_bandwidth=1e30, inter_node_latency=2.0,
             inter_node_bandwidth=1e30)
    layout = Layout(tp=1, pp=2, dp=1, prompt_micro_batches=2, gen_micro_batches=2, ranks_per_node=1)
    p = predict(_tiny(), layout, Workload(2, 8, 2, "float32"), hw)
    assert p.stage_comm_s == pytest.approx(2.0)


# ---- decode's weight reads at the profile's small-batch rate (gemv_bandwidth) -----------------------------------

def test_token_step_reads_weights_at_the_gemv_bandwidth():
    # 1 sequence, prompt 8, 2 generated: the token step attends c = 8 + 2/2 = 9 positions; compute is free (1e12)
    # and memory reads 1000 B/s. Per layer: weights 4 * 128 = 512 bytes, K and V 9 * 2 * 4 * 4 = 288 bytes; the
    # LM head 16 * 4 * 4 = 256 bytes. Without gemv_bandwidth: (2 * (512 + 288) + 256) / 1000 = 1.856 s.
    # gemv_bandwidth 500: weights at 500, the cache still at 1000: 2 * (512/500 + 288/1000) + 256/500 = 3.136 s.
    # The prompt step keeps the streaming rate: 2 * (512 + 8 * 32) + 256 = 1792 bytes / 1000 = 1.792 s.
    work, layout = Workload(1, 8, 2, "float32"), Layout(tp=1, pp=1, dp=1)
    base = predict(_tiny(), layout, work, _hw(1e12, 1e3))
    slow = predict(_tiny(), layout, work, dataclasses.replace(_hw(1e12, 1e3), gemv_bandwidth=500.0))
    assert base.token_s == pytest.approx(1.856) and slow.token_s == pytest.approx(3.136)
    assert base.prompt_s == slow.prompt_s == pytest.approx(1.792)
    # a gemv figure above the streaming one changes nothing: decode_bandwidth = min(gemv, device_bandwidth)
    fast = predict(_tiny(), layout, work, dataclasses.replace(_hw(1e12, 1e3), gemv_bandwidth=4e3))
    assert fast.token_s == base.token_s


def test_moe_token_step_reads_its_experts_at_the_gemv_bandwidth():
    # test_moe_layer_adds_the_experts_flops_and_bytes's layer, bandwidth-bound at 1000 B/s, gemv 500: the dense
    # weights (256 bytes) and the expert hit (256 bytes) at 500 B/s, K and V (320 bytes) at 1000: 1.344 s; the same
    # layer in a prompt step (decode False) stays at 0.832 s
    arch, layout = _tiny(moe_experts=(4, 0)), Layout(tp=1, pp=1, dp=1)
    hw = dataclasses.replace(_hw(1e12, 1e3), gemv_bandwidth=500.0)
    assert layer_time(arch, 0, layout, 1, 1, 10, F32, hw, NO_LINK, decode=True)[0] == pytest.approx(1.344)
    assert layer_time(arch, 0, layout, 1, 1, 10, F32, hw, NO_LINK)[0] == pytest.approx(0.832)
