"""Communication time on the two link classes: alpha-beta costs of the collectives a layout runs.

A message of n bytes over a link costs latency + n / bandwidth (alpha + n beta). Links are per rank: `bandwidth` is
what one rank sends at while its peers send too (intra-node: NVLink/NVSwitch or shared memory; inter-node: the
rank's share of its node's network). Collectives use the ring algorithms' step counts (NCCL's and MPICH's for
large messages). The MoE all-to-all takes its message and byte counts from comm/all_to_all.message_stats, the
accounting of the very schedules the dispatcher runs; this module only says which link each step travels on.

p=ranks in the collective  g=of them on one node  n=bytes  tp=tensor-parallel degree
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.all_to_all import message_stats


@dataclass(frozen=True)
class Link:
    latency: float               # s per message (alpha)
    bandwidth: float             # B/s one rank sends at (1 / beta)

    def send(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds for `messages` messages carrying `nbytes` in all."""
        return messages * self.latency + nbytes / self.bandwidth if messages > 0 else 0.0


@dataclass(frozen=True)
class Links:
    intra: Link                  # between ranks of one node
    inter: Link                  # between nodes

    @classmethod
    def of(cls, profile) -> "Links":
        """The two link classes of a HardwareProfile (offload/profile.py LINK_FIELDS)."""
        return cls(Link(profile.intra_node_latency, profile.intra_node_bandwidth),
                   Link(profile.inter_node_latency, profile.inter_node_bandwidth))

    def pick(self, across_nodes: bool) -> Link:
        return self.inter if across_nodes else self.intra


def all_reduce(nbytes: float, p: int, link: Link) -> float:
    """Ring all-reduce of an n-byte array: 2 (p - 1) steps, each moving n / p bytes."""
    return 0.0 if p <= 1 else link.send(2.0 * (p - 1) / p * nbytes, 2 * (p - 1))


def all_gather(nbytes: float, p: int, link: Link) -> float:
    """Ring all-gather of an n-byte result: p - 1 steps, each moving n / p bytes."""
    return 0.0 if p <= 1 else link.send((p - 1) / p * nbytes, p - 1)


def _step_links(kind: str, p: int, g: int, tp: int) -> list[float]:
    """Per step of message_stats(kind, p, g, tp, ...): the fraction of its messages and bytes that stay inside a
    node (an exchange among s ranks, h per node, sends to h - 1 local peers of its s - 1)."""
    def mixed(s: int, h: int) -> float:
        return 1.0 if s <= 1 else (h - 1) / (s - 1)

    if kind == "flat":
        return [mixed(p, g)]
    if kind == "hierarchical":
        return [1.0, 0.0]
    if kind == "pcc":
        return [mixed(p // tp, max(g // tp, 1)), 1.0]
    return [1.0, 0.0, 1.0]                                   # pcc+hierarchical: intra, inter, tp all-gather


def all_to_all(kind: str, p: int, g: int, tp: int, rows_per_pair: float, row_bytes: int, links: Links) -> float:
    """Seconds of one MoE layer's dispatch and combine exchanges among the p ranks of a stage, g per node.

    Every rank sends rows_per_pair rows of row_bytes to every other rank in a flat exchange (message_stats' model).
    Dispatch and combine each run the exchange steps; PCC's tp all-gather (the last step) follows the combine only.
    ValueError (from message_stats) when the kind does not fit p, g and tp.
    """
    if p <= 1:
        return 0.0
    kind_tp = tp if kind.startswith("pcc") else 1
    stats = message_stats(kind, p, g, kind_tp, rows_per_pair, row_bytes)
    seconds = 0.0
    for index, (step, intra) in enumerate(zip(stats["steps"], _step_links(kind, p, g, kind_tp))):
        gather = kind.startswith("pcc") and index == len(stats["steps"]) - 1
        repeats = 1 if gather else 2
        for share, link in ((intra, links.intra), (1.0 - intra, links.inter)):
            if share > 0:
                seconds += repeats * link.send(share * step["bytes"], share * step["messages"])
    return seconds


def all_to_all_latency_terms(kind: str, p: int, g: int, tp: int) -> int:
    """Messages a rank sends in one exchange under `kind` (the paper's C1 multiplier, DeepSpeed Inference V-B)."""
    kind_tp = tp if kind.startswith("pcc") else 1
    return message_stats(kind, p, g, kind_tp, 1, 1)["messages"]
