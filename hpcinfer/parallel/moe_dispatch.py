"""The MoE Dispatcher: route -> permute (local) -> all-to-all (comm) -> experts (local) -> all-to-all back (comm)
-> unpermute and combine (local), over the ranks of a pipeline stage (ep * expert_tp of them).

Expert x of E lives on expert-parallel index x // (E / ep); with expert-slicing each of its expert_tp slices is on
stage rank owner * expert_tp + slice, and every slice gets a copy of the row (their outputs are partial sums over
the FFN width, added up on the way back). The exchange is `flat` (every rank with every rank of the stage) or
`pcc` (parallelism-coordinated, DeepSpeed Inference V-B: the tokens are replicated over the tp group, so a rank
sends only the rows bound for ranks that share its tp rank, the exchange runs among those dp ranks, and an
all-gather inside the tp group puts the results together); either can run hierarchically (intra-node, then
inter-node). All give the same result.

The routing tables may live on the device (CupyOps): every index step here runs in the ops' array module
(`ops.xp`), with no data-dependent shapes, and the only host-side sizes (what goes to each rank) come from the
routing's host copy of the per-expert counts, so the dispatch itself copies nothing between host and device.

Shape legend: T tokens, D hidden, R routed rows (token, choice), N copies sent, M rows received.
"""

from __future__ import annotations

import numpy as np

from ..comm.all_to_all import make_all_to_all


class Dispatcher:
    def __init__(self, ops, groups, num_experts: int):
        moe = groups.moe
        self.ops, self.tp = ops, groups.tp
        self.local_experts = num_experts // moe.ep
        self.expert_tp = moe.expert_tp
        self.pcc = moe.all_to_all.startswith("pcc") and groups.tp.size > 1
        self.group = groups.dp if self.pcc else groups.stage
        kind = "hierarchical" if moe.all_to_all.endswith("hierarchical") else "flat"
        nodes = moe.dp_ranks_per_node if self.pcc else moe.stage_ranks_per_node
        self.exchange = make_all_to_all(kind, self.group, nodes)
        self.all_local = groups.stage.size == 1                   # ep = expert_tp = 1: every expert is here

    def __call__(self, x, routing, experts, rows=None):          # x [T, D] -> combined expert output [T, D]
        if rows is None:                                         # rows: x permuted by the routing already
            rows = self.ops.permute(x, routing)                  # [R, D], grouped by expert
        out = self.run_experts(rows, routing.expert_of_row, routing.expert_counts, experts)   # [R, D]
        return self.ops.unpermute(out, routing, x.shape[0])

    def run_experts(self, rows, expert_of_row, expert_counts, experts):
        """rows [R, D] grouped by expert, expert_of_row [R] (in `ops.xp`), host expert_counts [E] -> each row's
        expert output [R, D] (slices and tp shares added up): the exchange, the experts and the exchange back.
        The indexed path passes the routed rows; the one-hot path (backend/moe_onehot.py) its [E * C, D] buffer."""
        if self.all_local:                                       # rows already grouped by expert: no sort
            return experts(rows, expert_of_row - experts.first_expert, expert_counts)
        counts = self._send_counts(expert_counts)                                          # host [P]
        copy_row = self._destinations(expert_of_row, int(counts.sum()))                    # [N]
        send = [rows[copy_row], expert_of_row[copy_row] % self.local_experts]
        (recv_rows, recv_expert), recv_counts = self.exchange.exchange(send, counts)       # comm
        out = experts(recv_rows, recv_expert)                                              # local: [M, D]
        (back,), _ = self.exchange.exchange([out], recv_counts)                           # comm: [N, D]
        if self.pcc:                                                                       # comm: tp all-gather
            copy_row, back = self.tp.all_gather_v(copy_row), self.tp.all_gather_v(back)
        summed = self.ops.zeros((len(expert_of_row), rows.shape[1]), np.float32)
        self.ops.scatter_add_rows(summed, copy_row, back)       # slices (and tp shares) of a row add up
        return summed

    def _send_counts(self, expert_counts) -> np.ndarray:
        """Host [E] rows per expert -> host [P] rows this rank sends to each rank of the exchange group: a copy of
        each row to every slice of its expert's owner (stage rank owner * expert_tp + slice); with pcc only to
        the stage ranks of this tp rank (stage rank dp * tp + tp rank, dp index in the group)."""
        per_owner = np.asarray(expert_counts, dtype=np.int64).reshape(-1, self.local_experts).sum(axis=1)   # [ep]
        per_stage_rank = np.repeat(per_owner, self.expert_tp)                                        # [ep * etp]
        return per_stage_rank[self.tp.rank::self.tp.size] if self.pcc else per_stage_rank

    def _destinations(self, expert_of_row, copies: int):
        """Routed row of each of the `copies` copies this rank sends, ordered by destination rank (stable: by
        row inside one destination). In `ops.xp`; copies not for this rank (pcc) sort last and are cut off."""
        xp, R, etp = self.ops.xp, len(expert_of_row), self.expert_tp
        copy_row = xp.repeat(xp.arange(R), etp)                                                      # [R * etp]
        dest = (expert_of_row[copy_row] // self.local_experts) * etp + xp.tile(xp.arange(etp), R)   # stage rank
        if self.pcc:
            mine = dest % self.tp.size == self.tp.rank
            dest = xp.where(mine, dest // self.tp.size, self.group.size)                            # dp index
        return copy_row[xp.argsort(dest, kind="stable")[:copies]]
