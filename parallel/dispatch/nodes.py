"""The EP group's ranks on nodes: which rank is on which node, and which bytes cross between nodes.

Legend: ep EP ranks, L ranks per node, N = ep / L nodes. Ranks are node-major (parallel/topology.py):
EP rank r is local rank r % L of node r // L (the EP group is the world, so the launcher's layout,
or `[parallel] ranks_per_node` simulating nodes on one host, is the EP group's). A rank's *peers*
are the ranks with its local rank, one per node: the two-level dispatcher's stage 1 goes to them.

    NodeLayout(8, 4, ep_rank=5): node 1, local 1; peers [1, 5]; node_ranks range(4, 8)
    NodeLayout(8, 4, 5).tier_bytes([3, 0, 1, 0, 2, 9, 0, 4], 10) == (60, 40)   # (intra, inter)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLayout:
    ep_size: int
    ranks_per_node: int      # L
    ep_rank: int = 0

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.ep_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must be >= 1 and divide the EP size "
                             f"({self.ep_size})")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} is outside ep_size {self.ep_size}")

    @classmethod
    def of(cls, ctx) -> "NodeLayout":
        """The EP group's layout from a ParallelContext (EP group = the world, node-major)."""
        L = ctx.ranks_per_node if ctx.ep_size == ctx.world_size else ctx.ep_size
        return cls(ctx.ep_size, L, ctx.ep_rank)

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.ep_rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.ep_rank % self.ranks_per_node

    def node_of(self, rank):
        """Node of EP rank(s) `rank` (an int or an integer tensor)."""
        return rank // self.ranks_per_node

    def peer(self, node: int) -> int:
        """The rank with this rank's local rank on `node`."""
        return node * self.ranks_per_node + self.local

    def peers(self) -> list[int]:
        """The rank with this rank's local rank on every node, in node order (itself included)."""
        return [self.peer(n) for n in range(self.num_nodes)]

    @property
    def node_ranks(self) -> range:
        """The EP ranks of this rank's node, in local order."""
        return range(self.node * self.ranks_per_node, (self.node + 1) * self.ranks_per_node)

    def tier_bytes(self, rows_per_rank: list[int], row_bytes: int) -> tuple[int, int]:
        """Rows this rank sends to each EP rank ([ep]) -> (bytes to other ranks of its node, bytes to
        ranks of other nodes); the rows it sends itself cross nothing."""
        mine = self.node_ranks
        intra = sum(rows_per_rank[r] for r in mine) - rows_per_rank[self.ep_rank]
        inter = sum(rows_per_rank) - sum(rows_per_rank[r] for r in mine)
        return intra * row_bytes, inter * row_bytes

    def block_bytes(self, block_bytes: int) -> tuple[int, int]:
        """One block of block_bytes to every EP rank (padded and gather modes) -> (intra, inter) bytes."""
        L = self.ranks_per_node
        return (L - 1) * block_bytes, (self.ep_size - L) * block_bytes
