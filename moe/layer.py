"""MoE layer: gate -> experts (through a dispatcher when expert-parallel) -> + shared experts.

Legend: T tokens, H hidden, k top-k. With no dispatcher (one rank) every expert is local and
logical ids are the local ids.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import MoEConfig
from .experts import Experts
from .gate import Gate
from .mlp import MLP


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg, device=device)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               device=device, dtype=dtype)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   device=device, dtype=dtype) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        topk_ids, topk_weights = self.gate(x)                                  # [T, k] logical
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
