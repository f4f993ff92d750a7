"""Routing accounting: how many nodes each dispatched token touched, as a histogram.

Legend: T tokens, k top-k, N nodes. A token "touches" node n when one of its k physical experts is
on a rank of node n: the number of times it crosses the inter-node link in a two-level dispatch
(minus its own node). With group-limited routing (a token's experts in at most `topk_group` expert
groups) and every group on one node (hierarchical EPLB, or the start-up placement when N divides
n_group and there are no replicas), no token touches more than topk_group nodes.

Every Dispatcher keeps one (dispatcher.routing) and adds each dispatch's topk_ids to it on the
device, with no host sync; a sample is one (token, MoE layer) dispatch.

    counts [N + 1] int64: counts[j] = samples that touched exactly j nodes (j = 0: no expert, ids -1)
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..expert_layout import ExpertLayout
from .nodes import NodeLayout


class NodeHistogram:
    def __init__(self, layout: ExpertLayout, nodes: NodeLayout):
        self.layout, self.nodes = layout, nodes
        self.counts: Tensor | None = None          # [N + 1], on the device of the first ids added
        self._host = None                          # counts' memory seen from NumPy, when on the CPU

    def add(self, topk_ids: Tensor) -> None:
        """topk_ids [T, k] physical (-1 = none)."""
        N = self.nodes.num_nodes
        self._ensure(topk_ids.device)
        if topk_ids.shape[0] == 0:
            return
        ids = topk_ids.to(device=self.counts.device, dtype=torch.long)
        if N == 1:   # one node: a token touches it when any of its ids is real (a third of the ops)
            real = (ids >= 0).any(1).long()
            self.counts.index_add_(0, real, torch.ones_like(real))
            return
        node = torch.where(ids >= 0, self.nodes.node_of(self.layout.rank_of(ids.clamp(min=0))), N)   # [T, k]
        hit = torch.zeros(ids.shape[0], N + 1, dtype=torch.bool, device=ids.device)
        hit.scatter_(1, node, True)
        touched = hit[:, :N].sum(1)                                                 # [T]
        self.counts.index_add_(0, touched, torch.ones_like(touched))

    def add_local(self, num_tokens: int, device: torch.device | str = "cpu") -> None:
        """What add() records for num_tokens tokens that each have a real expert, in a one-node EP group
        (a dispatcher with every expert local): each touched one node. No ids read, one op."""
        if self.nodes.num_nodes != 1:
            raise ValueError(f"add_local is for a one-node EP group, this one spans {self.nodes.num_nodes} nodes")
        self._ensure(device)
        if self._host is not None:   # the counts' memory as a NumPy array: one scalar add, no torch op
            self._host[1] += num_tokens
        else:
            self.counts[1:2].add_(num_tokens)

    def _ensure(self, device) -> None:
        if self.counts is None:   # a normal tensor even when the first dispatch runs in inference mode,
            with torch.inference_mode(False):   # so that reset() and add() work in and out of it
                self.counts = torch.zeros(self.nodes.num_nodes + 1, dtype=torch.int64, device=device)
            self._host = self.counts.numpy() if self.counts.device.type == "cpu" else None

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()

    def tolist(self) -> list[int]:
        """counts on the host ([N + 1] zeros before any dispatch). SYNC: a device-to-host copy; for
        stats, never on the step path."""
        if self.counts is None:
            return [0] * (self.nodes.num_nodes + 1)
        return self.counts.tolist()


def total_counts(dispatchers) -> Tensor | None:
    """The sum of the dispatchers' histograms ([N + 1], on their device), or None before any dispatch."""
    parts = [d.routing.counts for d in dispatchers if d.routing.counts is not None]
    return torch.stack(parts).sum(0) if parts else None
