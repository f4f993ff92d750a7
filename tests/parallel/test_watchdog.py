"""Watchdog logic in one process on an in-memory store, with tiny intervals (no ranks spawned)."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from parallel import ParallelContext, RankLostError, Watchdog, guard_collective


def _watchdog(store, rank=0, world=3, lost=None, **kw):
    got = lost if lost is not None else []
    return Watchdog(lambda: store, rank, world, heartbeat_s=0.05, lost_after_s=0.4,
                    on_lost=got.append, **kw)


def test_silent_peer_is_lost_and_done_peer_is_not():
    store = dist.HashStore()
    for r in range(3):
        Watchdog.announce(store, r)
    lost: list[str] = []
    wd = _watchdog(store, lost=lost).start()
    peer = _watchdog(store, rank=1).start()      # beats; rank 2 never does
    try:
        assert wd.wait_lost(3.0) == [2]
        time.sleep(0.2)
        assert lost and "wideep: rank 2 lost (no heartbeat for" in lost[0]
        assert peer.lost_ranks() == [2]          # every rank reaches the same verdict
    finally:
        peer.stop()
        wd.stop()
    store2 = dist.HashStore()
    for r in range(2):
        Watchdog.announce(store2, r)
    a, b = _watchdog(store2, 0, 2).start(), _watchdog(store2, 1, 2).start()
    b.stop(done=True)                            # left on purpose: silence is not a loss
    time.sleep(0.8)
    assert a.lost_ranks() == []
    a.stop()


def test_unreachable_store_names_its_host():
    class Dead:
        def set(self, *a):
            raise RuntimeError("connection refused")
        multi_get = set
    lost: list[str] = []
    wd = Watchdog(lambda: Dead(), 1, 2, heartbeat_s=0.05, lost_after_s=0.3, on_lost=lost.append)
    wd._store = Dead()
    wd._thread.start()                           # start() would fail on its first beat, by design
    assert wd.wait_lost(3.0) == [0]
    time.sleep(0.2)
    assert "rank 0 lost" in lost[0] and "store hosted by rank 0 is unreachable" in lost[0]
    wd.stop(done=False)


def test_guard_collective_converts_only_when_a_rank_is_lost():
    class FakeWatchdog:
        heartbeat_s, lost_after_s = 0.01, 0.05
        def __init__(self, lost): self.lost = lost
        def wait_lost(self, timeout_s): return self.lost
        def describe(self, ranks): return "no heartbeat for 9.0 s"
        def linger_for_peers(self): pass
    ctx = ParallelContext(world_size=3, watchdog=FakeWatchdog([2]))
    with pytest.raises(RankLostError, match=r"^rank 2 lost \(no heartbeat for 9.0 s\)") as e:
        with guard_collective(ctx):
            raise RuntimeError("Connection closed by peer")
    assert e.value.ranks == [2] and "Connection closed" in str(e.value.__cause__)
    ctx.watchdog = FakeWatchdog([])
    with pytest.raises(RuntimeError, match="unrelated"):
        with guard_collective(ctx):
            raise RuntimeError("unrelated")
    with pytest.raises(ValueError):
        with guard_collective(ctx):
            raise ValueError("not a collective failure")


def test_peer_verdict_is_adopted_and_store_host_lingers_until_reported():
    """Rank 0 (store host) already declared rank 2 lost; rank 1, whose own view of rank 2 is
    fresh, adopts the verdict at its next beat, and rank 0's linger returns once rank 1 reported."""
    store = dist.HashStore()
    for r in range(3):
        Watchdog.announce(store, r)
    store.set("lost_by/0", "2")
    host = Watchdog(lambda: store, 0, 3, heartbeat_s=0.05, lost_after_s=30.0, on_lost=lambda m: None)
    host._store, host._lost = store, {2: 31.0}  # as its own check would have left it
    peer = Watchdog(lambda: store, 1, 3, heartbeat_s=0.05, lost_after_s=30.0, on_lost=lambda m: None).start()
    try:
        assert peer.wait_lost(2.0) == [2]            # long before its own 30 s threshold
        assert store.get("lost_by/1") == b"2"
        t = time.monotonic()
        host.linger_for_peers()
        assert time.monotonic() - t < 1.0
    finally:
        peer.stop(done=False)
