"""One rank's part of surviving a lost rank (`[parallel] on_rank_loss = "continue"`).

    stats = recover(core)      # every survivor, from its step loop, outside any exception handler

1. Drop what the engine wired over the old process groups (EngineCore.unwire: dispatchers, DBO's groups, the step
   sync, EPLB), then re-form the ranks over the survivors (parallel/reform.py: agreement, new groups, renumbering).
2. Re-plan every group of routed experts the model family names (engine/model/family.py ExpertGroup: the decoder
   layers', by EPLB's recorded load; the MTP layers', uniformly) over the survivors (eplb/survivors.py: every
   logical expert keeps a replica, what a survivor holds stays) and fill the new slots: a local copy, else a peer
   copy from a surviving holder (point-to-point over the new group), else the checkpoint files, which every rank
   can read. If an expert can be had from nowhere, every survivor raises the same error.
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

from wideep.eplb.placement import Placement
from wideep.eplb.survivors import CHECKPOINT, LOCAL, PEER, plan_survivors
from wideep.moe.layer import ExpertShard
from wideep.parallel.reform import reform
from wideep.parallel.watchdog import guard_collective

from ..model.loader import load_weights


class ExpertsUnavailable(RuntimeError):
    """Some logical expert has no surviving replica and the checkpoint cannot supply it."""


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
    """Every expert group re-planned over the survivors and its new slots filled; the layers take their new experts
    and the group's routing the new placement."""
    model, mcfg = core.model, core.config
    if load is not None:   # the survivors' recorded windows, summed
        with guard_collective(ctx):
            dist.all_reduce(load, group=ctx.cpu_group)
    peer_bytes = ckpt_bytes = from_ckpt = 0
    shard = None
    for g in groups:
        plan = plan_survivors(g.placement.phy2log, old_ep, survivors_old, mcfg.moe.n_group,
                              load if g.rebalanced else None)
        k_new = plan.slots_per_rank
        P = ctx.ep_size * k_new
        new_experts = [m.experts.empty_like(k_new) for m in g.layers]
        mine = range(ctx.ep_rank * k_new, (ctx.ep_rank + 1) * k_new)
        peer_bytes += _copy_local_and_peers(ctx, plan, g.layers, new_experts, k_new)
        ckpt_targets = {}
        for l, ex in enumerate(new_experts):
            for p in mine:
                if plan.sources[l][p].kind == CHECKPOINT:
                    ckpt_targets.update(g.names(ex, l, int(plan.phy2log[l, p]), p - mine.start))
        ckpt_bytes += _load_from_checkpoint(core, ctx, ckpt_targets, plan)
        from_ckpt += len(plan.missing())
        shard = ExpertShard(P, ctx.ep_rank, ctx.ep_size)
        for moe, ex in zip(g.layers, new_experts):
            moe.use_experts(ex, shard)
        g.routing.resize(k_new)
        Placement.from_phy2log(plan.phy2log, mcfg.moe.n_routed_experts).install(g.routing, ctx.ep_rank, ctx.ep_size,
                                                                                 model.device)
    model.use_shard(shard)
    if model.decode_plan is not None:   # the experts are new parameter objects: its weight structs are stale
        model.decode_plan.invalidate()
    return {"num_physical": shard.num_physical, "slots_per_rank": shard.num_local, "expert_bytes_peer": peer_bytes,
            "expert_bytes_checkpoint": ckpt_bytes, "experts_from_checkpoint": from_ckpt}


def _copy_local_and_peers(ctx, plan, moe_layers, new_experts, k_new: int) -> int:
    """Local copies, then one point-to-point exchange per layer: every (sender, receiver) pair's
    experts packed as raw bytes, in an order both sides compute from the plan. -> bytes received."""
    me, received = ctx.ep_rank, 0
    for l, (moe, ex) in enumerate(zip(moe_layers, new_experts)):
        old_params, new_params = list(moe.experts.parameters()), list(ex.parameters())
        sends: dict[int, list[int]] = {}                       # receiver -> my old slots to send
        recvs: dict[int, list[int]] = {}                       # sender -> my new local slots to fill
        for p, src in enumerate(plan.sources[l]):
            dst = p // k_new
            if src.kind == LOCAL and dst == me:
                for o, n in zip(old_params, new_params):
                    n.data[p - me * k_new] = o.data[src.slot]
            elif src.kind == PEER:
                if src.rank == me:
                    sends.setdefault(dst, []).append(src.slot)
                if dst == me:
                    recvs.setdefault(src.rank, []).append(p - me * k_new)
        row = sum(t[0].numel() * t.element_size() for t in old_params)
        ops, bufs = [], {}
        for dst in sorted(sends):
            idx = torch.tensor(sends[dst])
            packed = torch.cat([t.data[idx].reshape(len(idx), -1).view(torch.uint8) for t in old_params], 1)
            ops.append(dist.P2POp(dist.isend, packed.contiguous(), dst, group=ctx.ep_group))
        for src in sorted(recvs):
            bufs[src] = torch.empty(len(recvs[src]), row, dtype=torch.uint8, device=new_params[0].device)
            ops.append(dist.P2POp(dist.irecv, bufs[src], src, group=ctx.ep_group))
        if ops:
            with guard_collective(ctx):
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        for src, buf in bufs.items():
            off = 0
            for t in new_params:
                n = t[0].numel() * t.element_size()
                vals = buf[:, off:off + n].contiguous().view(t.dtype).view(len(recvs[src]), *t.shape[1:])
                t.data[torch.tensor(recvs[src])] = vals
                off += n
            received += buf.numel()
    return received


def _load_from_checkpoint(core, ctx, targets: dict, plan) -> int:
    """Experts no survivor holds, from the checkpoint files (read as the model's family names them); the same
    error on every survivor when some rank could not read them."""
    error = ""
    nbytes = 0
    if targets:
        try:
            reader = core.family.reader(core.model_dir)
            nbytes = load_weights(reader, targets, ignore=lambda name: True,
                                  num_hidden_layers=core.config.num_hidden_layers, progress=False).bytes_loaded
        except Exception as e:  # a missing or unreadable checkpoint: reported below, on every rank
            error = f"{type(e).__name__}: {e}"
    flag = torch.tensor([int(bool(error))])
    with guard_collective(ctx):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    if int(flag):
        missing = plan.missing()
        shown = ", ".join(f"layer {l} expert {e}" for l, e in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ExpertsUnavailable(
            f"{len(missing)} experts have no surviving replica ({shown}) and the checkpoint at "
            f"{core.model_dir!r} could not supply them" + (f" on this rank: {error}" if error else
                                                           " on another rank") + "; the job cannot continue")
    return nbytes
