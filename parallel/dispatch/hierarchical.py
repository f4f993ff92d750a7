"""Two-level (node-aware) dispatch/combine with torch.distributed all_to_all_single.

Legend as in base.py; N nodes, L ranks per node (parallel/dispatch/nodes.py: node-major), a rank's
*peers* the ranks with its local rank on every node (itself included). S1 stage-1 rows a rank sends
(one per unique (token, destination node) pair), R1 it receives, S2 rows it forwards (one per unique
(stage-1 row, destination rank) pair), R2 it receives: the Dispatched rows.

As DeepEP's internode kernels do, a token crosses the slow inter-node link once per destination
node, not once per destination rank:
  stage 1 (inter-node): each token goes to its peer on every node holding one of its experts, with
          the physical ids of its experts on that node (-1 for the others) and their weights;
  stage 2 (intra-node): that peer forwards each received row to every rank of its node holding one
          of its experts, with their local slot ids, as the flat dispatcher would have sent it.
The experts see the same rows and ids as with the flat dispatcher (torch_normal.py), in another
order. Combine mirrors it: the ranks send their weighted sums back to the forwarder, which adds up
the partial sums of each stage-1 row inside the node, and one row per (token, node) crosses back;
the source adds up its <= N rows per token. Outputs equal the flat dispatcher's up to the order of
those sums (fp32: ~1e-7).

Normal mode, per dispatch: one all-to-all of counts (per destination rank: how many of my tokens go
there, and to my peers how many stage-1 rows; from these every rank sizes both stages' receive
buffers: one host sync), stage 1 (payload + metadata), then stage 2, whose sizes the forwarder reads
off the rows it received (a second host sync, on the forwarder). A stage with nobody else in its
tier (one node: stage 1; one rank per node: stage 2) is a local copy, not a collective.
Low-latency mode (hierarchical_low_latency.py), when the call's StepPlan says so: fixed blocks,
no count exchange, no host sync.

Both stages are all-to-alls over the dispatcher's one process group with non-zero splits only
inside the tier (stage 1: the peers; stage 2: the node), so DBO's per-microbatch copies
(for_microbatch) need one group each, as the flat dispatcher's do. With a CommStream the whole
exchange runs on its thread; without one, dispatch_start issues stage 1 and wait() runs stage 2.
A simulated network (comm_stream.py) charges the counts to both tiers, stage 1 to the inter-node
tier, stage 2 to the intra-node tier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..step_plan import StepPlan
from .base import Dispatched, Pending
from .exchange import ExchangeDispatcher, exchange, pack_meta, per_tier, unpack_meta
from .handles import HierarchicalHandle, HierarchicalLowLatencyHandle
from .hierarchical_low_latency import HierarchicalLowLatencyMixin


@dataclass
class _Stage1:
    """A dispatch between its two stages."""
    recv_x: Tensor            # [R1, H]
    recv_meta: Tensor         # [R1, 2k] physical ids on this node (-1 elsewhere), weights
    send_tok: Tensor          # [S1]
    send_splits: list[int]
    recv_splits: list[int]
    fwd_recv_splits: list[int]
    num_tokens: int
    row_bytes: int
    inter_bytes: int          # stage-1 bytes to other nodes
    meta_bytes: int           # counts + stage-1 metadata
    meta_inter_bytes: int     # the part of meta_bytes sent to other nodes
    works: list
    deliver: Callable[[], None] | None


class HierarchicalDispatcher(HierarchicalLowLatencyMixin, ExchangeDispatcher):
    """Two-level: a token goes once to each destination node, then inside it (module doc); group,
    thread, network and threshold: ExchangeDispatcher."""

    # -- the two tiers ------------------------------------------------------------------------------
    def _stage(self, tier: str, send: list[Tensor], recv_splits: list[int], send_splits: list[int], nbytes: int,
               blocking: bool) -> tuple[list[Tensor], list, Callable[[], None] | None]:
        """One stage's all-to-all inside `tier` ("inter": the peers, "intra": the node): the send
        tensors [rows, ...] -> (the received tensors, works, deliver). With nobody else in the tier
        the rows only go to this rank: the send tensors are the received ones, no collective."""
        alone = self.nodes.num_nodes == 1 if tier == "inter" else self.nodes.ranks_per_node == 1
        if alone:
            return send, [], None
        R = sum(recv_splits)
        recv = [t.new_empty((R, *t.shape[1:])) for t in send]
        intra, inter = (None, nbytes) if tier == "inter" else (nbytes, None)
        works, deliver = exchange(self.ctx, self.group, self.link,
                                  [(r, t, recv_splits, send_splits) for r, t in zip(recv, send)], intra, inter,
                                  blocking)
        return recv, works, deliver

    # -- dispatch -----------------------------------------------------------------------------------
    def _dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan) -> Pending:
        if plan.low_latency:
            return self._hll_dispatch_start(x, topk_ids, topk_weights, plan.max_tokens)
        if self.stream is not None:
            work = self.stream.submit(lambda: self._forward(self._stage1(x, topk_ids, topk_weights, blocking=True)),
                                      keep=(x, topk_ids, topk_weights))
            return Pending(self.ctx, [work], work.wait)
        st = self._stage1(x, topk_ids, topk_weights, blocking=False)
        return Pending(self.ctx, st.works, lambda: self._forward(st))

    def _peer_ids(self, dev) -> Tensor:
        """nodes.peers() as a tensor on dev, made once (not a host-to-device copy per layer and step)."""
        cached = getattr(self, "_peers", None)
        if cached is None or cached.device != dev:
            cached = self._peers = torch.tensor(self.nodes.peers(), device=dev)
        return cached

    def _stage1(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, blocking: bool) -> _Stage1:
        nodes, layout, ep, H = self.nodes, self.layout, self.ctx.ep_size, self.hidden
        N, L = nodes.num_nodes, nodes.ranks_per_node
        T, k = topk_ids.shape
        dev = x.device
        ids = topk_ids.to(device=dev, dtype=torch.long)
        rank = torch.where(ids >= 0, layout.rank_of(ids), ep)                      # [T, k]; ep = nowhere
        node = nodes.node_of(rank)                                                 # [T, k]; N = nowhere
        to_rank = torch.zeros(T, ep + 1, dtype=torch.bool, device=dev).scatter_(1, rank, True)[:, :ep]
        to_node = torch.zeros(T, N + 1, dtype=torch.bool, device=dev).scatter_(1, node, True)[:, :N]
        # SYNC (on CUDA): nonzero sizes its output on the host.
        dst_node, send_tok = to_node.t().nonzero(as_tuple=True)                    # [S1], by node, then token
        per_node = to_node.sum(0)                                                  # [N]

        # Counts: to every rank, my tokens bound for it (column 0); to my peer on node n also my
        # stage-1 rows for node n (column 1).
        counts = torch.zeros(ep, 2, dtype=torch.long, device=dev)
        counts[:, 0] = to_rank.sum(0)
        counts[self._peer_ids(dev), 1] = per_node
        recv_counts = torch.empty_like(counts)
        exchange(self.ctx, self.group, self.link, [(recv_counts, counts, None, None)], *per_tier(self.tiers, 0, 0),
                 blocking=True)
        # SYNC: both stages' split sizes are host ints.
        got, sent = recv_counts.tolist(), counts.tolist()
        send_splits, recv_splits = [c[1] for c in sent], [c[1] for c in got]
        # Stage 2 brings me, from the rank with local rank l of my node, the tokens of every rank with
        # local rank l that are bound for me.
        from_local = [sum(got[s][0] for s in range(l, ep, L)) for l in range(L)]
        fwd_recv_splits = [0] * ep
        for l, r in enumerate(nodes.node_ranks):
            fwd_recv_splits[r] = from_local[l]

        here = node[send_tok] == dst_node[:, None]                                 # [S1, k]
        meta = pack_meta(torch.where(here, ids[send_tok], -1),
                         torch.where(here, topk_weights.to(dev)[send_tok].float(), 0.0))   # [S1, 2k]
        row_bytes = H * x.element_size()
        inter = nodes.tier_bytes(send_splits, row_bytes)[1]
        # Counts go to every rank (equal splits); stage-1 metadata goes with its rows.
        count_bytes = counts.shape[1] * counts.element_size()
        meta_inter = (nodes.tier_bytes([1] * ep, count_bytes)[1]
                      + nodes.tier_bytes(send_splits, meta.shape[1] * meta.element_size())[1])
        (recv_x, recv_meta), works, deliver = self._stage("inter", [x[send_tok], meta], recv_splits, send_splits,
                                                          inter, blocking)
        return _Stage1(recv_x, recv_meta, send_tok, send_splits, recv_splits, fwd_recv_splits, T, row_bytes, inter,
                       counts.numel() * counts.element_size() + meta.numel() * 4, meta_inter, works, deliver)

    def _forward(self, st: _Stage1) -> Dispatched:
        """Stage 2, on the rank that received the stage-1 rows (after their works were waited)."""
        if st.deliver is not None:
            st.deliver()
        nodes, layout, ep = self.nodes, self.layout, self.ctx.ep_size
        L, first = nodes.ranks_per_node, nodes.node_ranks.start
        k = st.recv_meta.shape[1] // 2
        ids, w = unpack_meta(st.recv_meta, k)                                      # [R1, k] physical, this node
        dest = torch.where(ids >= 0, layout.rank_of(ids) - first, L)               # [R1, k] local rank; L = nowhere
        to_local = torch.zeros(ids.shape[0], L + 1, dtype=torch.bool, device=ids.device)
        to_local = to_local.scatter_(1, dest, True)[:, :L]                         # [R1, L]
        # SYNC (on CUDA): nonzero sizes its output on the host.
        dst_local, fwd_row = to_local.t().nonzero(as_tuple=True)                   # [S2], by local rank, then row
        fwd_splits = [0] * ep
        for l, n in enumerate(to_local.sum(0).tolist()):  # SYNC: split sizes of the stage-2 all-to-all
            fwd_splits[first + l] = n

        here = dest[fwd_row] == dst_local[:, None]                                 # [S2, k]
        meta = pack_meta(torch.where(here, layout.local_of(ids[fwd_row]), -1),
                         torch.where(here, w[fwd_row], 0.0))                       # [S2, 2k] local slot ids
        intra = nodes.tier_bytes(fwd_splits, st.row_bytes)[0]
        (recv_x, recv_meta), _, _ = self._stage("intra", [st.recv_x[fwd_row], meta], st.fwd_recv_splits, fwd_splits,
                                                intra, blocking=True)
        self._count("dispatch", (len(st.send_tok) + len(fwd_row)) * st.row_bytes, intra, st.inter_bytes,
                    st.meta_bytes + meta.numel() * 4, meta_inter_bytes=st.meta_inter_bytes)
        handle = HierarchicalHandle(st.send_tok, st.send_splits, st.recv_splits, fwd_row, fwd_splits,
                                    st.fwd_recv_splits, st.num_tokens)
        return Dispatched(recv_x, *unpack_meta(recv_meta, k), handle)

    # -- combine ------------------------------------------------------------------------------------
    def _combine_start(self, y: Tensor, handle: HierarchicalHandle | HierarchicalLowLatencyHandle) -> Pending:
        """y [R2,H] (row order of the Dispatched) -> Pending[[T,H]] on the source rank: reduced inside
        the forwarder's node first, then one row per (token, node) back across nodes."""
        if isinstance(handle, HierarchicalLowLatencyHandle):
            return self._hll_combine_start(y, handle)
        h = handle
        R2 = sum(h.fwd_recv_splits)
        if y.dim() != 2 or y.shape != (R2, self.hidden):
            raise ValueError(f"combine expects y [{R2}, {self.hidden}] (the dispatched rows), got {list(y.shape)}")
        y = y.contiguous()
        row_bytes = self.hidden * y.element_size()
        intra = self.nodes.tier_bytes(h.fwd_recv_splits, row_bytes)[0]
        inter = self.nodes.tier_bytes(h.recv_splits, row_bytes)[1]
        self._count("combine", (R2 + sum(h.recv_splits)) * row_bytes, intra, inter)
        # Low-precision activations are summed in fp32 at both levels; what crosses is y's dtype.
        acc = torch.float32 if y.element_size() < 4 else y.dtype

        def stage1_back(back2: Tensor) -> Tensor:
            """back2 [S2, H]: this rank's forwarded rows, come back with their partial sums."""
            part = torch.zeros(sum(h.recv_splits), self.hidden, dtype=acc, device=y.device)
            part = part.index_add_(0, h.fwd_row, back2.to(acc)).to(y.dtype)        # [R1, H]: the node's sums
            (back1,), _, _ = self._stage("inter", [part], h.send_splits, h.recv_splits, inter, blocking=True)
            out = torch.zeros(h.num_tokens, self.hidden, dtype=acc, device=y.device)
            return out.index_add_(0, h.send_tok, back1.to(acc)).to(y.dtype)       # [T, H]

        if self.stream is not None:
            def run() -> Tensor:
                return stage1_back(self._stage("intra", [y], h.fwd_splits, h.fwd_recv_splits, intra, True)[0][0])
            work = self.stream.submit(run, keep=(y,))
            return Pending(self.ctx, [work], work.wait)
        (back2,), works, deliver = self._stage("intra", [y], h.fwd_splits, h.fwd_recv_splits, intra, blocking=False)

        def finish() -> Tensor:
            if deliver is not None:
                deliver()
            return stage1_back(back2)
        return Pending(self.ctx, works, finish)
