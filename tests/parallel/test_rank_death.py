"""A rank that dies mid-run makes every other rank exit non-zero within the timeout, naming it."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.parallel.spawn import run, spawn

TIMEOUT_S, HEARTBEAT_S = 20.0, 0.5


def _loop_until_death(victim: int, idle_ranks: tuple = ()) -> None:
    """Every rank runs dispatch/combine steps; at step 20 the victim exits abruptly and the ranks in
    idle_ranks stop communicating (as if computing), so only the watchdog can stop those."""
    from wideep.parallel import ParallelConfig, bootstrap, make_dispatcher

    ctx = bootstrap(ParallelConfig(dp_size=3, ep_size=3, timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S))
    d = make_dispatcher(ctx, 6, 8, "torch")
    for step in range(10**6):
        if ctx.rank == victim and step == 20:
            print(f"victim {victim} dies at {time.time():.3f}", flush=True)
            os._exit(3)
        if ctx.rank in idle_ranks and step >= 20:
            time.sleep(0.05)
            continue
        x, ids = torch.randn(4, 8), torch.randint(0, 6, (4, 2))
        got = d.dispatch(x, ids, torch.rand(4, 2))
        d.combine(got.x, got.handle)
        time.sleep(0.02)
    raise AssertionError("unreachable: the loop only ends by a rank's death")


@pytest.mark.multirank
@pytest.mark.parametrize("victim, idle", [(2, ()), (0, (2,))], ids=["rank2-in-collective", "rank0-store-host"])
def test_lost_rank_stops_everyone(victim, idle):
    outs = run(_loop_until_death, 3, args=(victim, idle), timeout_s=TIMEOUT_S + 40)
    died = outs[victim]
    assert died.returncode == 3, died.stderr
    converted = 0
    for o in outs:
        if o.rank == victim:
            continue
        assert o.returncode not in (0, None), f"rank {o.rank} exited {o.returncode}:\n{o.stderr[-2000:]}"
        assert f"rank {victim} lost" in o.stderr, f"rank {o.rank} stderr:\n{o.stderr[-2000:]}"
        after = o.elapsed_s - died.elapsed_s
        assert after < TIMEOUT_S, f"rank {o.rank} took {after:.1f} s after the death (timeout {TIMEOUT_S} s)"
        if o.rank in idle:  # no collective to fail: the watchdog thread itself ended the process
            assert "wideep: rank" in o.stderr and o.returncode == 1
        else:
            # a collective that failed on the dead peer's socket became RankLostError; a rank blocked
            # on a live peer that is itself stuck has no failing call, and its watchdog ends it
            converted += "RankLostError" in o.stderr
            assert "RankLostError" in o.stderr or f"wideep: rank {victim} lost" in o.stderr, o.stderr[-2000:]
    if len(outs) - 1 - len(idle) > 0:
        assert converted >= 1, "no surviving rank turned its failed collective into RankLostError"


def _host_leaves_first() -> float:
    """Rank 0 (the store host) shuts down at once; rank 1 keeps computing well past the loss
    threshold and must not mistake the vanished store for a dead rank 0."""
    from wideep.parallel import ParallelConfig, bootstrap, shutdown

    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2, timeout_s=6.0, heartbeat_s=HEARTBEAT_S))
    t = time.monotonic()
    if ctx.rank == 1:
        time.sleep(ctx.watchdog.lost_after_s + 2)  # lost_after_s = 3 s here
    shutdown(ctx)
    return time.monotonic() - t


@pytest.mark.multirank
def test_clean_shutdown_of_store_host_is_not_a_loss():
    outs = run(_host_leaves_first, 2, timeout_s=60)
    assert all(o.ok for o in outs), "\n".join(o.stderr[-1500:] for o in outs)
    assert "lost" not in outs[1].stderr


PAUSE_S = 6.0  # longer than the old 5 s staleness threshold, well inside TIMEOUT_S


def _all_reduce_ones(ctx) -> None:
    import torch.distributed as dist
    from wideep.parallel import guard_collective

    t = torch.ones(1)
    with guard_collective(ctx):
        dist.all_reduce(t)
    assert t.item() == ctx.world_size


def _slow_but_alive() -> dict:
    """Slowness of three kinds, one after the other between collectives: rank 1 stopped (SIGSTOP)
    by rank 0, then rank 0, the store's host, stopped by rank 1, then rank 2 holding the GIL in one
    long call, each for PAUSE_S."""
    import ctypes
    import signal

    import torch.distributed as dist

    from wideep.parallel import ParallelConfig, bootstrap, shutdown

    ctx = bootstrap(ParallelConfig(dp_size=3, ep_size=3, timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S))
    pids = [None] * 3
    dist.all_gather_object(pids, os.getpid())
    before = ctx.watchdog.stats()
    for stopper, stopped in ((0, 1), (1, 0)):
        _all_reduce_ones(ctx)
        if ctx.rank == stopper:
            os.kill(pids[stopped], signal.SIGSTOP)
            time.sleep(PAUSE_S)
            os.kill(pids[stopped], signal.SIGCONT)
        _all_reduce_ones(ctx)
    if ctx.rank == 2:
        ctypes.PyDLL(None).usleep(int(PAUSE_S * 1e6))   # PyDLL: the GIL stays held during the call
    for _ in range(5):
        _all_reduce_ones(ctx)
    after, lost = ctx.watchdog.stats(), ctx.lost_ranks()
    shutdown(ctx)
    return dict(lost=lost, store_ops=after["store_ops"] - before["store_ops"],
                beats=after["beats_sent"] - before["beats_sent"])


@pytest.mark.multirank
def test_stopped_or_gil_holding_ranks_are_not_lost():
    outs = run(_slow_but_alive, 3, timeout_s=TIMEOUT_S + 60)
    for o in outs:
        assert o.ok, f"rank {o.rank} exited {o.returncode}:\n{(o.error or '')[-2000:]}\n{o.stderr[-2000:]}"
        assert o.value["lost"] == [] and "lost" not in o.stderr, o.stderr[-2000:]
        # ~20 s of beating and three pauses: not one store operation after start-up
        assert o.value["store_ops"] == 0 and o.value["beats"] > 10, o.value


def _beat_then_die(victim: int | None, beats: int, timeout_s: float) -> dict:
    """Start-up, `beats` heartbeats of steady state (store operations counted), then the victim
    kills itself (SIGKILL) while everyone all-reduces; without a victim, a clean shutdown."""
    import json
    import signal

    from wideep.parallel import ParallelConfig, bootstrap, shutdown

    world = int(os.environ["WORLD_SIZE"])
    ctx = bootstrap(ParallelConfig(dp_size=world, ep_size=world, timeout_s=timeout_s, heartbeat_s=HEARTBEAT_S))
    _all_reduce_ones(ctx)
    s0 = ctx.watchdog.stats()
    time.sleep(beats * HEARTBEAT_S)
    _all_reduce_ones(ctx)
    s1 = ctx.watchdog.stats()
    report = dict(rank=ctx.rank, startup_ops=s0["store_ops"], startup_keys=s0["store_keys"],
                  window_ops=s1["store_ops"] - s0["store_ops"], window_beats=s1["beats_sent"] - s0["beats_sent"])
    if victim is None:
        shutdown(ctx)
        return report
    print("STATS " + json.dumps(report), flush=True)
    for step in range(10**6):
        if ctx.rank == victim and step == 3:
            print(f"victim {victim} killed at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        _all_reduce_ones(ctx)
        time.sleep(0.05)
    raise AssertionError("unreachable: the loop only ends by a rank's death")


def _check_store_ops(reports: list[dict], beats: int) -> None:
    """O(1) store operations per rank: the same few at start-up at any width, none per beat."""
    for r in reports:
        assert r["startup_ops"] <= 2 and r["startup_keys"] <= 2 and r["window_ops"] == 0, r
        assert r["window_beats"] >= beats // 2, r      # it did beat meanwhile (2 links on a 2-core host)


@pytest.mark.multirank
def test_store_ops_per_rank_do_not_grow_4_ranks():
    _check_store_ops(spawn(_beat_then_die, 4, args=(None, 10, TIMEOUT_S), timeout_s=TIMEOUT_S + 60), 10)


@pytest.mark.multirank
@pytest.mark.slow
def test_killed_rank_is_named_by_all_16_ranks():
    """16 ranks on a 2-core host: one SIGKILLed mid-run is named by all 15 survivors within the
    timeout; before that, the same store-operation counts as at 4 ranks."""
    import json

    timeout_s, victim = 30.0, 7
    outs = run(_beat_then_die, 16, args=(victim, 10, timeout_s), timeout_s=timeout_s + 120)
    died = outs[victim]
    assert died.returncode == -9, died.stderr[-2000:]
    reports = [json.loads(line[6:]) for o in outs for line in o.stdout.splitlines() if line.startswith("STATS ")]
    assert len(reports) == 16, [o.stdout[-300:] for o in outs]
    _check_store_ops(reports, 10)
    for o in outs:
        if o.rank == victim:
            continue
        assert o.returncode not in (0, None), f"rank {o.rank} exited {o.returncode}:\n{o.stderr[-2000:]}"
        assert f"rank {victim} lost" in o.stderr, f"rank {o.rank} stderr:\n{o.stderr[-2000:]}"
        assert o.elapsed_s - died.elapsed_s < timeout_s, f"rank {o.rank}: {o.elapsed_s - died.elapsed_s:.1f} s"
