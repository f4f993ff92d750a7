"""Routed experts held by one rank, as stacked weights, with two interchangeable forwards.

Legend: R rows (tokens received by this rank), H hidden, I moe_intermediate_size,
El local experts, k top-k. Expert ids here are *local* (0 .. El-1); -1 marks a (row, k) slot
whose expert lives on another rank (the dispatcher's convention, as DeepEP's).
w13 [El, 2I, H]: gate_proj rows then up_proj rows; w2 [El, H, I].
Both forwards return sum over the row's local slots of weight * expert(x): [R, H].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    PAD_LIMIT = 16  # max tokens per expert for the padded batched-GEMM path

    def __init__(self, num_local: int, hidden: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        self.num_local, self.hidden, self.intermediate = num_local, hidden, intermediate
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, intermediate, device=device, dtype=dtype))
        self.backend = "grouped"

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[e])

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """For-loop over experts and their (row, slot) hits; the readable baseline."""
        out = torch.zeros_like(x)
        for e in range(self.num_local):
            rows, slots = torch.where(topk_ids == e)
            if rows.numel() == 0:
                continue
            y = self._expert(e, x[rows]) * topk_weights[rows, slots, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sort (row, slot) pairs by expert once, run each expert on its contiguous segment,
        scatter-add back: one gather, one pass over the experts, one scatter.

        Few pairs per expert (decode): the segments are padded into [El, max_count, H] and run as
        two batched GEMMs, since then reading the expert weights is the cost and one bmm streams
        them at memory speed where a per-expert loop pays a dispatch per expert. Many pairs
        (prefill): a per-expert GEMM on each segment, no padding waste."""
        flat_ids = topk_ids.reshape(-1)                                        # [R*k]
        valid = (flat_ids >= 0).nonzero().squeeze(1)
        order = valid[flat_ids[valid].argsort(stable=True)]                    # pair index, by expert
        sorted_ids = flat_ids[order]
        counts = torch.bincount(sorted_ids, minlength=self.num_local)
        rows = order // topk_ids.shape[1]
        xs = x[rows]                                                           # [M, H]
        counts_host = counts.tolist()  # SYNC: segment bounds drive the GEMM shapes
        max_count = max(counts_host) if counts_host else 0
        if 0 < max_count <= self.PAD_LIMIT:
            starts = torch.cumsum(counts, 0) - counts
            within = torch.arange(len(order), device=x.device) - starts[sorted_ids]
            padded = x.new_zeros(self.num_local, max_count, self.hidden)
            padded[sorted_ids, within] = xs
            gate, up = torch.bmm(padded, self.w13.transpose(1, 2)).chunk(2, dim=-1)
            ys = torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))[sorted_ids, within]   # [M, H]
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts_host):
                if n:
                    gate, up = F.linear(xs[start:start + n], self.w13[e]).chunk(2, dim=-1)
                    torch.mm(F.silu(gate) * up, self.w2[e].t(), out=ys[start:start + n])
                    start += n
        ys *= topk_weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, ys)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if self.backend == "reference":
            return self.forward_reference(x, topk_ids, topk_weights)
        return self.forward_grouped(x, topk_ids, topk_weights)
