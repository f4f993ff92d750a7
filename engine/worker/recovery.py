"""One rank's part of surviving a lost rank (`[parallel] on_rank_loss = "continue"`).

    stats = recover(core)      # every survivor, from its step loop, outside any exception handler

1. Drop what the engine wired over the old process groups (EngineCore.unwire: dispatchers, DBO's groups, the step
   sync, EPLB), then re-form the ranks over the survivors (parallel/reform.py: agreement, new groups, renumbering).
2. Re-plan every group of routed experts the model family names (engine/model/family.py ExpertGroup: the decoder
   layers', by EPLB's recorded load; the MTP layers', uniformly) over the survivors (eplb/survivors.py: every
   logical expert keeps a replica, what a survivor holds stays) and fill the new slots: a local copy, else a peer
   copy from a surviving holder (point-to-point over the new group), else the checkpoint files, which every rank
   can read (engine/worker/relayout.py, shared with a resize on request). If an expert can be had from nowhere,
   every survivor raises the same error.
3. Wire again over the survivors' context (EngineCore.rewire: the step that built the dispatcher, DBO, the step sync,
   EPLB and the runner at start-up).

Requests on the survivors keep going where they were (their KV is untouched); the front re-admits
the lost rank's requests (engine/front/front.py). The scheduler's state needs nothing: a step that failed
mid-forward never reached Scheduler.apply, so it is simply scheduled again.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from wideep.eplb.survivors import plan_survivors
from wideep.parallel.reform import reform
from wideep.parallel.watchdog import guard_collective

from . import relayout


def recover(core) -> dict:
    """Re-form the ranks and re-lay the experts over the survivors; -> figures for the metrics."""
    t0 = time.monotonic()
    old = core.ctx
    old_ep, old_members = old.ep_size, list(old.members) if old.members is not None else list(range(old.world_size))
    groups = core.family.expert_groups(core.loaded)
    load = _window_load(core)
    core.unwire()
    ctx = reform(old)
    survivors_old = [old_members.index(m) for m in ctx.members]     # their old EP ranks, in new order
    stats = {"lost": sorted(set(old_members) - set(ctx.members)), "members": list(ctx.members),
             "epoch": ctx.epoch, "reform_s": ctx.recovery_s}
    if groups:
        stats.update(_relayout(core, ctx, groups, old_ep, survivors_old, load))
    core.rewire(ctx)
    stats["recovery_s"] = time.monotonic() - t0
    return stats


def _window_load(core) -> torch.Tensor | None:
    """EPLB's recorded load per logical expert on this rank ([L, E]), or None (uniform). Local only:
    the old group cannot be trusted for an all-reduce; the survivors sum theirs after re-forming."""
    if core.eplb is None:
        return None
    return core.eplb.local_window_load().to(torch.float64)


def _relayout(core, ctx, groups: list, old_ep: int, survivors_old: list[int], load: torch.Tensor | None) -> dict:
    """Every expert group re-planned over the survivors and its new slots filled over their new group
    (engine/worker/relayout.py); the layers take their new experts and the group's routing the new placement."""
    if load is not None:   # the survivors' recorded windows, summed
        with guard_collective(ctx):
            dist.all_reduce(load, group=ctx.cpu_group)
    plans = [plan_survivors(g.placement.phy2log, old_ep, survivors_old, core.config.moe.n_group,
                            load if g.rebalanced else None) for g in groups]
    moved, stats = relayout.move(core, ctx, groups, plans, list(range(ctx.world_size)))
    return dict(stats, **relayout.install(core, ctx, groups, plans, moved))
