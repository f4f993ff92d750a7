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
combine_start. A simulated network (comm_stream.py) adds latency + bytes / bandwidth to each
all-to-all, counted from the collective's rendezvous, per tier: the bytes for other ranks of this
node on the intra-node link, those for other nodes on the inter-node link (a token bound for three
ranks of another node crosses it three times; the two-level dispatcher, hierarchical.py, once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..step_plan import StepPlan
from .base import Dispatched, Pending
from .exchange import ExchangeDispatcher, exchange, pack_meta, per_tier, unpack_meta
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


class TorchDispatcher(LowLatencyMixin, ExchangeDispatcher):
    """Flat: a token goes once to each destination rank (module doc); group, thread, network and
    threshold: ExchangeDispatcher."""

    def _link_bytes(self, splits: list[int], row_bytes: int) -> tuple[int | None, int | None]:
        """Rows sent to each rank -> the network's bytes per tier."""
        return per_tier(self.tiers, *self.nodes.tier_bytes(splits, row_bytes))

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
        meta = pack_meta(torch.where(here, layout.local_of(ids[send_tok]), -1),
                         torch.where(here, topk_weights.to(x.device)[send_tok].float(), 0.0))   # [S, 2k]
        # SYNC: the split sizes of the payload all-to-all are host ints.
        lay = _Layout(send_tok, send_counts, send_counts.tolist(), x[send_tok], meta, T,
                      self.hidden * x.element_size())
        self._count("dispatch", len(send_tok) * lay.row_bytes, *self.nodes.tier_bytes(lay.send_splits, lay.row_bytes),
                    meta.numel() * meta.element_size() + send_counts.numel() * send_counts.element_size(),
                    meta_inter_bytes=self.nodes.tier_bytes([1] * ep, send_counts.element_size())[1]
                    + self.nodes.tier_bytes(lay.send_splits, meta.shape[1] * meta.element_size())[1])
        return lay

    def _exchange(self, lay: _Layout, blocking: bool):
        """Counts, then payload + metadata. -> recv_x, recv_meta, recv_splits, works, deliver (a
        function to call after the works: waits out the simulated network; None without one)."""
        ctx, link = self.ctx, self.link
        send_counts, send_splits, send_x, meta = lay.send_counts, lay.send_splits, lay.send_x, lay.meta
        recv_counts = torch.empty_like(send_counts)
        # the count message crosses the network before the sizes are known
        exchange(ctx, self.group, link, [(recv_counts, send_counts, None, None)], *per_tier(self.tiers, 0, 0), True)
        recv_splits = recv_counts.tolist()  # SYNC: receive buffer sizes
        R = sum(recv_splits)
        recv_x = send_x.new_empty(R, self.hidden)
        recv_meta = meta.new_empty(R, meta.shape[1])
        pairs = [(recv_x, send_x, recv_splits, send_splits), (recv_meta, meta, recv_splits, send_splits)]
        works, deliver = exchange(ctx, self.group, link, pairs, *self._link_bytes(send_splits, lay.row_bytes),
                                  blocking)
        return recv_x, recv_meta, recv_splits, works, deliver

    @staticmethod
    def _dispatched(recv_x, recv_meta, k: int, handle: TorchHandle) -> Dispatched:
        return Dispatched(recv_x, *unpack_meta(recv_meta, k), handle)

    def _combine_start(self, y: Tensor, handle: TorchHandle | TorchLowLatencyHandle) -> Pending:
        """y [R,H] (row order of the Dispatched) -> Pending[[T,H]] on the source rank."""
        if isinstance(handle, TorchLowLatencyHandle):
            return self._ll_combine_start(y, handle)
        R = sum(handle.recv_splits)
        if y.dim() != 2 or y.shape != (R, self.hidden):
            raise ValueError(f"combine expects y [{R}, {self.hidden}] (the dispatched rows), got {list(y.shape)}")
        ctx = self.ctx
        back = y.new_empty(len(handle.send_tok), self.hidden)                      # [S, H]
        row_bytes = self.hidden * y.element_size()
        by_tier = self.nodes.tier_bytes(handle.recv_splits, row_bytes)
        self._count("combine", R * row_bytes, *by_tier)
        tiers = per_tier(self.tiers, *by_tier)
        y = y.contiguous()
        pairs = [(back, y, handle.send_splits, handle.recv_splits)]

        def reduce() -> Tensor:
            # Sum the <= ep partial sums per token; low-precision activations accumulate in fp32.
            acc = torch.float32 if y.element_size() < 4 else y.dtype
            out = torch.zeros(handle.num_tokens, self.hidden, dtype=acc, device=y.device)
            return out.index_add_(0, handle.send_tok, back.to(acc)).to(y.dtype)

        if self.stream is not None:
            def run() -> Tensor:
                exchange(ctx, self.group, self.link, pairs, *tiers, blocking=True)
                return back
            return Pending(ctx, [self.stream.submit(run, keep=(y, back))], reduce)
        works, deliver = exchange(ctx, self.group, self.link, pairs, *tiers, blocking=False)

        def finish() -> Tensor:
            if deliver is not None:
                deliver()
            return reduce()

        return Pending(ctx, works, finish)
