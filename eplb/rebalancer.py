"""One rebalance on one rank: plan a new placement from the global load, stage the weights that
move layer by layer, then swap the weights and expert maps of every layer at once.

    new = plan_placement(load, current, ...)      # pure; the same on every rank
    job = Rebalance(moe_layers, current, new, ctx)
    while not job.staged:
        job.stage(n)                              # n layers, point-to-point over the EP group
    job.commit()                                  # collective: all ranks staged -> all swap

Between stage() calls the model keeps serving on the old placement (sources send from live
weights; receivers write only staging buffers). commit() first agrees over the EP group that every
rank has staged every layer, so either every rank switches on this step or, when a rank is lost,
none does and the survivors raise RankLostError.
Legend: L MoE layers, E logical experts, P physical slots, ep EP ranks.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from wideep.eplb.algorithm import rebalance_experts
from wideep.eplb.placement import Placement
from wideep.eplb.transfer import expert_bytes, plan_moves, stage_layer, swap_layer
from wideep.parallel.watchdog import RankLostError, guard_collective


def plan_placement(load: torch.Tensor, current: Placement, ep_size: int, num_groups: int, num_nodes: int,
                   policy: str = "auto", migration_aware: bool = True) -> Placement:
    """load [L, E] (global, CPU) -> the new Placement. policy "global" ignores expert groups and
    nodes; "hierarchical" needs num_groups % num_nodes == 0; "auto" picks (see eplb.algorithm)."""
    if policy == "global":
        num_groups = num_nodes = 1
    elif policy == "hierarchical" and num_groups % num_nodes:
        raise ValueError(f"eplb.policy = 'hierarchical' needs n_group ({num_groups}) divisible by the number "
                         f"of nodes ({num_nodes}); use 'auto' or 'global'")
    phy2log, _, _ = rebalance_experts(load, current.num_physical, num_groups, num_nodes, ep_size,
                                      current_phy2log=current.phy2log if migration_aware else None)
    return Placement.from_phy2log(phy2log, current.num_experts)


def _global_ranks(ctx, ep_size: int) -> list[int] | None:
    group = ctx.ep_group
    if group is None or group == dist.group.WORLD:
        return None
    return [dist.get_global_rank(group, r) for r in range(ep_size)]


class Rebalance:
    """Weights in flight from placement `old` to `new` on this rank."""

    def __init__(self, moe_layers, old: Placement, new: Placement, ctx, routing):
        """routing: the model's ExpertRouting, pointed at `new` by commit()."""
        self.layers, self.old, self.new, self.ctx, self.routing = moe_layers, old, new, ctx, routing
        self.ep_rank, self.ep_size = ctx.ep_rank, ctx.ep_size
        self.moves = plan_moves(old.phy2log, new.phy2log, self.ep_size)
        self.by_layer = [[] for _ in moe_layers]
        for m in self.moves:
            self.by_layer[m.layer].append(m)
        self.params = [list(layer.experts.parameters()) for layer in moe_layers]
        self._staged: list = [None] * len(moe_layers)
        self._next = 0
        self._ranks = _global_ranks(ctx, self.ep_size) if self.ep_size > 1 else None
        self.transfer_s = self.swap_s = 0.0

    @property
    def staged(self) -> bool:
        return self._next == len(self.layers)

    def stage(self, num_layers: int | None = None) -> None:
        """Fetch the next num_layers layers' moving weights (all remaining when None)."""
        t0 = time.perf_counter()
        end = len(self.layers) if not num_layers else min(len(self.layers), self._next + num_layers)
        with torch.no_grad():
            for l in range(self._next, end):
                try:
                    self._staged[l] = stage_layer(self.by_layer[l], self.params[l], self.ep_rank, self.ctx,
                                                  self._ranks)
                except RankLostError as e:
                    if hasattr(e, "add_note"):  # Python >= 3.11
                        e.add_note(f"during the EPLB weight transfer of MoE layer {l}; no rank has switched "
                                   f"to the new placement")
                    raise
        self._next = end
        self.transfer_s += time.perf_counter() - t0

    def commit(self) -> None:
        """Collective: swap every layer's weights and expert map, on every rank at this step."""
        if not self.staged:
            raise RuntimeError(f"commit() before every layer is staged ({self._next}/{len(self.layers)})")
        t0 = time.perf_counter()
        if self.ep_size > 1 and not self.ctx.is_single:
            ready = torch.ones(1, dtype=torch.int64)
            with guard_collective(self.ctx):
                dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=self.ctx.cpu_group)
        for params, (slots, staged) in zip(self.params, self._staged):
            swap_layer(params, slots, staged)
        self.new.install(self.routing, self.ep_rank, self.ep_size, self.layers[0].experts.w13.device)
        self._staged = [None] * len(self.layers)
        self.swap_s = time.perf_counter() - t0

    def stats(self) -> dict:
        """Counts of this rebalance (all ranks, from the plan) and this rank's share."""
        B = expert_bytes(self.params[0]) if self.params else 0
        remote = [m for m in self.moves if m.remote]
        per_layer = (self.old.phy2log != self.new.phy2log).sum(-1)
        return {"slots_moved": int(per_layer.sum()), "slots_moved_per_layer": per_layer.tolist(),
                "experts_sent": len(remote), "bytes_moved": len(remote) * B,
                "bytes_copied_local": (len(self.moves) - len(remote)) * B,
                "rank_bytes_sent": sum(B for m in remote if m.src == self.ep_rank),
                "rank_bytes_received": sum(B for m in remote if m.dst == self.ep_rank),
                "transfer_s": self.transfer_s, "swap_s": self.swap_s}
