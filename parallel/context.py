"""ParallelContext: who this process is among the ranks, and the groups it talks over.

Built once (parallel.bootstrap.bootstrap, or ParallelContext.single() for one process) and passed
to every constructor that communicates; nothing below reads env vars or calls dist.get_rank().
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .watchdog import Watchdog


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0                # rank within its node (parallel/topology.py: node-major layout)
    local_world_size: int = 1          # ranks per node
    node_rank: int = 0
    num_nodes: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"              # "gloo" | "nccl" | "none" (no torch.distributed)
    dp_rank: int = 0                   # attention data-parallel coordinates
    dp_size: int = 1
    ep_rank: int = 0                   # expert-parallel coordinates: this rank owns a contiguous slice
    ep_size: int = 1
    ep_group: Any = None               # ProcessGroup for dispatch/combine (device tensors)
    cpu_group: Any = None              # gloo ProcessGroup for host-side and object collectives
    node_group: Any = None             # this rank's node (backend as ep_group); with one node, ep_group
    store: Any = None                  # the rendezvous TCPStore, or None
    timeout_s: float = 60.0
    launcher: str = "single"           # "torchrun" (or any RANK/WORLD_SIZE env) | "mpirun" | "single"
    watchdog: "Watchdog | None" = None
    # after a loss (parallel/reform.py): the survivors' ranks at start-up, in rank order (None: the
    # identity), how many times the ranks re-formed, and how long the last re-forming took
    members: tuple[int, ...] | None = None
    epoch: int = 0
    recovery_s: float = 0.0
    on_rank_loss: str = "exit"
    # the lost-rank watchdog's settings (Watchdog's keywords but the store): a re-formed group starts its own
    # watchdog from them, even where the group before had none (one rank alone has no peer to watch)
    watch_settings: dict | None = None

    @property
    def origin_rank(self) -> int:
        """This rank's rank at start-up (how the control channel addresses it, whatever re-forming did)."""
        return self.members[self.rank] if self.members is not None else self.rank

    @property
    def is_single(self) -> bool:
        """One process and no torch.distributed: every collective is the identity."""
        return self.world_size == 1 and self.ep_group is None

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelContext":
        return cls(device=torch.device(device))

    @property
    def ranks_per_node(self) -> int:
        return self.local_world_size

    def lost_ranks(self) -> list[int]:
        """Ranks declared lost so far ([0] too when the rendezvous store's host is gone)."""
        return [] if self.watchdog is None else self.watchdog.lost_ranks()

    def __repr__(self) -> str:  # groups and store print as opaque handles; keep the useful part
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, node={self.node_rank}/{self.num_nodes}, "
                f"local={self.local_rank}/{self.local_world_size}, device={self.device}, backend={self.backend}, "
                f"dp={self.dp_rank}/{self.dp_size}, ep={self.ep_rank}/{self.ep_size}, launcher={self.launcher})")
