"""Sort (row, slot) pairs by expert into block-aligned segments: the layout grouped GEMMs read.

Legend: R rows, k top-k, P = R*k pairs, El local experts, BM the GEMM's row block.
Pair p is (row p // k, slot p % k); its expert is topk_ids.view(-1)[p] (local id, -1 = not here).
Expert e's pairs occupy positions seg_start[e] .. seg_start[e] + counts[e] of `sorted_pairs`,
and its segment is padded up to a multiple of BM with the sentinel P, so every BM-row block
belongs to exactly one expert. No host sync: the buffer has the worst-case size
P + El * (BM - 1) (rounded to BM), and blocks past `num_padded` are skipped by the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor   # [Mmax] int32 pair index, P where padding
    block_expert: torch.Tensor   # [Mmax / BM] int32 expert of each row block, -1 past the end
    num_padded: torch.Tensor     # [1] int32 rows in use (sum of padded segments)
    counts: torch.Tensor         # [El] int64 pairs per expert
    block_m: int

    @property
    def max_rows(self) -> int:
        return self.sorted_pairs.shape[0]


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    worst = num_pairs + num_experts * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids [R, k] local expert ids (-1 = another rank's) -> Alignment for row block `block_m`."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [R, k], got shape {tuple(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()                                      # [P]
    P = flat.numel()
    bucket = torch.where(flat >= 0, flat, num_experts)                      # invalid pairs sort last
    counts = torch.bincount(bucket, minlength=num_experts + 1)[:num_experts]  # [El]
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    order = torch.argsort(bucket, stable=True)                              # [P] pairs by expert
    e_of = bucket[order]
    valid = e_of < num_experts
    first_of = torch.cumsum(counts, 0) - counts                             # first sorted index per expert
    e_safe = e_of.clamp(max=num_experts - 1)
    dest = seg_start[e_safe] + torch.arange(P, device=dev) - first_of[e_safe]
    mmax = max_padded_rows(P, num_experts, block_m)
    sorted_pairs = torch.full((mmax,), P, dtype=torch.int32, device=dev)
    sorted_pairs[dest[valid]] = order[valid].to(torch.int32)
    block_start = torch.arange(0, mmax, block_m, device=dev)
    block_expert = torch.searchsorted(seg_end, block_start, right=True)     # [Mmax / BM]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = seg_end[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32, device=dev)
    return Alignment(sorted_pairs, block_expert, num_padded, counts, block_m)
