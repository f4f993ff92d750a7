"""Low-latency mode of the two-level dispatcher (hierarchical.py): fixed blocks at both stages, no
count exchange, no host sync.

Legend as in hierarchical.py; C the planned capacity (StepPlan.max_tokens), W = H + M a row with
its metadata (exchange.with_meta).
  stage 1: to the peer on every node, a [C, W] block: row t = token t, with the physical ids of its
           experts on that node (-1 for the others, and for the rows past T);
  stage 2: the forwarder's [N*C, W] received rows to every rank of its node, with local slot ids.
A rank receives L*N*C rows: row (l, n, t) is token t of the rank with local rank l on node n. Next
to the flat low-latency mode (ep*C rows across every link) the inter-node link carries (N-1)*C
rows instead of (ep - L)*C: the padding crosses nodes once per node, not once per rank.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Dispatched, Pending
from .exchange import pack_meta, padded_blocks, split_rows, sum_members, with_meta
from .handles import HierarchicalLowLatencyHandle


class HierarchicalLowLatencyMixin:
    """Needs from the dispatcher: ctx, hidden, layout, nodes, stream, _stage, _count."""

    def _hll_splits(self, tier: str, rows: int) -> list[int]:
        """rows to every rank of the tier (the peers, or this node's ranks), 0 to the others."""
        members = set(self.nodes.peers()) if tier == "inter" else set(self.nodes.node_ranks)
        return [rows if r in members else 0 for r in range(self.ctx.ep_size)]

    def _hll_dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, capacity: int) -> Pending:
        send, to_node = self._hll_pack(x, topk_ids, topk_weights, capacity)        # [N*C, W], [T, N]
        k, C, N = topk_ids.shape[1], capacity, self.nodes.num_nodes
        splits = self._hll_splits("inter", C)
        nbytes = (N - 1) * C * send.shape[1] * send.element_size()

        def stage1(blocking: bool):
            (recv,), works, deliver = self._stage("inter", [send], splits, splits, nbytes, blocking)
            return recv, works, deliver

        if self.stream is not None:
            work = self.stream.submit(lambda: self._hll_forward(stage1(True)[0], to_node, C, k), keep=(send,))
            return Pending(self.ctx, [work], work.wait)
        recv, works, deliver = stage1(False)

        def finish() -> Dispatched:
            if deliver is not None:
                deliver()
            return self._hll_forward(recv, to_node, C, k)
        return Pending(self.ctx, works, finish)

    def _hll_pack(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, C: int) -> tuple[Tensor, Tensor]:
        """-> send [N*C, W] (block n for the peer on node n, token t in its row t), to_node [T, N].
        The caller (Dispatcher.dispatch_start) has checked T <= C."""
        nodes, layout = self.nodes, self.layout
        N = nodes.num_nodes
        ids = topk_ids.to(device=x.device, dtype=torch.long)
        node = torch.where(ids >= 0, nodes.node_of(layout.rank_of(ids)), N)          # [T, k]; N = nowhere
        here = node[None] == torch.arange(N, device=x.device)[:, None, None]         # [N, T, k]
        send = padded_blocks(x, torch.where(here, ids[None], -1),
                             torch.where(here, topk_weights.to(x.device).float()[None], 0.0), C)   # [N, C, W]
        return send.view(N * C, -1), here.any(-1).t()

    def _hll_forward(self, recv: Tensor, to_node: Tensor, C: int, k: int) -> Dispatched:
        """Stage 2 on the forwarder: recv [N*C, W] from stage 1 -> the Dispatched [L*N*C] rows."""
        nodes, layout, H = self.nodes, self.layout, self.hidden
        N, L, first = nodes.num_nodes, nodes.ranks_per_node, nodes.node_ranks.start
        x, ids, w = split_rows(recv, H, k)                                           # [N*C, ...] physical ids
        dest = torch.where(ids >= 0, layout.rank_of(ids) - first, L)                  # [N*C, k]; L = nowhere
        here = dest[None] == torch.arange(L, device=x.device)[:, None, None]         # [L, N*C, k]
        meta = pack_meta(torch.where(here, layout.local_of(ids)[None], -1), torch.where(here, w[None], 0.0))
        send = with_meta(x.expand(L, N * C, H), meta).view(L * N * C, -1)            # [L*N*C, W]
        splits = self._hll_splits("intra", N * C)
        (out,), _, _ = self._stage("intra", [send], splits, splits,
                                   (L - 1) * N * C * send.shape[1] * send.element_size(), blocking=True)
        row_bytes = H * x.element_size()
        self._count("dispatch", (N * C + L * N * C) * row_bytes, (L - 1) * N * C * row_bytes, (N - 1) * C * row_bytes,
                    (N * C + L * N * C) * 2 * k * 4, low_latency=True, meta_inter_bytes=(N - 1) * C * 2 * k * 4)
        return Dispatched(*split_rows(out, H, k), HierarchicalLowLatencyHandle(to_node, here.any(-1).t(), C))

    def _hll_combine_start(self, y: Tensor, h: HierarchicalLowLatencyHandle) -> Pending:
        N, L, C, H = self.nodes.num_nodes, self.nodes.ranks_per_node, h.capacity, self.hidden
        if y.shape != (L * N * C, H):
            raise ValueError(f"combine expects y [{L * N * C}, {H}] (the dispatched rows), got {list(y.shape)}")
        y = y.contiguous()
        row_bytes = H * y.element_size()
        intra, inter = (L - 1) * N * C * row_bytes, (N - 1) * C * row_bytes
        self._count("combine", (L * N * C + N * C) * row_bytes, intra, inter)
        acc = torch.float32 if y.element_size() < 4 else y.dtype
        splits2, splits1 = self._hll_splits("intra", N * C), self._hll_splits("inter", C)

        def stage1_back(back2: Tensor) -> Tensor:
            """back2 [L*N*C, H]: the forwarded rows' partial sums, back from every rank of the node."""
            parts = back2.view(L, N * C, H).to(acc)
            part = sum_members(parts, h.fwd_member, y.dtype)                                # [N*C, H]
            (back1,), _, _ = self._stage("inter", [part], splits1, splits1, inter, blocking=True)
            T = h.node_member.shape[0]
            parts = back1.view(N, C, H)[:, :T].to(acc)
            return sum_members(parts, h.node_member, y.dtype)                               # [T, H]

        if self.stream is not None:
            def run() -> Tensor:
                return stage1_back(self._stage("intra", [y], splits2, splits2, intra, blocking=True)[0][0])
            work = self.stream.submit(run, keep=(y,))
            return Pending(self.ctx, [work], work.wait)
        (back2,), works, deliver = self._stage("intra", [y], splits2, splits2, intra, blocking=False)

        def finish() -> Tensor:
            if deliver is not None:
                deliver()
            return stage1_back(back2)
        return Pending(self.ctx, works, finish)
