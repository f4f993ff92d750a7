"""EPLB failure modes: a rank killed in the middle of a weight transfer makes every survivor stop with
RankLostError naming it, in time, before any rank swaps; bad configurations fail with the numbers."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.eplb.helpers import build_llm, experts_match_checkpoint, generate, make_skewed_checkpoint
from tests.parallel.spawn import run

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return make_skewed_checkpoint(str(tmp_path_factory.mktemp("eplb_err")))


def _rank_dies_in_transfer(model_dir: str, victim: int) -> str:
    import wideep.eplb.rebalancer as rb
    from wideep.eplb import EplbConfig
    from wideep.parallel import RankLostError
    cfg = EplbConfig(enabled=True, num_redundant_experts=2, window_size=8, step_interval=10**9)
    llm, ctl = build_llm(model_dir, cfg, dp_size=3, ep_size=3, dispatch_backend="torch",
                         parallel={"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5})
    generate(llm)
    rank = llm.ctx.rank
    if rank == victim:  # dies on its second layer: layer 0 already staged, nothing swapped
        real, calls = rb.stage_layer, []

        def dying(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                print("victim dies in the transfer", file=sys.stderr, flush=True)
                os._exit(3)
            return real(*a, **k)
        rb.stage_layer = dying
    old = ctl.placement.phy2log.clone()
    load = (torch.rand(3, 16, generator=torch.Generator().manual_seed(3)) * 1000).long()
    try:
        ctl.rebalance(load)
    except RankLostError:
        intact = torch.equal(ctl.placement.phy2log, old) and not experts_match_checkpoint(llm.model, model_dir)
        print(f"survivor {rank}: placement and weights intact: {intact}", file=sys.stderr, flush=True)
        raise
    return "rebalanced without the victim"


@pytest.mark.multirank
def test_rank_killed_during_transfer_stops_survivors(skewed):
    victim = 1
    outs = run(_rank_dies_in_transfer, 3, args=(skewed, victim), timeout_s=TIMEOUT_S + 60)
    died = outs[victim]
    assert died.returncode == 3, died.stderr[-2000:]
    for o in outs:
        if o.rank == victim:
            continue
        assert o.returncode not in (0, None), f"rank {o.rank} exited {o.returncode}:\n{o.stderr[-2000:]}"
        assert "RankLostError" in o.stderr and f"rank {victim} lost" in o.stderr, o.stderr[-2000:]
        assert f"survivor {o.rank}: placement and weights intact: True" in o.stderr, o.stderr[-2000:]
        after = o.elapsed_s - died.elapsed_s
        assert after < TIMEOUT_S, f"rank {o.rank} took {after:.1f} s after the death (timeout {TIMEOUT_S} s)"
