"""Re-forming the ranks after losses (on_rank_loss = "continue"): the survivors agree on who is left,
form new groups among themselves (renumbered, origin ranks kept) and their collectives work again;
two losses one after the other; a rank still in a collective and a rank idle both get there; the
front's loss ends every survivor."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.parallel.spawn import run

TIMEOUT_S, HEARTBEAT_S = 20.0, 0.5


def _survive(victims: dict) -> dict:
    """victims: origin rank -> the round at which it dies. Every round: an all-reduce of ones over
    the current group (its result is the live world size); idle ranks sleep through a round."""
    import torch.distributed as dist

    from wideep.parallel import ParallelConfig, RankLostError, bootstrap, guard_collective, shutdown
    from wideep.parallel.reform import reform
    ctx = bootstrap(ParallelConfig(dp_size=4, ep_size=4, timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S,
                                   on_rank_loss="continue"))
    origin = ctx.rank
    sizes, recoveries = [], []
    for step in range(60):
        if victims.get(origin) == step:
            os._exit(3)
        failed = False
        try:
            t = torch.ones(1)
            with guard_collective(ctx):
                dist.all_reduce(t, group=ctx.cpu_group)
            lost = ctx.lost_ranks()
            if lost:
                raise RankLostError(lost)
            sizes.append(int(t))
        except RankLostError:
            failed = True   # re-form outside the handler: the exception's frames still hold the old group
        if failed:
            ctx = reform(ctx)
            recoveries.append((ctx.epoch, list(ctx.members), round(ctx.recovery_s, 3)))
        time.sleep(0.02)
    out = {"origin": origin, "rank": ctx.rank, "world": ctx.world_size, "sizes": sizes, "recoveries": recoveries}
    shutdown(ctx)
    return out


@pytest.mark.multirank
def test_two_losses_one_after_the_other():
    outs = run(_survive, 4, args=({2: 10, 3: 30},), timeout_s=120)
    assert outs[2].returncode == 3 and outs[3].returncode == 3
    for o in outs[:2]:
        assert o.ok, o.stderr[-3000:]
        v = o.value
        assert v["world"] == 2 and v["rank"] == v["origin"]
        assert [r[:2] for r in v["recoveries"]] == [(1, [0, 1, 3]), (2, [0, 1])], v["recoveries"]
        assert all(s <= TIMEOUT_S for *_, s in v["recoveries"])
        # every successful all-reduce saw the whole live group: 4, then 3, then 2 ranks
        assert v["sizes"] == sorted(v["sizes"], reverse=True) and set(v["sizes"]) == {4, 3, 2}, v["sizes"]


@pytest.mark.multirank
def test_front_loss_ends_every_survivor():
    outs = run(_front_dies, 3, timeout_s=90)
    for o in outs[1:]:
        assert o.returncode not in (0, None)
        assert "rank 0 lost" in o.stderr and "the front is lost" in o.stderr, o.stderr[-2000:]


def _front_dies() -> None:
    import torch.distributed as dist

    from wideep.parallel import ParallelConfig, bootstrap, guard_collective
    ctx = bootstrap(ParallelConfig(dp_size=3, ep_size=3, timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S,
                                   on_rank_loss="continue"))
    for step in range(10**6):
        if ctx.rank == 0 and step == 10:
            os._exit(3)
        with guard_collective(ctx):
            dist.all_reduce(torch.ones(1), group=ctx.cpu_group)
        time.sleep(0.02)
