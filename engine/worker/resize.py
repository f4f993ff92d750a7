"""One rank's part of a resize on request (`POST /scale_elastic_ep`, Engine.start_resize): the ranks named
in the RESIZE command form the new shape, the others leave.

    stats = resize(core, members, tag)   # every rank of the old shape, in the same step (the step sync's command)

Grow (today's ranks followed by new ones, which the launcher started and which loaded the model meanwhile:
engine/worker/join.py): the new shape's group forms first (the running ranks regroup, the new ones join), the
plans reach the new ranks from rank 0, and the experts move over the new group (settle): the new ranks get
theirs from the ranks that hold them.

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


def resize(core, members: list[int], tag: str) -> dict | None:
    """-> figures for the front (members, epoch, seconds, expert bytes moved), or None on a rank that left.
    tag: the resize's name, under which the new groups rendezvous (parallel/reform.py regroup)."""
    t0 = time.monotonic()
    old = core.ctx
    old_members = [origin_of(old, r) for r in range(old.world_size)]
    grow = members[:old.world_size] == old_members and len(members) > old.world_size
    if not grow and any(m not in old_members for m in members):   # the front asks for nothing else: a bug
        raise RuntimeError(f"resize to members {members}: neither a prefix of the running ranks {old_members} "
                           f"nor those followed by new ones")
    stay = [old_members.index(m) if m in old_members else None for m in members]   # new EP rank -> its old one
    groups = core.family.expert_groups(core.loaded)
    load = None
    if core.eplb is not None:   # every old rank is alive: sum the windows now, over the old group
        load = core.eplb.local_window_load().to(torch.float64)
        with guard_collective(old):
            dist.all_reduce(load, group=old.cpu_group)
    plans = [plan_resize(g.placement.phy2log, old.ep_size, stay, list(range(old.ep_size)), core.config.moe.n_group,
                         load if g.rebalanced else None) for g in groups]
    if grow:   # the new ranks hold nothing yet: form the new group first, then move over it
        core.unwire()
        ctx = regroup(old, members, tag)
        stats = settle(core, ctx, plans)
    else:      # a leaving rank gives its experts over the old group, then goes
        moved, stats = relayout.move(core, old, groups, plans, stay) if groups else (None, {})
        core.unwire()
        ctx = regroup(old, members, tag)
        if ctx is None:
            return None
        if groups:
            stats.update(relayout.install(core, ctx, groups, plans, moved))
        core.rewire(ctx)
    return dict(stats, members=list(members), epoch=ctx.epoch, regroup_s=ctx.recovery_s,
                resize_s=time.monotonic() - t0)


def settle(core, ctx, plans: list | None) -> dict:
    """A grow, on every rank of the new shape once its group formed: rank 0's plans reach the new ranks (which
    come with plans=None: they do not know the running placement), the experts move over the new group (old EP
    ranks keep their numbers: the new ranks come last), and every rank wires over it (collective)."""
    groups = core.family.expert_groups(core.loaded)
    stats = {}
    if groups:
        box = [plans if ctx.rank == 0 else None]
        with guard_collective(ctx):
            dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
        plans = box[0]
        moved, stats = relayout.move(core, ctx, groups, plans, list(range(ctx.world_size)))
        stats.update(relayout.install(core, ctx, groups, plans, moved))
    core.rewire(ctx)
    return stats
