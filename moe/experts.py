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
        scatter-add back: one gather, one pass over the experts that got tokens, one scatter."""
        flat_ids = topk_ids.reshape(-1)                                        # [R*k]
        valid = (flat_ids >= 0).nonzero().squeeze(1)
        order = valid[flat_ids[valid].argsort(stable=True)]                    # pair index, by expert
        counts = torch.bincount(flat_ids[order], minlength=self.num_local)
        rows = order // topk_ids.shape[1]
        xs = x[rows]                                                           # [M, H]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):  # SYNC: segment bounds drive the per-expert GEMMs
            if n:
                ys[start:start + n] = self._expert(e, xs[start:start + n])
                start += n
        ys *= topk_weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, ys)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if self.backend == "reference":
            return self.forward_reference(x, topk_ids, topk_weights)
        return self.forward_grouped(x, topk_ids, topk_weights)
