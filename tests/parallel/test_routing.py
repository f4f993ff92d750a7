"""Routing accounting (parallel/dispatch/routing.py): the nodes-per-token histogram is exact, and
with group-limited routing and every expert group on one node it never exceeds topk_group — from the
start-up placement and from a hierarchical EPLB plan with replicas; without the group limit, or
with replicas placed without regard to nodes, tokens do touch more nodes (the bound is the
placement's doing, and the check can fail). Also NodeLayout's arithmetic. Single process: the
histogram reads only topk_ids and the layout."""
from __future__ import annotations

import pytest
import torch

from wideep.eplb import rebalance_experts
from wideep.eplb.placement import ExpertMap, Placement
from wideep.moe.config import MoEConfig
from wideep.moe.gate import Gate
from wideep.parallel.dispatch.nodes import NodeLayout
from wideep.parallel.dispatch.routing import NodeHistogram
from wideep.parallel.expert_layout import ExpertLayout

E, G, TOPK_GROUP, K, H = 32, 8, 2, 6, 32      # DeepSeek-V3's structure, scaled: 8 groups, 2 kept, top-6
EP, L = 8, 2                                  # 4 nodes of 2 ranks: 2 expert groups per node


def _gate(topk_method: str, seed: int = 0) -> Gate:
    cfg = MoEConfig(hidden_size=H, moe_intermediate_size=8, n_routed_experts=E, n_shared_experts=0, top_k=K,
                    n_group=G if topk_method != "greedy" else 1, topk_group=TOPK_GROUP if topk_method != "greedy" else 1,
                    topk_method=topk_method, scoring_func="sigmoid" if topk_method == "noaux_tc" else "softmax")
    gate = Gate(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, H, generator=g))
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.copy_(0.1 * torch.randn(E, generator=g))
    return gate


def _hist(phys: torch.Tensor, P: int) -> list[int]:
    h = NodeHistogram(ExpertLayout(P, EP), NodeLayout(EP, L))
    h.add(phys)
    return h.tolist()


def test_histogram_on_one_node_counts_tokens_with_a_real_id():
    h = NodeHistogram(ExpertLayout(16, 4), NodeLayout(4, 4))      # 4 ranks, all on one node
    h.add(torch.tensor([[0, 15, 3], [-1, -1, -1], [-1, 9, -1], [4, 4, 4]]))
    assert h.tolist() == [1, 3]
    h.add(torch.zeros(0, 3, dtype=torch.long))
    assert h.tolist() == [1, 3]


def test_histogram_is_exact():
    layout, nodes = ExpertLayout(16, 4), NodeLayout(4, 2)        # 2 nodes of 2 ranks, 4 slots per rank
    h = NodeHistogram(layout, nodes)
    assert h.tolist() == [0, 0, 0]
    h.add(torch.tensor([[0, 1, 2, 3], [0, 15, -1, -1], [-1, -1, -1, -1], [8, 9, 12, -1], [7, 8, 3, 4]]))
    # tokens touch nodes {0}, {0, 1}, {}, {1}, {0, 1}
    assert h.tolist() == [1, 2, 2]
    h.add(torch.zeros(0, 4, dtype=torch.long))                     # an idle rank adds nothing
    h.add(torch.tensor([[5, 6, 7, 0]]))
    assert h.tolist() == [1, 3, 2]
    h.reset()
    assert h.tolist() == [0, 0, 0]
    # the engine dispatches in inference mode; stats are reset outside it
    h2 = NodeHistogram(layout, nodes)
    with torch.inference_mode():
        h2.add(torch.tensor([[0, 15, -1, -1]]))
    h2.reset()
    h2.add(torch.tensor([[0, 1, 2, 3]]))
    assert h2.tolist() == [0, 1, 0]


@pytest.mark.parametrize("topk_method", ["noaux_tc", "group_limited_greedy"])
def test_group_limited_routing_touches_at_most_topk_group_nodes(topk_method):
    x = torch.randn(2048, H, generator=torch.Generator().manual_seed(1))
    ids, _ = _gate(topk_method)(x)                                             # [T, K] logical
    # start-up placement without replicas: expert e in slot e, so group g lives on node g // (G / N)
    hist = _hist(ids, E)
    assert sum(hist) == len(x) and max(j for j, n in enumerate(hist) if n) <= TOPK_GROUP, hist
    assert hist[2] > 0                                                         # the bound is reached
    # without the group limit the same tokens spread over more nodes: the check above can fail
    free, _ = _gate("greedy")(x)
    free_hist = _hist(free, E)
    assert max(j for j, n in enumerate(free_hist) if n) > TOPK_GROUP, free_hist


def test_hierarchical_eplb_replicas_keep_the_bound():
    P = E + EP                                                                 # one replica slot per rank
    x = torch.randn(2048, H, generator=torch.Generator().manual_seed(2))
    ids, _ = _gate("noaux_tc")(x)
    load = torch.bincount(ids.flatten(), minlength=E)[None].float()            # [1, E]
    phy2log, log2phy, logcnt = rebalance_experts(load, P, G, EP // L, EP)      # hierarchical: groups on nodes
    assert (logcnt > 1).any()
    for rank in range(EP):                                                     # every rank's replica choice
        phys = ExpertMap(log2phy[0], logcnt[0], rank, "cpu")(ids)
        hist = _hist(phys, P)
        assert max(j for j, n in enumerate(hist) if n) <= TOPK_GROUP, (rank, hist)
    # the start-up placement with replicas puts experts 0..7's copies on the last node, whatever
    # their group: tokens using them can touch a third node
    start = Placement.initial(1, E, P)
    spread = _hist(ExpertMap(start.log2phy[0], start.logcnt[0], 0, "cpu")(ids), P)
    assert max(j for j, n in enumerate(spread) if n) > TOPK_GROUP, spread


def test_node_layout():
    n = NodeLayout(8, 4, ep_rank=5)
    assert (n.num_nodes, n.node, n.local, n.peers(), n.node_ranks) == (2, 1, 1, [1, 5], range(4, 8))
    assert n.tier_bytes([3, 0, 1, 0, 2, 9, 0, 4], 10) == (60, 40)             # self (9 rows) crosses nothing
    assert n.block_bytes(10) == (30, 40)
    assert NodeLayout(4, 1, 2).peers() == [0, 1, 2, 3] and NodeLayout(4, 4, 2).peers() == [2]
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must be >= 1 and divide the EP size \(8\)"):
        NodeLayout(8, 3)
