"""Re-forming the ranks after a loss (`[parallel] on_rank_loss = "continue"`): the survivors agree on
who is left, leave the broken process groups and form new ones among themselves.

    ctx = reform(ctx)          # every survivor, once it knows of a loss (a failed collective, the watchdog)

Agreement. The front (origin rank 0) hosts the rendezvous store and leads; its own loss ends the job
(there is nobody to hold the requests or the store). Each survivor checks in under the next epoch's
keys; the leader waits until every rank not declared lost has checked in (re-reading the verdict
log meanwhile, so a second loss during recovery is folded in), then publishes the members. A rank
that finds itself left out was declared lost while alive (silent past the timeout): it exits.

New groups. Members keep their order (their origin ranks ascending) and are renumbered 0..n-1. The
old process group is destroyed, a new one is formed over a PrefixStore of the same store under the
epoch's namespace (no key of an earlier epoch is read again), with new CPU and node groups and a new
watchdog ring. Ranks are addressed by their *origin* rank (their rank at start-up) outside
torch.distributed, e.g. by the engine's control channel, so nothing else renumbers.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from .context import ParallelContext
from .watchdog import RankLostError, Watchdog

NAMESPACE = "wideep/elastic/"


def origin_of(ctx: ParallelContext, rank: int) -> int:
    return ctx.members[rank] if ctx.members is not None else rank


def reform(ctx: ParallelContext, release=None) -> ParallelContext:
    """-> the context over the survivors (this rank renumbered). Raises RankLostError when the front
    (origin rank 0) is among the lost: the job cannot continue without it. release(): drops every
    other reference the caller holds to the old groups (dispatchers, overlap groups): a gloo group's
    connections close only once nothing refers to it, and until they close a peer blocked in a
    collective with this rank waits out its timeout instead of failing at once."""
    t0 = time.monotonic()
    wd = ctx.watchdog
    epoch = ctx.epoch + 1
    store = dist.PrefixStore(f"{NAMESPACE}{epoch}/", ctx.store)
    members = list(ctx.members) if ctx.members is not None else list(range(ctx.world_size))
    me = members[ctx.rank]
    lost = {origin_of(ctx, r) for r in (wd.lost_ranks() if wd is not None else [])}
    if 0 in lost:
        raise RankLostError([0], "the front (rank 0) is lost: it holds the requests and the rendezvous store; "
                                 "the job cannot continue without it")
    # Leave the broken groups first: a peer still blocked in a collective with this rank then fails
    # at once (its connection closes) and comes here too, instead of waiting out the timeout.
    if release is not None:
        release()
    ctx.ep_group = ctx.cpu_group = ctx.node_group = None
    dist.destroy_process_group()
    gc.collect()
    store.set(f"alive/{me}", "1")
    if me == 0:
        survivors = _lead(ctx, store, members)
        store.set("members", json.dumps(survivors))
    else:
        # Polled, not store.wait(): a blocking wait on the client the watchdog thread shares can sit
        # out its whole timeout after the key is set.
        deadline = time.monotonic() + ctx.timeout_s
        while not store.check(["members"]):
            if time.monotonic() > deadline:
                raise RankLostError([0], f"the front published no members within {ctx.timeout_s:g} s of the loss")
            time.sleep(0.01)
        survivors = json.loads(store.get("members"))
    if me not in survivors:
        print(f"wideep: rank {me} was declared lost by the others (silent past the timeout); exiting",
              file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    if wd is not None:
        wd.stop(done=True, linger=False)
    new = _connect(ctx, store, survivors, epoch, watch=wd)
    new.recovery_s = time.monotonic() - t0
    return new


def regroup(ctx: ParallelContext, members: list[int], tag: str, release=None) -> ParallelContext | None:
    """A resize on request: every rank of ctx leaves its groups, and the ranks named in members (origin ranks,
    in their new order; every one alive, so no agreement is needed) form new ones under the next epoch.
    -> the new context, or None on a rank that is not a member (it leaves: its watchdog says goodbye, so
    nobody takes its exit for a loss). tag: the resize's name; the new groups rendezvous under the epoch and
    it, so a new rank still waiting from a grow that failed can never meet a later resize. release(): as for
    reform."""
    t0 = time.monotonic()
    epoch = ctx.epoch + 1
    if release is not None:
        release()
    if ctx.watchdog is not None:
        ctx.watchdog.stop(done=True, linger=False)
    stayed = origin_of(ctx, ctx.rank) in members
    ctx.ep_group = ctx.cpu_group = ctx.node_group = None
    dist.destroy_process_group()
    gc.collect()
    if not stayed:
        return None
    new = _connect(ctx, resize_store(ctx.store, epoch, tag), members, epoch, watch=ctx.watchdog)
    new.recovery_s = time.monotonic() - t0
    return new


def resize_store(store, epoch: int, tag: str):
    """Where a resize's new groups rendezvous: under the epoch, then the resize's own name."""
    return dist.PrefixStore(f"{NAMESPACE}{epoch}/{tag}/", store)


def _lead(ctx: ParallelContext, store, members: list[int]) -> list[int]:
    """The front: wait for every member not declared lost to check in; -> the survivors, in order."""
    wd = ctx.watchdog
    deadline = time.monotonic() + ctx.timeout_s
    while True:
        lost = {origin_of(ctx, r) for r in (wd.lost_ranks() if wd is not None else [])}
        if wd is not None:
            lost |= {origin_of(ctx, int(r)) for v in wd.verdicts() for r in v["lost"]}
        waiting = [m for m in members if m not in lost]
        if store.check([f"alive/{m}" for m in waiting]):
            return waiting
        if time.monotonic() > deadline:
            missing = [m for m in waiting if not store.check([f"alive/{m}"])]
            raise RankLostError(missing, f"did not check in within {ctx.timeout_s:g} s of the loss")
        time.sleep(0.02)


def _connect(ctx: ParallelContext, store, survivors: list[int], epoch: int, watch=None,
             origin: int | None = None) -> ParallelContext:
    """The new groups over survivors (origin ranks); watch: the old watchdog (its settings, where ctx has none);
    origin: this rank's origin rank (default: its own in ctx)."""
    me = survivors.index(origin_of(ctx, ctx.rank) if origin is None else origin)
    n = len(survivors)
    timeout = timedelta(seconds=ctx.timeout_s)
    dist.init_process_group(ctx.backend, store=store, rank=me, world_size=n, timeout=timeout,
                            **({"device_id": ctx.device} if ctx.backend == "nccl" else {}))
    world = dist.group.WORLD
    cpu_group = world if ctx.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    settings = ctx.watch_settings
    if settings is None and watch is not None:   # a context built before watch_settings existed (tests)
        settings = dict(heartbeat_s=watch.heartbeat_s, timeout_s=watch.timeout_s, lost_after_s=watch.lost_after_s,
                        store_host_rank=watch.store_host_rank, on_lost=watch.on_lost, store_addr=watch.store_addr,
                        host=watch.host, advertise=watch.advertise)
    watchdog = None
    if settings is not None and n > 1:   # a lone rank has no peer to watch (a ring needs two)
        watchdog = Watchdog(lambda: dist.PrefixStore("watchdog/", store), me, n, **settings).start()
    # After a loss the nodes are no longer equal: the survivors run as one flat node.
    return dataclasses.replace(
        ctx, rank=me, world_size=n, local_rank=me, local_world_size=n, node_rank=0, num_nodes=1,
        dp_rank=me, dp_size=n, ep_rank=me, ep_size=n, ep_group=world, cpu_group=cpu_group, node_group=world,
        watchdog=watchdog, members=tuple(survivors), epoch=epoch, watch_settings=settings)
