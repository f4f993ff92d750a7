"""What each backend's dispatch hands to its combine (Dispatched.handle): one dataclass per backend
and mode, so combine knows the mode its dispatch used from the handle alone.

Legend as in base.py; S rows this rank sent (one per unique (token, destination rank) pair),
C the planned low-latency capacity (tokens per rank), M the padded T of the allgather backend;
two-level (hierarchical.py): N nodes, L ranks per node, S1 stage-1 rows this rank sent (one per
unique (token, destination node) pair), R1 stage-1 rows it received, S2 rows it forwarded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class LocalHandle:
    num_tokens: int           # T: the rows combine must get back


@dataclass
class TorchHandle:
    """Torch normal mode."""
    send_tok: Tensor          # [S] source token index of each sent row, grouped by destination rank
    send_splits: list[int]    # [ep] rows sent to each rank
    recv_splits: list[int]    # [ep] rows received from each rank
    num_tokens: int           # T on this rank


@dataclass
class TorchLowLatencyHandle:
    """Torch low-latency mode: received row r*C + t is rank r's token t."""
    member: Tensor            # [T, ep] bool: token t went to rank r (its row r*C + t there is live)
    capacity: int             # C


@dataclass
class HierarchicalHandle:
    """Two-level normal mode: stage 1 (this rank's tokens to its peer on each node), then stage 2
    (the rows this rank received in stage 1, forwarded to the ranks of its node)."""
    send_tok: Tensor          # [S1] source token of each stage-1 row, grouped by destination node
    send_splits: list[int]    # [ep] stage-1 rows sent to each rank (peers only)
    recv_splits: list[int]    # [ep] stage-1 rows received from each rank (peers only): R1 in all
    fwd_row: Tensor           # [S2] stage-1 received row of each forwarded row, grouped by local rank
    fwd_splits: list[int]     # [ep] stage-2 rows sent to each rank (this node's only)
    fwd_recv_splits: list[int]  # [ep] stage-2 rows received from each rank: the Dispatched rows
    num_tokens: int           # T on this rank


@dataclass
class HierarchicalLowLatencyHandle:
    """Two-level low-latency mode: fixed blocks, [C] rows to each peer, then [N*C] rows to each
    rank of the node; received row (l, n, t) is token t of the rank with local rank l on node n."""
    node_member: Tensor       # [T, N] bool: token t went to node n
    fwd_member: Tensor        # [N*C, L] bool: stage-1 received row went on to local rank l
    capacity: int             # C


@dataclass
class AllGatherHandle:
    padded: int               # M: rows per rank in the gathered [ep*M, H]
    num_tokens: int           # T on this rank


@dataclass
class DeepEPHandle:
    """DeepEP normal mode."""
    handle: Any               # deep_ep.Buffer.dispatch's handle


@dataclass
class DeepEPLowLatencyHandle:
    """DeepEP low-latency mode: rows are [El, N*ep] per-local-expert blocks; combine weighs them."""
    handle: Any               # deep_ep.Buffer.low_latency_dispatch's handle
    topk_ids: Tensor          # [T, k] physical, as dispatched
    topk_weights: Tensor      # [T, k] fp32
    num_local: int            # El
    rows_per_expert: int      # N * ep
