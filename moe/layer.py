"""MoE layer: gate -> (dispatch) -> local experts -> (combine) -> + shared experts.

Legend: T tokens on this rank, H hidden, k top-k, P physical experts (all ranks), El local experts.
With no dispatcher every expert is local and logical ids are the local ids. With a dispatcher the
gate's logical ids become physical ids (identity until EPLB adds a placement), the dispatcher moves
each token once to every rank holding one of its experts, and brings the weighted sums back.
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
    def __init__(self, cfg: MoEConfig, shard: ExpertShard | None = None, dispatcher=None, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard or ExpertShard(cfg.n_routed_experts)
        self.dispatcher = dispatcher
        self.gate = Gate(cfg, device=device)
        self.experts = Experts(self.shard.num_local, cfg.hidden_size, cfg.moe_intermediate_size,
                               device=device, dtype=dtype)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   device=device, dtype=dtype) if cfg.n_shared_experts else None)
        # physical slot -> logical expert, for this rank's slots; contiguous identity until EPLB
        self.local_phy2log = list(range(self.shard.first, self.shard.first + self.shard.num_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        topk_ids, topk_weights = self.gate(x)                                  # [T, k] logical
        if self.dispatcher is None:
            out = self.experts(x, topk_ids, topk_weights)
        else:
            d = self.dispatcher.dispatch(x, topk_ids, topk_weights)           # physical == logical for now
            out = self.dispatcher.combine(self.experts(d.x, d.topk_ids, d.topk_weights), d.handle)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
