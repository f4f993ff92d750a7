"""Where the ranks run: nodes, ranks per node, and one process group per node.

Ranks are laid out node-major: node n holds ranks [n * ranks_per_node, (n + 1) * ranks_per_node),
which is how torchrun and mpirun (by slot) place them. bootstrap() takes the layout from, in order:
- `[parallel] ranks_per_node` > 0: simulated nodes, e.g. 4 ranks on one host as 2 nodes of 2;
- torchrun: LOCAL_WORLD_SIZE ranks per node, GROUP_RANK the node (any launcher setting
  LOCAL_WORLD_SIZE < WORLD_SIZE: node = rank // LOCAL_WORLD_SIZE);
- mpirun: a shared-memory split of COMM_WORLD (one per host), hosts numbered by their lowest rank;
- otherwise one node.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must be >= 1 and divide world_size "
                             f"({self.world_size})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """Rank within its node."""
        return self.rank % self.ranks_per_node

    def node_ranks(self, node: int | None = None) -> list[int]:
        """Global ranks of `node` (default: this rank's node)."""
        n = self.node_rank if node is None else node
        return list(range(n * self.ranks_per_node, (n + 1) * self.ranks_per_node))

    @classmethod
    def from_launcher(cls, rank: int, world_size: int, local_rank: int, local_world_size: int,
                      node_rank: int | None = None, source: str = "the launcher") -> "Topology":
        """From what a launcher reports; raises ValueError naming the numbers unless the layout is
        node-major with the same number of ranks on every node."""
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(f"{source} reports {local_world_size} ranks on this node, which does not divide "
                             f"world_size ({world_size}): every node must run the same number of ranks")
        node = rank // local_world_size if node_rank is None else node_rank
        if rank != node * local_world_size + local_rank:
            raise ValueError(f"{source} placed rank {rank} as local rank {local_rank} of node {node} with "
                             f"{local_world_size} ranks per node; ranks must be node-major (node n holds ranks "
                             f"n*{local_world_size} .. n*{local_world_size}+{local_world_size - 1})")
        return cls(rank, world_size, local_world_size)

    def simulate(self, ranks_per_node: int) -> "Topology":
        """`[parallel] ranks_per_node`: split this layout into nodes of that size. Simulated nodes
        never straddle real ones."""
        if ranks_per_node < 1 or self.world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) does not divide world_size ({self.world_size})")
        if self.num_nodes > 1 and self.ranks_per_node % ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the {self.ranks_per_node} ranks per "
                             f"node the launcher reports ({self.num_nodes} nodes)")
        return Topology(self.rank, self.world_size, ranks_per_node)


def mpi_topology(comm, rank: int, world_size: int) -> Topology:
    """Collective over COMM_WORLD: hosts from a shared-memory split, numbered by their lowest rank.
    O(log world) messages per rank; the same error on every rank if the layout is not node-major."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    leaders = comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
    node = leaders.Get_rank() if local_rank == 0 else None
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    node = local.bcast(node, root=0)
    local.Free()
    sizes = comm.allreduce(local_size, op=MPI.MIN), comm.allreduce(local_size, op=MPI.MAX)
    node_major = comm.allreduce(int(rank == node * local_size + local_rank), op=MPI.MIN)
    if sizes[0] != sizes[1]:
        raise ValueError(f"mpirun placed between {sizes[0]} and {sizes[1]} ranks on a host: every node must run the "
                         f"same number of ranks")
    if not node_major:
        raise ValueError(f"mpirun did not place ranks node-major ({local_size} per host; e.g. rank {rank} is local "
                         f"rank {local_rank} of host {node}); map by slot (Open MPI --map-by slot, MPICH -ppn "
                         f"{local_size})")
    return Topology(rank, world_size, local_size)


def new_node_group(topo: Topology, backend: str, timeout: timedelta) -> Any:
    """This rank's intra-node process group, or None with one node (use the world group).

    Collective: every rank creates every node's group in node order (O(num_nodes) calls, each a
    no-op for non-members except where NCCL splits communicators, which needs the whole world)."""
    if topo.num_nodes == 1:
        return None
    import torch.distributed as dist

    mine = None
    for node in range(topo.num_nodes):
        group = dist.new_group(topo.node_ranks(node), backend=backend, timeout=timeout)
        if node == topo.node_rank:
            mine = group
    return mine
