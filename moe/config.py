"""Sub-config for a routed MoE layer (gate + experts + shared experts)."""
from __future__ import annotations

from dataclasses import dataclass

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")   # sqrtsoftplus: sqrt(softplus(logit)), DeepSeek-V4


@dataclass(frozen=True)
class MoEConfig:
    """Legend: H hidden, I moe_intermediate_size, E routed (logical) experts, k top-k."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    swiglu_limit: float | None = None   # DeepSeek-V4: gate clamped to <= limit, up to [-limit, limit] (all experts)

    def __post_init__(self) -> None:
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0 or None, got {self.swiglu_limit!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported (supported: {TOPK_METHODS})")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported (supported: {SCORING_FUNCS})")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) is not divisible by n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group ({self.n_group})]")
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, n_routed_experts ({self.n_routed_experts})]")
        per_group = self.n_routed_experts // self.n_group
        if self.topk_method != "greedy" and self.topk_group * per_group < self.top_k:
            raise ValueError(f"topk_group ({self.topk_group}) x experts per group ({per_group}) "
                             f"< num_experts_per_tok ({self.top_k})")
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(f"noaux_tc scores groups by their top-2 experts; experts per group is {per_group}")
