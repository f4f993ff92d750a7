"""A rank that dies mid-run makes every other rank exit non-zero within the timeout, naming it."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.parallel.spawn import run

TIMEOUT_S, HEARTBEAT_S = 20.0, 0.5


def _loop_until_death(victim: int, idle_ranks: tuple = ()) -> None:
    """Every rank runs dispatch/combine steps; at step 20 the victim exits abruptly and the ranks in
    idle_ranks stop communicating (as if computing), so only the watchdog can stop those."""
    from parallel import ParallelConfig, bootstrap, make_dispatcher

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
    from parallel import ParallelConfig, bootstrap, shutdown

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
