"""eplb/survivors.py plan_resize, pure: 16 experts + 4 replicas on 4 ranks (5 slots each) re-planned for 3, 1
and 6 ranks. Every expert keeps a replica, nothing comes from the checkpoint while every old rank can give, a
staying rank keeps what it held (local copies), a joining rank gets everything from a holder, and the plan is
the one recovery after a loss gets (plan_survivors) when the holders are the survivors."""
from __future__ import annotations

import torch

from wideep.eplb.placement import Placement
from wideep.eplb.survivors import CHECKPOINT, LOCAL, PEER, plan_resize, plan_survivors

E, L = 16, 3


def _old() -> torch.Tensor:
    return Placement.initial(L, E, 20).phy2log   # [L, 20]: slot p holds p % 16


def _check_covers(plan, n: int) -> None:
    assert plan.phy2log.shape == (L, n * plan.slots_per_rank)
    for l in range(L):
        assert set(plan.phy2log[l].tolist()) == set(range(E))          # every expert keeps a replica
        for p, src in enumerate(plan.sources[l]):
            if src.kind != CHECKPOINT:                                  # the source really holds that expert
                assert int(_old()[l, src.rank * 5 + src.slot]) == int(plan.phy2log[l, p])


def test_shrink_moves_from_every_old_rank_and_keeps_what_stays():
    for n in (3, 1):
        plan = plan_resize(_old(), 4, list(range(n)), [0, 1, 2, 3], num_groups=1)
        assert plan.slots_per_rank == max(5, -(-E // n)) and plan.missing() == []
        _check_covers(plan, n)
        kinds = [s.kind for row in plan.sources for s in row]
        assert LOCAL in kinds and PEER in kinds
        assert {s.rank for row in plan.sources for s in row if s.kind == PEER} & set(range(n, 4))  # leavers give


def test_grow_fills_new_ranks_from_holders():
    plan = plan_resize(_old(), 4, [0, 1, 2, 3, None, None], [0, 1, 2, 3], num_groups=1)
    assert plan.slots_per_rank == 5 and plan.missing() == []
    _check_covers(plan, 6)
    for row in plan.sources:
        assert all(s.kind == PEER and s.rank < 4 for s in row[20:])   # ranks 4, 5 hold nothing yet
        assert all(s.rank == p // 5 for p, s in enumerate(row[:20]) if s.kind == LOCAL)   # its own old slot
        assert sum(s.kind == LOCAL for s in row[:20]) >= 16                                 # most stay put


def test_survivors_plan_is_the_resize_plan_renumbered():
    old, survivors = _old(), [0, 1, 3]
    a = plan_survivors(old, 4, survivors, num_groups=1)
    b = plan_resize(old, 4, survivors, survivors, num_groups=1)
    assert torch.equal(a.phy2log, b.phy2log) and a.missing() == b.missing()
    for ra, rb in zip(a.sources, b.sources):
        assert [(s.kind, s.slot) for s in ra] == [(s.kind, s.slot) for s in rb]
        assert [survivors[s.rank] if s.kind != CHECKPOINT else -1 for s in ra] == [s.rank for s in rb]
