"""The DP side of wide EP: request assignment, the per-step lockstep sync, results back to every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.context import ParallelContext
from parallel.watchdog import guard_collective


def least_loaded(load: list[int]) -> int:
    """The DP rank with the fewest tokens in flight (lowest rank on ties)."""
    return min(range(len(load)), key=lambda r: (load[r], r))


class StepSync:
    """One small all-reduce per step: does any rank have work, may every rank split the step for
    DBO, and rank 0's vote on splitting. Ranks without work then run a zero-token dummy step so that
    every rank enters every MoE all-to-all (of both microbatches when split)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx
        self.max_tokens = 0   # after sync(): the largest token count of any rank this step

    def sync(self, has_work: bool, can_split: bool = False, vote: bool = False,
             num_tokens: int = 0) -> tuple[bool, bool]:
        """-> (any rank has work, split this step). Split needs rank 0's vote and every rank's consent."""
        if self.ctx.is_single:
            self.max_tokens = num_tokens
            return has_work, can_split and vote
        # MAX of [has work, cannot split, vote (rank 0's only), tokens]
        flags = torch.tensor([int(has_work), int(not can_split), int(vote and self.ctx.rank == 0), num_tokens],
                             dtype=torch.int64)
        with guard_collective(self.ctx):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
        any_work, cannot, vote_0, self.max_tokens = flags.tolist()  # SYNC: the step loop's control flow
        return bool(any_work), bool(vote_0) and not cannot


def gather_outputs(ctx: ParallelContext, local: dict[int, object], n: int) -> list:
    """Every rank's {input index: output} -> all outputs in input order, on every rank."""
    if ctx.is_single:
        return [local[i] for i in range(n)]
    parts: list = [None] * ctx.world_size
    with guard_collective(ctx):
        dist.all_gather_object(parts, local, group=ctx.cpu_group)
    merged = {}
    for p in parts:
        merged.update(p)
    return [merged[i] for i in range(n)]
