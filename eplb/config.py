"""EPLB settings (the run config's [eplb] section; vLLM's names), validated once.

    enabled                  record load and rebalance while serving (`--enable-eplb`)
    window_size              steps of recorded load the planner sees (sliding window)
    step_interval            plan + move weights every this many engine steps
    num_redundant_experts    extra physical expert slots per MoE layer (replicas of hot experts)
    policy                   "auto" (hierarchical when n_group % nodes == 0, else global) |
                             "hierarchical" | "global"
    initial_placement        JSON file with "phy2log" [moe_layers, physical] to start from
                             (e.g. written by `wideep eplb-plan`); default: expert p % E in slot p
    migration_aware          keep experts where they are when that costs little balance
    transfer_layers_per_step 0: move all layers in the planning step; n: n layers per step, the
                             new placement taking effect once every layer is staged
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from wideep.parallel.expert_layout import ExpertLayout

POLICIES = ("auto", "hierarchical", "global")


@dataclass(frozen=True)
class EplbConfig:
    enabled: bool = False
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    policy: str = "auto"
    initial_placement: str | None = None
    migration_aware: bool = True
    transfer_layers_per_step: int = 0

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"eplb.enabled must be true or false, got {self.enabled!r}")
        for name, low in (("window_size", 1), ("step_interval", 1), ("num_redundant_experts", 0),
                          ("transfer_layers_per_step", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"eplb.{name} must be an integer >= {low}, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"eplb.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.initial_placement is not None and not isinstance(self.initial_placement, str):
            raise ValueError(f"eplb.initial_placement must be a file path, got {self.initial_placement!r}")
        if not isinstance(self.migration_aware, bool):
            raise ValueError(f"eplb.migration_aware must be true or false, got {self.migration_aware!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "EplbConfig":
        """From a run-config section; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown eplb config keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def coerce(cls, value: "EplbConfig | dict | None") -> "EplbConfig":
        """An EplbConfig from itself, a dict of its fields, or None (disabled)."""
        if value is None:
            return cls()
        return value if isinstance(value, cls) else cls.from_dict(dict(value))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def redundant_with(self, parallel_redundant: int) -> int:
        """The replica slots to build: eplb.num_redundant_experts or parallel.num_redundant_experts
        (the older name); both set and different is an error."""
        a, b = self.num_redundant_experts, parallel_redundant
        if a and b and a != b:
            raise ValueError(f"eplb.num_redundant_experts ({a}) != parallel.num_redundant_experts ({b}); "
                             f"set one of them")
        return a or b

    def validate(self, ep_size: int, n_routed_experts: int, parallel_redundant: int = 0) -> int:
        """Check the slot layout for this EP size; returns the number of redundant slots.
        Raises ValueError with the numbers, the same on every rank (call before connecting)."""
        r = self.redundant_with(parallel_redundant)
        p = n_routed_experts + r
        ExpertLayout.check(p, ep_size, what="n_routed_experts + num_redundant_experts",
                           count=f"{n_routed_experts} + {r} = {p}",
                           hint=f"; use a num_redundant_experts that makes it a multiple of {ep_size}")
        per_rank = ExpertLayout(p, ep_size).per_rank
        if r and per_rank > n_routed_experts and ep_size > 1:
            raise ValueError(f"{per_rank} slots per rank > {n_routed_experts} experts: a rank would hold "
                             f"two copies of one expert; num_redundant_experts ({r}) is too large")
        return r
