"""Messages and bytes per rank of each all-to-all schedule at simulated world sizes (no MPI)."""

import pytest

from hpcinfer.comm.all_to_all import message_stats

RPN, ROWS, ROW_BYTES = 8, 4, 4096 * 2 + 8          # 8 ranks a node; 4 rows a pair of a bf16 [4096] row + int64 id
WORLDS, TPS = [8, 16, 64, 128, 256], [1, 2, 8]
KINDS = ["flat", "hierarchical", "pcc", "pcc+hierarchical"]


def stats(kind, world, tp, rows=ROWS, rpn=RPN):
    out = message_stats(kind, world, rpn, tp, rows, ROW_BYTES)
    assert out["messages"] == sum(s["messages"] for s in out["steps"])
    assert out["bytes"] == sum(s["bytes"] for s in out["steps"])
    assert all(isinstance(s["what"], str) and s["what"] for s in out["steps"])
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_flat_and_hierarchical(world):
    g, m, pair = RPN, world // RPN, ROWS * ROW_BYTES
    flat, hier = stats("flat", world, 1), stats("hierarchical", world, 1)
    assert flat["messages"] == world - 1 and flat["bytes"] == (world - 1) * pair
    assert hier["messages"] == (g - 1) + (m - 1)
    # hop 1: M pairs' rows to each of G - 1 local peers; hop 2: G pairs' rows to each of M - 1 nodes
    assert [s["bytes"] for s in hier["steps"]] == [(g - 1) * m * pair, (m - 1) * g * pair]
    if world > g > 1:
        assert hier["messages"] < flat["messages"]
        assert flat["bytes"] < hier["bytes"] < 2 * flat["bytes"]            # rows crossing twice: the price


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("world", WORLDS)
def test_pcc(world, tp):
    subset, pair = world // tp, ROWS * ROW_BYTES
    flat, pcc = stats("flat", world, tp), stats("pcc", world, tp)
    assert pcc["messages"] == (subset - 1) + (tp - 1)
    assert [s["messages"] for s in pcc["steps"]] == [subset - 1, tp - 1]
    assert pcc["steps"][-1]["bytes"] == (tp - 1) * subset * pair           # all-gather of the rank's share
    assert pcc["bytes"] == flat["bytes"]                                     # same volume, fewer messages
    if 1 < tp < world:
        assert pcc["messages"] < flat["messages"]
    else:                                   # tp = 1: the flat exchange; tp = world: the all-gather alone
        assert pcc["messages"] == flat["messages"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("world", WORLDS)
def test_pcc_hierarchical(world, tp):
    subset, g_sub, nodes = world // tp, RPN // tp, world // RPN
    both = stats("pcc+hierarchical", world, tp)
    assert both["messages"] == (g_sub - 1) + (nodes - 1) + (tp - 1)
    assert [s["messages"] for s in both["steps"]] == [g_sub - 1, nodes - 1, tp - 1]
    assert both["steps"][-1] == stats("pcc", world, tp)["steps"][-1]         # the same tp all-gather
    assert both["messages"] <= stats("pcc", world, tp)["messages"]
    assert both["messages"] <= stats("hierarchical", world, tp)["messages"]
    if tp == 1:
        assert both["steps"] == stats("hierarchical", world, 1)["steps"] + [both["steps"][-1]]
    assert subset == g_sub * nodes


def test_hand_computed_world_16():
    """16 ranks, 8 a node, tp 2, one 10-byte row a pair."""
    got = {k: message_stats(k, 16, 8, 2, 1, 10) for k in KINDS}
    assert {k: (v["messages"], v["bytes"]) for k, v in got.items()} == {
        "flat": (15, 150),
        "hierarchical": (7 + 1, 7 * 2 * 10 + 1 * 8 * 10),
        "pcc": (7 + 1, 7 * 10 + 1 * 8 * 10),
        "pcc+hierarchical": (3 + 1 + 1, 3 * 2 * 10 + 1 * 4 * 10 + 1 * 8 * 10)}


def test_empty_pairs_send_no_message():
    for kind in KINDS:
        out = message_stats(kind, 64, 8, 2, 0, ROW_BYTES)
        assert out["messages"] == 0 and out["bytes"] == 0


def test_degenerate_nodes_are_one_step():
    one_node, one_a_node = stats("hierarchical", 8, 1, rpn=8), stats("hierarchical", 8, 1, rpn=1)
    assert [s["messages"] for s in one_node["steps"]] == [7, 0]
    assert [s["messages"] for s in one_a_node["steps"]] == [0, 7]
    assert one_node["bytes"] == one_a_node["bytes"] == stats("flat", 8, 1)["bytes"]


@pytest.mark.parametrize("args, match", [
    (("ring", 8, 8, 1), "not one of"),
    (("flat", 12, 8, 1), "must divide the world size 12"),
    (("pcc", 8, 8, 3), "must divide the world size 8"),
    (("pcc+hierarchical", 16, 2, 4), "tp = 4 must divide ranks_per_node = 2"),
])
def test_bad_layouts_are_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        message_stats(*args, ROWS, ROW_BYTES)
