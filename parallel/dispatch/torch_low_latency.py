"""Low-latency mode of the torch dispatcher (see torch_normal.py): fixed [C, H + meta] blocks,
one all-to-all per dispatch and per combine, no count exchange, no host sync.

Legend as in base.py; C the planned capacity (StepPlan.max_tokens: the largest T of any rank this
step), M the metadata columns: the [2k] int32 of local slot ids and fp32 weight bits, viewed in the
activations' dtype. Received row r*C + t is source rank r's token t; rows of tokens not bound here
carry ids -1.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Dispatched, Pending
from .exchange import exchange, padded_blocks, per_tier, split_rows, sum_members
from .handles import TorchLowLatencyHandle


class LowLatencyMixin:
    """Needs from the dispatcher: ctx, hidden, layout, nodes, tiers, group, stream, link, _count."""

    def _ll_dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, capacity: int) -> Pending:
        send, member = self._ll_pack(x, topk_ids, topk_weights, capacity)
        k, H = topk_ids.shape[1], self.hidden
        tiers = per_tier(self.tiers, *self.nodes.block_bytes(send[0].numel() * send.element_size()))

        def unpack(recv: Tensor) -> Dispatched:
            rows = recv.view(-1, recv.shape[-1])                                       # [ep*C, H + M]
            return Dispatched(*split_rows(rows, H, k), TorchLowLatencyHandle(member, send.shape[1]))

        if self.stream is not None:
            def run() -> Dispatched:
                return unpack(self._ll_exchange(send, tiers, blocking=True)[0])
            work = self.stream.submit(run, keep=(send,))
            return Pending(self.ctx, [work], work.wait)
        recv, works, deliver = self._ll_exchange(send, tiers, blocking=False)

        def finish() -> Dispatched:
            if deliver is not None:
                deliver()
            return unpack(recv)
        return Pending(self.ctx, works, finish)

    def _ll_pack(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, C: int) -> tuple[Tensor, Tensor]:
        """-> send [ep, C, H + M] (token t in row t of every rank's block), member [T, ep]. The caller
        (Dispatcher.dispatch_start) has checked T <= C."""
        ep, layout, H = self.ctx.ep_size, self.layout, self.hidden
        k = topk_ids.shape[1]
        ids = topk_ids.to(device=x.device, dtype=torch.long)
        dest = torch.where(ids >= 0, layout.rank_of(ids), ep)                          # [T, k]; ep = nowhere
        ranks = torch.arange(ep, device=x.device)
        here = dest[None] == ranks[:, None, None]                                      # [ep, T, k]
        send = padded_blocks(x, torch.where(here, layout.local_of(ids), -1),
                             torch.where(here, topk_weights.to(x.device).float()[None], 0.0), C)   # [ep, C, H + M]
        row_bytes = H * x.element_size()
        self._count("dispatch", ep * C * row_bytes, *self.nodes.block_bytes(C * row_bytes), ep * C * 2 * k * 4,
                    low_latency=True, meta_inter_bytes=self.nodes.block_bytes(C * 2 * k * 4)[1])
        return send, here.any(-1).t()

    def _ll_exchange(self, send: Tensor, tiers: tuple[int | None, int | None], blocking: bool):
        """-> recv (same shape as send), works, deliver (None without a network or when blocking)."""
        recv = torch.empty_like(send)
        works, deliver = exchange(self.ctx, self.group, self.link, [(recv, send, None, None)], *tiers, blocking)
        return recv, works, deliver

    def _ll_combine_start(self, y: Tensor, handle: TorchLowLatencyHandle) -> Pending:
        ep, C, H = self.ctx.ep_size, handle.capacity, self.hidden
        if y.shape != (ep * C, H):
            raise ValueError(f"combine expects y [{ep * C}, {H}] (the dispatched rows), got {list(y.shape)}")
        y = y.contiguous()
        block = C * H * y.element_size()
        by_tier = self.nodes.block_bytes(block)
        self._count("combine", ep * block, *by_tier)
        tiers = per_tier(self.tiers, *by_tier)
        member = handle.member                                                         # [T, ep]

        def reduce(back: Tensor) -> Tensor:
            T = member.shape[0]
            acc = torch.float32 if y.element_size() < 4 else y.dtype
            parts = back.view(ep, C, H)[:, :T].to(acc)                                 # [ep, T, H]
            return sum_members(parts, member, y.dtype)                                 # [T, H]

        if self.stream is not None:
            def run() -> Tensor:
                return self._ll_exchange(y, tiers, blocking=True)[0]
            work = self.stream.submit(run, keep=(y,))
            return Pending(self.ctx, [work], lambda: reduce(work.wait()))
        back, works, deliver = self._ll_exchange(y, tiers, blocking=False)

        def finish() -> Tensor:
            if deliver is not None:
                deliver()
            return reduce(back)
        return Pending(self.ctx, works, finish)
