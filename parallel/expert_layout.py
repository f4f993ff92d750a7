"""Where the physical expert slots of an MoE layer live: P slots over ep EP ranks, contiguous.

Legend: P physical slots (logical experts + redundant replicas), ep EP ranks, k = P / ep slots per
rank. Slot p lives on EP rank p // k as that rank's local slot p % k; rank r holds [r*k, (r+1)*k).
EPLB changes which logical expert a slot holds, never this layout. Dispatchers, the MoE layer's
shard, EPLB and the config checks all ask this one object, so "P divisible by ep" is checked once.

    ExpertLayout(20, 4).per_rank == 5;  .rank_of(12) == 2;  .local_of(12) == 2;  .slots(3) == range(15, 20)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    num_physical: int        # P
    ep_size: int = 1         # ep

    def __post_init__(self):
        self.check(self.num_physical, self.ep_size)

    @staticmethod
    def check(num_physical: int, ep_size: int, what: str = "num_physical_experts", count: str | None = None,
              ep_name: str = "ep_size", hint: str = "") -> None:
        """Raise ValueError unless num_physical >= 1 slots split evenly over ep_size >= 1 ranks. The
        message names the numbers as the caller's config does: `what` (count) is not divisible by
        `ep_name` (ep_size)`hint`; count defaults to num_physical (give "16 + 4 = 20" to show a sum)."""
        if not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"{ep_name} must be an integer >= 1, got {ep_size!r}")
        if not isinstance(num_physical, int) or num_physical < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {num_physical!r}")
        if num_physical % ep_size:
            shown = count if count is not None else str(num_physical)
            raise ValueError(f"{what} ({shown}) is not divisible by {ep_name} ({ep_size}){hint}")

    @property
    def per_rank(self) -> int:
        """k: slots on every EP rank."""
        return self.num_physical // self.ep_size

    def rank_of(self, phys):
        """EP rank holding physical slot(s) `phys` (an int or an integer tensor; ids must be >= 0)."""
        return phys // self.per_rank

    def local_of(self, phys):
        """Local slot id on its rank of physical slot(s) `phys`."""
        return phys % self.per_rank

    def first(self, ep_rank: int) -> int:
        """The first physical slot of `ep_rank`."""
        return ep_rank * self.per_rank

    def slots(self, ep_rank: int) -> range:
        """The physical slots of `ep_rank`, in local order."""
        return range(self.first(ep_rank), self.first(ep_rank) + self.per_rank)
