"""The DP side of wide EP: request assignment, the per-step lockstep sync, results back to every
rank, and the doorbell that lets worker ranks wait for the front indefinitely."""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.context import ParallelContext
from parallel.step_plan import StepPlan
from parallel.watchdog import RankLostError, guard_collective


def least_loaded(load: list[int]) -> int:
    """The DP rank with the fewest tokens in flight (lowest rank on ties)."""
    return min(range(len(load)), key=lambda r: (load[r], r))


class StepSync:
    """One small all-reduce per step: does any rank have work, may every rank split the step for
    DBO, rank 0's vote on splitting, and the largest token count of any rank. Ranks without work then
    run a zero-token dummy step so that every rank enters every MoE all-to-all (of both microbatches
    when split). low_latency_max_tokens: the dispatcher's (Dispatcher.low_latency_max_tokens; 0 =
    no low-latency mode), so every rank's plan picks the same dispatch mode."""

    def __init__(self, ctx: ParallelContext, low_latency_max_tokens: int = 0):
        self.ctx, self.low_latency_max_tokens = ctx, low_latency_max_tokens

    def sync(self, has_work: bool, can_split: bool = False, vote: bool = False,
             num_tokens: int = 0) -> tuple[bool, StepPlan]:
        """-> (any rank has work, the step's plan). Split needs rank 0's vote and every rank's consent."""
        if self.ctx.is_single:
            any_work, split, max_tokens = has_work, can_split and vote, num_tokens
        else:
            # MAX of [has work, cannot split, vote (rank 0's only), tokens]: one fixed-size message
            flags = torch.tensor([int(has_work), int(not can_split), int(vote and self.ctx.rank == 0), num_tokens],
                                 dtype=torch.int64)
            with guard_collective(self.ctx):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
            any_work, cannot, vote_0, max_tokens = flags.tolist()  # SYNC: the step loop's control flow
            split = bool(vote_0) and not cannot
        return bool(any_work), StepPlan.make(max_tokens, split, self.low_latency_max_tokens)


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


class Doorbell:
    """Worker ranks wait for rank 0's next control message on a store key, not inside the broadcast.

    A collective gives up after timeout_s, but a serving front may stay idle for hours. So before
    each control broadcast rank 0 sets key n ("ring"), and a worker first waits for key n in short
    polls, checking for lost ranks between them ("wait"), then enters the broadcast, which no longer
    waits long. Keys are namespaced per engine (engines are built in the same order on every rank)
    and deleted in batches once every worker is known to be past them (ack() after a gather)."""

    _engines = itertools.count()

    def __init__(self, ctx: ParallelContext, poll_s: float = 1.0):
        self.ctx, self.store, self.poll_s = ctx, ctx.store, poll_s
        self.prefix = f"wideep/engine{next(Doorbell._engines)}/ctl/"
        self.seq = 0
        self._rung: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.store is not None and not self.ctx.is_single

    def ring(self) -> None:
        """Rank 0, right before a control broadcast."""
        if not self.enabled:
            return
        key = f"{self.prefix}{self.seq}"
        self.seq += 1
        self.store.set(key, b"1")
        self._rung.append(key)

    def ack(self) -> None:
        """Rank 0, after a gather: every worker has passed every key rung so far."""
        if self.enabled and len(self._rung) >= 64:
            for key in self._rung:
                self.store.delete_key(key)
            self._rung.clear()

    def wait(self) -> None:
        """Workers, before a control broadcast: block until rank 0 rang, however long that takes."""
        if not self.enabled:
            return
        key = f"{self.prefix}{self.seq}"
        self.seq += 1
        while True:
            try:
                self.store.wait([key], timedelta(seconds=self.poll_s))
                return
            except Exception as e:
                wd = self.ctx.watchdog
                timed_out = "timeout" in str(e).lower() or "timed out" in str(e).lower()
                # a store that went away: give the watchdog time to say whether rank 0 is gone
                lost = wd.wait_lost(0 if timed_out else wd.lost_after_s + 2 * wd.heartbeat_s) if wd else []
                if lost:
                    raise RankLostError(lost, wd.describe(lost)) from e
                if not timed_out:
                    raise
