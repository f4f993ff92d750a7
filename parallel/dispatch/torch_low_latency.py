"""Low-latency mode of the torch dispatcher (see torch_normal.py): fixed [C, H + meta] blocks,
one all-to-all per dispatch and per combine, no count exchange, no host sync.

Legend as in base.py; C the planned capacity (StepPlan.max_tokens: the largest T of any rank this
step), M the metadata columns: the [2k] int32 of local slot ids and fp32 weight bits, viewed in the
activations' dtype. Received row r*C + t is source rank r's token t; rows of tokens not bound here
carry ids -1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm_stream import SimulatedLink
from ..watchdog import guard_collective
from .base import Dispatched, Pending
from .handles import TorchLowLatencyHandle


class LowLatencyMixin:
    """Needs from the dispatcher: ctx, hidden, layout, group, stream, link, _count."""

    def _ll_dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, capacity: int) -> Pending:
        send, member = self._ll_pack(x, topk_ids, topk_weights, capacity)
        k, H = topk_ids.shape[1], self.hidden
        nbytes = (self.ctx.ep_size - 1) * send[0].numel() * send.element_size()

        def unpack(recv: Tensor) -> Dispatched:
            rows = recv.view(-1, recv.shape[-1])                                       # [ep*C, H + M]
            meta = rows[:, H:].contiguous().view(torch.int32)                          # [ep*C, 2k]
            return Dispatched(rows[:, :H].contiguous(), meta[:, :k].long(),
                              meta[:, k:].contiguous().view(torch.float32),
                              TorchLowLatencyHandle(member, send.shape[1]))

        if self.stream is not None:
            def exchange() -> Dispatched:
                return unpack(self._ll_exchange(send, nbytes, blocking=True)[0])
            work = self.stream.submit(exchange, keep=(send,))
            return Pending(self.ctx, [work], work.wait)
        recv, works, deliver = self._ll_exchange(send, nbytes, blocking=False)

        def finish() -> Dispatched:
            if deliver is not None:
                deliver()
            return unpack(recv)
        return Pending(self.ctx, works, finish)

    def _ll_pack(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, C: int) -> tuple[Tensor, Tensor]:
        """-> send [ep, C, H + M] (token t in row t of every rank's block), member [T, ep]. The caller
        (Dispatcher.dispatch_start) has checked T <= C."""
        ep, layout, H = self.ctx.ep_size, self.layout, self.hidden
        T, k = topk_ids.shape
        if 4 % x.element_size():
            raise ValueError(f"low-latency dispatch packs int32 metadata into {x.dtype} rows; use normal mode")
        ids = topk_ids.to(device=x.device, dtype=torch.long)
        dest = torch.where(ids >= 0, layout.rank_of(ids), ep)                          # [T, k]; ep = nowhere
        ranks = torch.arange(ep, device=x.device)
        here = dest[None] == ranks[:, None, None]                                      # [ep, T, k]
        meta = torch.empty(ep, C, 2 * k, dtype=torch.int32, device=x.device)
        meta[:, :, :k] = -1
        meta[:, :, k:] = 0                                                             # fp32 0.0 bits
        meta[:, :T, :k] = torch.where(here, layout.local_of(ids), -1).to(torch.int32)
        w = torch.where(here, topk_weights.to(x.device).float()[None], 0.0)
        meta[:, :T, k:] = w.view(torch.int32)
        send = x.new_zeros(ep, C, H + meta.shape[-1] * 4 // x.element_size())
        send[:, :T, :H] = x[None]
        send[:, :, H:] = meta.view(x.dtype)
        row_bytes = H * x.element_size()
        self._count("dispatch", ep * C * row_bytes, (ep - 1) * C * row_bytes, meta.numel() * 4, low_latency=True)
        return send, here.any(-1).t()

    def _ll_exchange(self, send: Tensor, nbytes: int, blocking: bool):
        """-> recv (same shape as send), works, deliver (None without a link or when blocking)."""
        recv = torch.empty_like(send)
        with guard_collective(self.ctx):
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=not blocking)
        if blocking:
            if self.link is not None:
                SimulatedLink.wait_until(self.link.ready_at(nbytes))
            return recv, [], None
        return recv, [work], self.link.track([work], nbytes) if self.link is not None else None

    def _ll_combine_start(self, y: Tensor, handle: TorchLowLatencyHandle) -> Pending:
        ep, C, H = self.ctx.ep_size, handle.capacity, self.hidden
        if y.shape != (ep * C, H):
            raise ValueError(f"combine expects y [{ep * C}, {H}] (the dispatched rows), got {list(y.shape)}")
        y = y.contiguous()
        nbytes = (ep - 1) * C * H * y.element_size()
        self._count("combine", ep * C * H * y.element_size(), nbytes)
        member = handle.member                                                         # [T, ep]

        def reduce(back: Tensor) -> Tensor:
            T = member.shape[0]
            acc = torch.float32 if y.element_size() < 4 else y.dtype
            parts = back.view(ep, C, H)[:, :T].to(acc)                                 # [ep, T, H]
            return torch.where(member.t()[:, :, None], parts, 0).sum(0).to(y.dtype)    # [T, H]

        if self.stream is not None:
            def exchange() -> Tensor:
                return self._ll_exchange(y, nbytes, blocking=True)[0]
            work = self.stream.submit(exchange, keep=(y,))
            return Pending(self.ctx, [work], lambda: reduce(work.wait()))
        back, works, deliver = self._ll_exchange(y, nbytes, blocking=False)

        def finish() -> Tensor:
            if deliver is not None:
                deliver()
            return reduce(back)
        return Pending(self.ctx, works, finish)
