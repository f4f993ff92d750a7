"""Reference dispatcher: every rank gets every token, keeps the slots of its own experts.

Legend as in base.py; M = max T over the EP ranks. Tokens, ids and weights are padded to M rows
and all-gathered, so R = ep * M (rows of other ranks' padding carry no local slot). Combine
all-reduces the [ep*M, H] partial sums and keeps this rank's rows. Simple and obviously right;
moves ep times more data than needed. Used to cross-check the all-to-all backends. Normal mode
only. Under DBO each microbatch gets its own copy over its own process group (for_microbatch), so
the two microbatches' collectives never interleave on one group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..step_plan import StepPlan
from ..watchdog import guard_collective
from .base import Dispatched, Dispatcher, Pending
from .handles import AllGatherHandle


class AllGatherDispatcher(Dispatcher):
    """group: the process group (default ctx.ep_group)."""

    microbatch_groups = True

    def __init__(self, ctx, num_physical_experts: int, hidden: int, *, group=None):
        super().__init__(ctx, num_physical_experts, hidden)
        self.group = group if group is not None else ctx.ep_group

    def for_microbatch(self, group, stream) -> "AllGatherDispatcher":
        return AllGatherDispatcher(self.ctx, self.num_physical_experts, self.hidden, group=group)

    def _dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan) -> Pending:
        """x [T,H], topk_ids [T,k] physical, topk_weights [T,k] -> Pending[Dispatched with R = ep*M]."""
        ctx, ep, group, layout = self.ctx, self.ctx.ep_size, self.group, self.layout
        T, k = topk_ids.shape
        dev = x.device
        counts = [torch.empty(1, dtype=torch.long, device=dev) for _ in range(ep)]
        with guard_collective(ctx):
            dist.all_gather(counts, torch.tensor([T], device=dev), group=group)
        Ts = torch.cat(counts).tolist()  # SYNC: the padded length sizes the gather buffers
        M = max(Ts)

        pad = M - T
        xp = torch.cat([x, x.new_zeros(pad, self.hidden)])
        ids = torch.cat([topk_ids.to(dev, torch.long), torch.full((pad, k), -1, dtype=torch.long, device=dev)])
        w = torch.cat([topk_weights.to(dev).float(), torch.zeros(pad, k, device=dev)])
        xs = [torch.empty_like(xp) for _ in range(ep)]
        idss = [torch.empty_like(ids) for _ in range(ep)]
        ws = [torch.empty_like(w) for _ in range(ep)]
        with guard_collective(ctx):
            works = [dist.all_gather(out, t, group=group, async_op=True) for out, t in ((xs, xp), (idss, ids), (ws, w))]
        row_bytes = self.hidden * x.element_size()
        self._count("dispatch", ep * M * row_bytes, *self.nodes.block_bytes(M * row_bytes),
                    ep * (8 + ids.numel() * 8 + w.numel() * 4))

        def finish() -> Dispatched:
            all_ids = torch.cat(idss)                                          # [ep*M, k] physical
            mine = (all_ids >= 0) & (layout.rank_of(all_ids) == ctx.ep_rank)
            local_ids = torch.where(mine, layout.local_of(all_ids), -1)
            local_w = torch.where(mine, torch.cat(ws), 0.0)
            return Dispatched(torch.cat(xs), local_ids, local_w, AllGatherHandle(M, T))

        return Pending(ctx, works, finish)

    def _combine_start(self, y: Tensor, handle: AllGatherHandle) -> Pending:
        """y [ep*M, H] -> Pending[[T,H]]: all-reduce the partial sums, keep this rank's rows (counted
        as every other rank's block once, as the dispatch: what the all-reduce must bring in)."""
        M, T = handle.padded, handle.num_tokens
        ep = self.ctx.ep_size
        if y.shape != (ep * M, self.hidden):
            raise ValueError(f"combine expects y [{ep * M}, {self.hidden}] (the dispatched rows), got {list(y.shape)}")
        acc = torch.float32 if y.element_size() < 4 else y.dtype
        total = y.to(acc).clone()  # all_reduce is in place; the caller's y stays untouched
        with guard_collective(self.ctx):
            work = dist.all_reduce(total, group=self.group, async_op=True)
        row_bytes = self.hidden * y.element_size()
        self._count("combine", ep * M * row_bytes, *self.nodes.block_bytes(M * row_bytes))
        start = self.ctx.ep_rank * M
        return Pending(self.ctx, [work], lambda: total[start:start + T].to(y.dtype))
