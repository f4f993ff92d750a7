"""Dispatch/combine with torch.distributed all_to_all_single (gloo on CPU, NCCL on GPU).

Legend as in base.py; S rows this rank sends, one per unique (token, destination rank) pair.

A token whose k experts include several on one rank is sent to that rank once; its metadata row
there carries the local ids of all its slots on that rank (-1 for the others), and the receiving
experts produce one weighted sum per row. So combine also moves one row per (token, rank) pair,
and the source only adds up at most ep partial sums per token.

Normal mode, per dispatch: one tiny all-to-all of row counts (the host must know them to size the
receive buffers: one sync), then the hidden payload and the metadata as two async all-to-alls.

Low-latency mode (torch_low_latency.py), when the call's StepPlan says so (the step's largest
token count C of any rank is <= low_latency_max_tokens): every rank sends every rank a fixed
[C, H + meta] block, one all-to-all with no count exchange and no host sync each way. It sends
ep * C rows instead of one per (token, rank) pair: cheap when C is small, wasteful for wide EP with
large steps, hence the threshold (0 turns the mode off).

With a CommStream (dual-batch overlap) the whole exchange, counts included, runs on the stream's
thread over the stream's own process group, so the compute thread never blocks in dispatch_start or
combine_start. A SimulatedLink adds latency + bytes / bandwidth to each all-to-all, counted from
the collective's rendezvous (see comm_stream.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm_stream import CommStream, SimulatedLink
from ..step_plan import StepPlan
from ..watchdog import guard_collective
from .base import Dispatched, Dispatcher, Pending
from .handles import TorchHandle, TorchLowLatencyHandle
from .torch_low_latency import LowLatencyMixin


@dataclass
class _Layout:
    send_tok: Tensor          # [S] source token index of each sent row, grouped by destination rank
    send_counts: Tensor       # [ep] rows for each rank
    send_splits: list[int]    # the same, on the host
    send_x: Tensor            # [S, H]
    meta: Tensor              # [S, 2k] int32: local slot ids, then the weights' fp32 bits
    num_tokens: int           # T
    row_bytes: int


class TorchDispatcher(LowLatencyMixin, Dispatcher):
    """group: the process group (default ctx.ep_group); stream: run exchanges off the compute thread;
    link: a simulated network link (testing); low_latency_max_tokens: see the module doc."""

    supports_comm_stream = True
    microbatch_groups = True

    def __init__(self, ctx, num_physical_experts: int, hidden: int, *, group=None,
                 stream: CommStream | None = None, link: SimulatedLink | None = None,
                 low_latency_max_tokens: int = 0):
        super().__init__(ctx, num_physical_experts, hidden)
        self.group = group if group is not None else ctx.ep_group
        self.stream, self.link = stream, link if link is not None and link.enabled else None
        self.low_latency_max_tokens = low_latency_max_tokens

    def for_microbatch(self, group, stream) -> "TorchDispatcher":
        return TorchDispatcher(self.ctx, self.num_physical_experts, self.hidden, group=group, stream=stream,
                               link=self.link, low_latency_max_tokens=self.low_latency_max_tokens)

    def _remote_bytes(self, splits: list[int], row_bytes: int) -> int:
        return (sum(splits) - splits[self.ctx.ep_rank]) * row_bytes

    def _dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan) -> Pending:
        if plan.low_latency:
            return self._ll_dispatch_start(x, topk_ids, topk_weights, plan.max_tokens)
        if self.stream is not None:
            # Everything, the layout's host syncs included, runs on the communication thread.
            work = self.stream.submit(lambda: self._dispatch_now(x, topk_ids, topk_weights),
                                      keep=(x, topk_ids, topk_weights))
            return Pending(self.ctx, [work], work.wait)
        lay = self._layout(x, topk_ids, topk_weights)
        recv_x, recv_meta, recv_splits, works, deliver = self._exchange(lay, blocking=False)
        handle = TorchHandle(lay.send_tok, lay.send_splits, recv_splits, lay.num_tokens)
        k = topk_ids.shape[1]

        def finish() -> Dispatched:
            if deliver is not None:
                deliver()
            return self._dispatched(recv_x, recv_meta, k, handle)

        return Pending(self.ctx, works, finish)

    def _dispatch_now(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        lay = self._layout(x, topk_ids, topk_weights)
        recv_x, recv_meta, recv_splits = self._exchange(lay, blocking=True)[:3]
        return self._dispatched(recv_x, recv_meta, topk_ids.shape[1],
                                TorchHandle(lay.send_tok, lay.send_splits, recv_splits, lay.num_tokens))

    def _layout(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Layout:
        ep, layout = self.ctx.ep_size, self.layout
        T, k = topk_ids.shape
        ids = topk_ids.to(device=x.device, dtype=torch.long)
        valid = ids >= 0
        dest = torch.where(valid, layout.rank_of(ids), ep)                         # [T, k]; ep = nowhere
        member = torch.zeros(T, ep + 1, dtype=torch.bool, device=x.device)
        member.scatter_(1, dest, torch.ones_like(dest, dtype=torch.bool))
        member = member[:, :ep]                                                    # [T, ep] token goes to rank
        # SYNC (on CUDA): nonzero sizes its output on the host.
        dst_rank, send_tok = member.t().nonzero(as_tuple=True)                     # [S], by rank, then token
        send_counts = member.sum(0)                                                # [ep]

        # Metadata row for (token, rank): the local ids of its slots on that rank, -1 elsewhere.
        here = dest[send_tok] == dst_rank[:, None]                                 # [S, k]
        meta_ids = torch.where(here, layout.local_of(ids[send_tok]), -1).to(torch.int32)
        meta_w = torch.where(here, topk_weights.to(x.device)[send_tok].float(), 0.0)
        # One int32 message for both: the weights travel as their fp32 bit patterns.
        meta = torch.cat([meta_ids, meta_w.view(torch.int32)], dim=1)              # [S, 2k]
        # SYNC: the split sizes of the payload all-to-all are host ints.
        lay = _Layout(send_tok, send_counts, send_counts.tolist(), x[send_tok], meta, T,
                      self.hidden * x.element_size())
        self._count("dispatch", len(send_tok) * lay.row_bytes, self._remote_bytes(lay.send_splits, lay.row_bytes),
                    meta.numel() * meta.element_size() + send_counts.numel() * send_counts.element_size())
        return lay

    def _exchange(self, lay: _Layout, blocking: bool):
        """Counts, then payload + metadata. -> recv_x, recv_meta, recv_splits, works, deliver (a
        function to call after the works: waits out the simulated link; None without a link)."""
        ctx, link = self.ctx, self.link
        send_counts, send_splits, send_x, meta = lay.send_counts, lay.send_splits, lay.send_x, lay.meta
        recv_counts = torch.empty_like(send_counts)
        with guard_collective(ctx):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        if link is not None:  # the count message crosses the link before the sizes are known
            SimulatedLink.wait_until(link.ready_at(0))
        recv_splits = recv_counts.tolist()  # SYNC: receive buffer sizes
        R = sum(recv_splits)
        recv_x = send_x.new_empty(R, self.hidden)
        recv_meta = meta.new_empty(R, meta.shape[1])
        with guard_collective(ctx):
            works = [
                dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=self.group,
                                       async_op=not blocking),
                dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=self.group,
                                       async_op=not blocking),
            ]
        nbytes = self._remote_bytes(send_splits, lay.row_bytes)
        if blocking:
            if link is not None:
                SimulatedLink.wait_until(link.ready_at(nbytes))
            return recv_x, recv_meta, recv_splits, [], None
        return recv_x, recv_meta, recv_splits, works, link.track(works, nbytes) if link is not None else None

    @staticmethod
    def _dispatched(recv_x, recv_meta, k: int, handle: TorchHandle) -> Dispatched:
        recv_ids = recv_meta[:, :k].long()
        recv_w = recv_meta[:, k:].contiguous().view(torch.float32)
        return Dispatched(recv_x, recv_ids, recv_w, handle)

    def _combine_start(self, y: Tensor, handle: TorchHandle | TorchLowLatencyHandle) -> Pending:
        """y [R,H] (row order of the Dispatched) -> Pending[[T,H]] on the source rank."""
        if isinstance(handle, TorchLowLatencyHandle):
            return self._ll_combine_start(y, handle)
        R = sum(handle.recv_splits)
        if y.dim() != 2 or y.shape != (R, self.hidden):
            raise ValueError(f"combine expects y [{R}, {self.hidden}] (the dispatched rows), got {list(y.shape)}")
        ctx, link = self.ctx, self.link
        back = y.new_empty(len(handle.send_tok), self.hidden)                      # [S, H]
        row_bytes = self.hidden * y.element_size()
        nbytes = self._remote_bytes(handle.recv_splits, row_bytes)
        self._count("combine", R * row_bytes, nbytes)
        y = y.contiguous()

        def reduce() -> Tensor:
            # Sum the <= ep partial sums per token; low-precision activations accumulate in fp32.
            acc = torch.float32 if y.element_size() < 4 else y.dtype
            out = torch.zeros(handle.num_tokens, self.hidden, dtype=acc, device=y.device)
            return out.index_add_(0, handle.send_tok, back.to(acc)).to(y.dtype)

        if self.stream is not None:
            def exchange() -> Tensor:
                with guard_collective(ctx):
                    dist.all_to_all_single(back, y, handle.send_splits, handle.recv_splits, group=self.group)
                if link is not None:
                    SimulatedLink.wait_until(link.ready_at(nbytes))
                return back
            return Pending(ctx, [self.stream.submit(exchange, keep=(y, back))], reduce)
        with guard_collective(ctx):
            work = dist.all_to_all_single(back, y, handle.send_splits, handle.recv_splits,
                                          group=self.group, async_op=True)
        deliver = link.track([work], nbytes) if link is not None else None

        def finish() -> Tensor:
            if deliver is not None:
                deliver()
            return reduce()

        return Pending(ctx, [work], finish)
