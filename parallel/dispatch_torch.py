"""Dispatch/combine with torch.distributed all_to_all_single (gloo on CPU, NCCL on GPU).

Legend as in dispatch.py; S rows this rank sends, one per unique (token, destination rank) pair.

A token whose k experts include several on one rank is sent to that rank once; its metadata row
there carries the local ids of all its slots on that rank (-1 for the others), and the receiving
experts produce one weighted sum per row. So combine also moves one row per (token, rank) pair,
and the source only adds up at most ep partial sums per token.

Per dispatch: one tiny all-to-all of row counts (the host must know them to size the receive
buffers: one sync), then the hidden payload and the metadata as two async all-to-alls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .dispatch import Dispatched, Dispatcher, Pending
from .watchdog import guard_collective


@dataclass
class _Handle:
    send_tok: Tensor          # [S] source token index of each sent row, grouped by destination rank
    send_splits: list[int]    # [ep] rows sent to each rank
    recv_splits: list[int]    # [ep] rows received from each rank
    num_tokens: int           # T on this rank


class TorchDispatcher(Dispatcher):

    def dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Pending:
        """x [T,H], topk_ids [T,k] physical (-1 = none), topk_weights [T,k] -> Pending[Dispatched]."""
        self._check_inputs(x, topk_ids, topk_weights)
        ctx, ep, per = self.ctx, self.ctx.ep_size, self.experts_per_rank
        T, k = topk_ids.shape
        ids = topk_ids.to(device=x.device, dtype=torch.long)
        valid = ids >= 0
        dest = torch.where(valid, ids // per, ep)                                  # [T, k]; ep = nowhere
        member = torch.zeros(T, ep + 1, dtype=torch.bool, device=x.device)
        member.scatter_(1, dest, torch.ones_like(dest, dtype=torch.bool))
        member = member[:, :ep]                                                    # [T, ep] token goes to rank
        dst_rank, send_tok = member.t().nonzero(as_tuple=True)                     # [S], by rank, then token
        send_counts = member.sum(0)                                                # [ep]

        # Metadata row for (token, rank): the local ids of its slots on that rank, -1 elsewhere.
        here = dest[send_tok] == dst_rank[:, None]                                 # [S, k]
        meta_ids = torch.where(here, ids[send_tok] % per, -1).to(torch.int32)
        meta_w = torch.where(here, topk_weights.to(x.device)[send_tok].float(), 0.0)
        # One int32 message for both: the weights travel as their fp32 bit patterns.
        meta = torch.cat([meta_ids, meta_w.view(torch.int32)], dim=1)              # [S, 2k]
        send_x = x[send_tok]                                                       # [S, H]

        recv_counts = torch.empty_like(send_counts)
        with guard_collective(ctx):
            dist.all_to_all_single(recv_counts, send_counts, group=ctx.ep_group)
        # SYNC: the split sizes of the payload all-to-all are host ints.
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        R = sum(recv_splits)
        recv_x = x.new_empty(R, self.hidden)
        recv_meta = meta.new_empty(R, 2 * k)
        with guard_collective(ctx):
            works = [
                dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=ctx.ep_group, async_op=True),
                dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=ctx.ep_group, async_op=True),
            ]

        row_bytes = self.hidden * x.element_size()
        st = self.stats
        st.dispatch_calls += 1
        st.dispatch_bytes += len(send_tok) * row_bytes
        st.dispatch_bytes_remote += (len(send_tok) - send_splits[ctx.ep_rank]) * row_bytes
        st.meta_bytes += meta.numel() * meta.element_size() + send_counts.numel() * send_counts.element_size()
        handle = _Handle(send_tok, send_splits, recv_splits, T)

        def finish() -> Dispatched:
            recv_ids = recv_meta[:, :k].long()
            recv_w = recv_meta[:, k:].contiguous().view(torch.float32)
            return Dispatched(recv_x, recv_ids, recv_w, handle)

        return Pending(ctx, works, finish)

    def combine_start(self, y: Tensor, handle: _Handle) -> Pending:
        """y [R,H] (row order of the Dispatched) -> Pending[[T,H]] on the source rank."""
        R = sum(handle.recv_splits)
        if y.dim() != 2 or y.shape != (R, self.hidden):
            raise ValueError(f"combine expects y [{R}, {self.hidden}] (the dispatched rows), got {list(y.shape)}")
        ctx = self.ctx
        back = y.new_empty(len(handle.send_tok), self.hidden)                      # [S, H]
        with guard_collective(ctx):
            work = dist.all_to_all_single(back, y.contiguous(), handle.send_splits, handle.recv_splits,
                                          group=ctx.ep_group, async_op=True)
        row_bytes = self.hidden * y.element_size()
        st = self.stats
        st.combine_calls += 1
        st.combine_bytes += R * row_bytes
        st.combine_bytes_remote += (R - handle.recv_splits[ctx.ep_rank]) * row_bytes

        def finish() -> Tensor:
            # Sum the <= ep partial sums per token; low-precision activations accumulate in fp32.
            acc = torch.float32 if y.element_size() < 4 else y.dtype
            out = torch.zeros(handle.num_tokens, self.hidden, dtype=acc, device=y.device)
            return out.index_add_(0, handle.send_tok, back.to(acc)).to(y.dtype)

        return Pending(ctx, [work], finish)
