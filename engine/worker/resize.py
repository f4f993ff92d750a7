"""One rank's part of a resize on request (`POST /scale_elastic_ep`, Engine.start_resize): the ranks named
in the RESIZE command form the new shape, the others leave.

    stats = resize(core, members)     # every rank of the old shape, in the same step (the step sync's command)

Shrink (the members are a prefix of today's ranks): every old rank is alive, so nothing is lost and nothing
comes from the checkpoint.
1. EPLB's recorded load is summed over the old group (the new placement weighs it, as a rebalance would).
2. Every expert group is re-planned for the new EP size (eplb/survivors.py plan_resize: every expert keeps a
   replica, what a staying rank holds stays) and the new slots are filled over the old group
   (engine/worker/relayout.py): a leaving rank gives the experts only it held before it goes.
3. The engine's wiring is dropped (EngineCore.unwire), the ranks leave the old groups and the members form
   new ones under the next epoch (parallel/reform.py regroup); the members take their new experts and wire
   again (EngineCore.rewire). A leaving rank returns None: its loop ends and its process exits 0.

Requests on the staying ranks keep their KV and go on where they were; the front moved the leaving ranks'
requests (engine/front/resize.py).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from wideep.eplb.survivors import plan_resize
from wideep.parallel.reform import origin_of, regroup
from wideep.parallel.watchdog import guard_collective

from . import relayout


def resize(core, members: list[int]) -> dict | None:
    """-> figures for the front (members, epoch, seconds, expert bytes moved), or None on a rank that left."""
    t0 = time.monotonic()
    old = core.ctx
    old_members = [origin_of(old, r) for r in range(old.world_size)]
    unknown = [m for m in members if m not in old_members]
    if unknown:   # the front only sends shrinks (engine/front/resize.py checks); a bug otherwise
        raise RuntimeError(f"resize to members {members}: ranks {unknown} are not running (running: {old_members})")
    stay = [old_members.index(m) for m in members]                 # new EP rank j -> its old EP rank
    groups = core.family.expert_groups(core.loaded)
    load = None
    if core.eplb is not None:   # every old rank is alive: sum the windows now, over the old group
        load = core.eplb.local_window_load().to(torch.float64)
        with guard_collective(old):
            dist.all_reduce(load, group=old.cpu_group)
    plans = [plan_resize(g.placement.phy2log, old.ep_size, stay, list(range(old.ep_size)), core.config.moe.n_group,
                         load if g.rebalanced else None) for g in groups]
    moved, stats = relayout.move(core, old, groups, plans, stay) if groups else (None, {})
    core.unwire()
    ctx = regroup(old, members)
    if ctx is None:
        return None
    if groups:
        stats.update(relayout.install(core, ctx, groups, plans, moved))
    core.rewire(ctx)
    return dict(stats, members=list(members), epoch=ctx.epoch, regroup_s=ctx.recovery_s,
                resize_s=time.monotonic() - t0)
