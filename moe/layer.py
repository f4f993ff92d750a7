"""MoE layer: gate -> (dispatch) -> local experts -> (combine) -> + shared experts.

Legend: T tokens on this rank, H hidden, k top-k, P physical experts (all ranks), El local experts.
The gate's logical ids become physical ids through `expert_map` (EPLB's placement, which may hold
several replicas of a hot expert; None = identity). With no dispatcher every physical expert is
local (physical id = local id). With a dispatcher, it moves each token once to every rank holding
one of its experts, and brings the weighted sums back. `load_counts` ([P] int64, EPLB's recorder),
when set, gets the step's physical ids added in place: no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import MoEConfig
from .experts import Experts
from .gate import Gate
from .mlp import MLP


@dataclass(frozen=True)
class ExpertShard:
    """This rank's contiguous slice of the P physical experts: [first, first + num_local)."""

    num_physical: int
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def num_local(self) -> int:
        return self.num_physical // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.num_local


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, shard: ExpertShard | None = None, dispatcher=None, device=None, dtype=None,
                 fp8_block: tuple[int, int] | None = None, linear=nn.Linear):
        """fp8_block: routed experts keep fp8 weights in these blocks; linear: the shared experts' class."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard or ExpertShard(cfg.n_routed_experts)
        self.dispatcher = dispatcher
        self.gate = Gate(cfg, device=device)
        self.experts = Experts(self.shard.num_local, cfg.hidden_size, cfg.moe_intermediate_size,
                               device=device, dtype=dtype, fp8_block=fp8_block)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   device=device, dtype=dtype, linear=linear) if cfg.n_shared_experts else None)
        # physical slot -> logical expert, for this rank's slots; contiguous identity until EPLB
        self.local_phy2log = list(range(self.shard.first, self.shard.first + self.shard.num_local))
        self.expert_map = None    # callable: logical ids [T, k] -> physical ids [T, k]; None = identity
        self.load_counts = None   # [P] int64 tokens per physical slot, added in place; None = off

    def set_placement(self, local_phy2log: list[int], expert_map=None) -> None:
        """Which logical expert each local slot holds ([El]) and the map the gate's ids go through.
        The caller swaps the slots' weights at the same time (EPLB does both between steps)."""
        if len(local_phy2log) != self.shard.num_local:
            raise ValueError(f"{len(local_phy2log)} local slots given, this rank has {self.shard.num_local}")
        self.local_phy2log = list(local_phy2log)
        self.expert_map = expert_map

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> physical topk_ids [T, k], topk_weights [T, k] (recorded for EPLB when on)."""
        topk_ids, topk_weights = self.gate(x)                                  # [T, k] logical
        if self.expert_map is not None:
            topk_ids = self.expert_map(topk_ids)                               # [T, k] physical
        if self.load_counts is not None:
            flat = topk_ids.reshape(-1)
            self.load_counts.index_add_(0, flat, torch.ones_like(flat))
        return topk_ids, topk_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        topk_ids, topk_weights = self.route(x)
        if self.dispatcher is None:
            out = self.experts(x, topk_ids, topk_weights)
        else:
            d = self.dispatcher.dispatch(x, topk_ids, topk_weights)           # physical ids
            out = self.dispatcher.combine(self.experts(d.x, d.topk_ids, d.topk_weights), d.handle)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
