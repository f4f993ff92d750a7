"""Moving the routed experts to a new placement over a new set of ranks: after a lost rank
(engine/worker/recovery.py) and on a resize on request (engine/worker/resize.py).

    moved = move(core, xctx, groups, plans, dest)     # every rank of the transfer group xctx (collective)
    install(core, ctx, groups, plans, moved)          # every rank of the new shape, over its final context

The transfer group carries the weights: after a loss it is the survivors' new group; on a shrink the old group
(every old rank is alive, so a leaving rank gives its experts before it goes). A plan's sources
(eplb/survivors.py) name their holders by rank in the transfer group; dest[j] is the transfer-group rank that
becomes new EP rank j. Each new slot is filled from a local copy, else a peer's copy (point-to-point over the
transfer group), else the checkpoint files, which every rank can read. If an expert can be had from nowhere,
every rank raises the same error.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from wideep.eplb.placement import Placement
from wideep.eplb.survivors import CHECKPOINT, LOCAL, PEER
from wideep.moe.layer import ExpertShard
from wideep.parallel.watchdog import guard_collective

from ..model.loader import load_weights


class ExpertsUnavailable(RuntimeError):
    """Some logical expert has no surviving replica and the checkpoint cannot supply it."""


def move(core, xctx, groups: list, plans: list, dest: list[int]) -> tuple[list | None, dict]:
    """Every group's new slots filled on the ranks of the new shape. -> (per group, the new experts of each of its
    layers — None on a rank that is not in dest —, figures: bytes received from peers and read from the
    checkpoint)."""
    me = xctx.rank
    j = dest.index(me) if me in dest else None
    peer_bytes = ckpt_bytes = from_ckpt = 0
    moved = [] if j is not None else None
    for g, plan in zip(groups, plans):
        k_new = plan.slots_per_rank
        new_experts = [m.experts.empty_like(k_new) for m in g.layers] if j is not None else None
        peer_bytes += _copy_local_and_peers(xctx, plan, g.layers, new_experts, k_new, dest)
        targets = {}
        if j is not None:
            mine = range(j * k_new, (j + 1) * k_new)
            for l, ex in enumerate(new_experts):
                for p in mine:
                    if plan.sources[l][p].kind == CHECKPOINT:
                        targets.update(g.names(ex, l, int(plan.phy2log[l, p]), p - mine.start))
            moved.append(new_experts)
        ckpt_bytes += _load_from_checkpoint(core, xctx, targets, plan)
        from_ckpt += len(plan.missing())
    return moved, {"expert_bytes_peer": peer_bytes, "expert_bytes_checkpoint": ckpt_bytes,
                   "experts_from_checkpoint": from_ckpt}


def install(core, ctx, groups: list, plans: list, moved: list) -> dict:
    """The layers take their new experts and each group's routing its new placement, over the new shape's ctx."""
    model, mcfg = core.model, core.config
    shard = None
    for g, plan, new_experts in zip(groups, plans, moved):
        k_new = plan.slots_per_rank
        shard = ExpertShard(ctx.ep_size * k_new, ctx.ep_rank, ctx.ep_size)
        for moe, ex in zip(g.layers, new_experts):
            moe.use_experts(ex, shard)
        g.routing.resize(k_new)
        Placement.from_phy2log(plan.phy2log, mcfg.moe.n_routed_experts).install(g.routing, ctx.ep_rank, ctx.ep_size,
                                                                                 model.device)
    model.use_shard(shard)
    if model.decode_plan is not None:   # the experts are new parameter objects: its weight structs are stale
        model.decode_plan.invalidate()
    return {"num_physical": shard.num_physical, "slots_per_rank": shard.num_local}


def _copy_local_and_peers(ctx, plan, moe_layers, new_experts, k_new: int, dest: list[int]) -> int:
    """Local copies, then one point-to-point exchange per layer: every (sender, receiver) pair's
    experts packed as raw bytes, in an order both sides compute from the plan. -> bytes received."""
    me, received = ctx.rank, 0
    for l, moe in enumerate(moe_layers):
        old_params = list(moe.experts.parameters())
        new_params = list(new_experts[l].parameters()) if new_experts is not None else None
        sends: dict[int, list[int]] = {}                       # receiver -> my old slots to send
        recvs: dict[int, list[int]] = {}                       # sender -> my new local slots to fill
        for p, src in enumerate(plan.sources[l]):
            j = p // k_new
            dst = dest[j]
            if src.kind == LOCAL and dst == me:
                for o, n in zip(old_params, new_params):
                    n.data[p - j * k_new] = o.data[src.slot]
            elif src.kind == PEER:
                if src.rank == me:
                    sends.setdefault(dst, []).append(src.slot)
                if dst == me:
                    recvs.setdefault(src.rank, []).append(p - j * k_new)
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
    """Experts no rank holds, from the checkpoint files (read as the model's family names them); the same
    error on every rank when some rank could not read them."""
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
