"""Re-planning the experts over the ranks that survived a loss, or over a new number of ranks (a resize on
request: plan_resize), pure: torch, no torch.distributed.

Legend: L MoE layers, E logical experts, N EP ranks before, n survivors, k / k' slots per rank
before / after, P = N*k, P' = n*k'. Old ranks are EP ranks before the loss; new ranks number the
survivors 0..n-1 in order.

Every logical expert keeps at least one replica: k' = max(k, ceil(E / n)), so the survivors may
need more slots each than before. The plan is EPLB's (`rebalance_experts`), migration-aware from
"today" = each survivor's old slots, its extra slots filled with copies of its own experts, so what a
survivor already holds stays where it is. Then each new slot gets a source: the rank's own old slot
(a local copy), else a surviving holder (peer copy; holders take turns), else the checkpoint.

Example: 4 ranks x 5 slots (16 experts + 4 replicas), rank 2 lost -> 3 ranks x 6 slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from wideep.eplb.algorithm import rebalance_experts

LOCAL, PEER, CHECKPOINT = "local", "peer", "checkpoint"


@dataclass(frozen=True)
class Source:
    kind: str              # LOCAL | PEER | CHECKPOINT
    rank: int = -1         # the rank holding the expert (LOCAL: the receiver itself; PEER: the sender)
    slot: int = -1         # its local slot there (old numbering of that rank's slots)


@dataclass
class SurvivorPlan:
    phy2log: torch.Tensor                    # [L, P'] logical expert of each new physical slot
    slots_per_rank: int                      # k'
    sources: list[list[Source]]              # [L][P'] where each new slot's weights come from

    def missing(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs that only the checkpoint has (no survivor holds them)."""
        out = set()
        for l, row in enumerate(self.sources):
            for p, src in enumerate(row):
                if src.kind == CHECKPOINT:
                    out.add((l, int(self.phy2log[l, p])))
        return sorted(out)


def plan_survivors(old_phy2log: torch.Tensor, old_ep: int, survivors: list[int], num_groups: int,
                   load: torch.Tensor | None = None) -> SurvivorPlan:
    """old_phy2log: [L, P] before the loss; survivors: old EP ranks left, ascending; load: [L, E]
    (EPLB's window; None: uniform). -> the plan over len(survivors) ranks; sources name new ranks."""
    plan = plan_resize(old_phy2log, old_ep, list(survivors), survivors, num_groups, load)
    new_of = {r: i for i, r in enumerate(survivors)}
    for row in plan.sources:
        row[:] = [Source(s.kind, new_of[s.rank], s.slot) if s.kind != CHECKPOINT else s for s in row]
    return plan


def plan_resize(old_phy2log: torch.Tensor, old_ep: int, stay: list[int | None], holders: list[int], num_groups: int,
                load: torch.Tensor | None = None) -> SurvivorPlan:
    """The experts over n = len(stay) ranks. stay[j]: the old EP rank that becomes new rank j (None: a rank that
    joins, holding nothing yet); holders: the old EP ranks whose experts can still be read (after a loss: the
    survivors; a resize on request: every old rank, the leaving ones included, so nothing comes from the
    checkpoint). load: [L, E] (None: uniform). -> the plan; sources name old EP ranks (LOCAL: stay[j] itself)."""
    L, P = old_phy2log.shape
    old = old_phy2log.to("cpu", torch.int64)
    E = int(old.max()) + 1 if load is None else load.shape[1]
    n = len(stay)
    if n == 0:
        raise ValueError("no rank to place the experts on")
    k = P // old_ep
    k_new = max(k, -(-E // n))
    pad = torch.arange(k_new - k) % k
    # A joining rank holds nothing: its "today" is any valid row (migration-awareness only keeps slots in place).
    today = torch.cat([torch.cat([old[:, r * k:(r + 1) * k], old[:, r * k:(r + 1) * k][:, pad]], 1) if r is not None
                       else (torch.arange(k_new) % E).expand(L, -1) for r in stay], 1)             # [L, n*k']
    weight = torch.ones(L, E) if load is None else load.to(torch.float64).clamp(min=0) + 1e-6
    groups = num_groups if E % num_groups == 0 else 1
    phy2log, _, _ = rebalance_experts(weight, n * k_new, groups, 1, n, current_phy2log=today)
    new_l, old_l = phy2log.tolist(), old.tolist()
    sources: list[list[Source]] = []
    for l in range(L):
        holding: dict[int, list[tuple[int, int]]] = {}        # logical expert -> [(old rank, its slot)], one per rank
        for r in holders:
            for s in range(k):
                e = old_l[l][r * k + s]
                if all(h != r for h, _ in holding.get(e, ())):
                    holding.setdefault(e, []).append((r, s))
        row = []
        for p, e in enumerate(new_l[l]):
            j = p // k_new
            mine = next((s for r, s in holding.get(e, ()) if r == stay[j]), None) if stay[j] is not None else None
            if mine is not None:
                row.append(Source(LOCAL, stay[j], mine))
            elif e in holding:
                r, s = holding[e][(j + l) % len(holding[e])]   # holders take turns
                row.append(Source(PEER, r, s))
            else:
                row.append(Source(CHECKPOINT))
        sources.append(row)
    return SurvivorPlan(phy2log, k_new, sources)
