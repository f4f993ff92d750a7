"""The lockstep: one small fixed-size all-reduce per step among the ranks of a domain, and the
SPMD helper that gathers every rank's outputs for LLM.generate."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from wideep.parallel.context import ParallelContext
from wideep.parallel.step_plan import StepPlan
from wideep.parallel.watchdog import guard_collective


@dataclass(frozen=True)
class SyncResult:
    any_work: bool       # some rank has work: every rank steps (a rank without tokens runs a dummy step)
    plan: StepPlan       # the step's plan, the same on every rank
    command: int = 0     # END / SHUTDOWN agreed this step (every rank leaves its loop), else 0
    command_seq: int = 0


class StepSync:
    """One all-reduce (MAX) of six int64s per step, whatever the world size and the batch: has work,
    cannot split, rank 0's split vote, tokens this step, a pending command (seq * 4 + kind) and the MTP
    drafter's forwards this step (speculative decoding; 0 without it). Ranks
    without work then run a zero-token dummy step so that every rank enters every MoE all-to-all (of
    both microbatches when split). low_latency_max_tokens: the dispatcher's (0 = no low-latency
    mode), so every rank's plan picks the same dispatch mode. group: the domain's host-side group
    (default ctx.cpu_group)."""

    WIDTH = 6

    def __init__(self, ctx: ParallelContext, low_latency_max_tokens: int = 0, group=None):
        self.ctx, self.low_latency_max_tokens = ctx, low_latency_max_tokens
        self.group = group if group is not None else ctx.cpu_group
        self.calls = 0
        self.bytes = 0          # payload all-reduced so far (not the transport's own copies)

    def sync(self, has_work: bool, can_split: bool = False, vote: bool = False, num_tokens: int = 0,
             command: int = 0, draft_passes: int = 0) -> SyncResult:
        if self.ctx.is_single:
            any_work, split, max_tokens, code, passes = has_work, can_split and vote, num_tokens, command, draft_passes
        else:
            flags = torch.tensor([int(has_work), int(not can_split), int(vote and self.ctx.rank == 0), num_tokens,
                                  command, draft_passes], dtype=torch.int64)
            with guard_collective(self.ctx):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            self.calls += 1
            self.bytes += flags.numel() * flags.element_size()
            any_work, cannot, vote_0, max_tokens, code, passes = flags.tolist()  # SYNC: the step loop's control flow
            split = bool(vote_0) and not cannot
        plan = StepPlan.make(max_tokens, split, self.low_latency_max_tokens, passes) if any_work else StepPlan()
        return SyncResult(bool(any_work), plan, code % 4, code // 4)


    def agree_max(self, value: int) -> int:
        """The largest of every rank's value (collective; once per resize, never per step): e.g. the wave a
        rank that just joined takes from the running ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        with guard_collective(self.ctx):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)


def gather_outputs(ctx: ParallelContext, local: dict[int, object], n: int) -> list:
    """Every rank's {input index: output} -> all outputs in input order, on every rank (SPMD API
    only: LLM.all_stats; never in a step)."""
    if ctx.is_single:
        return [local[i] for i in range(n)]
    parts: list = [None] * ctx.world_size
    with guard_collective(ctx):
        dist.all_gather_object(parts, local, group=ctx.cpu_group)
    merged = {}
    for p in parts:
        merged.update(p)
    return [merged[i] for i in range(n)]
