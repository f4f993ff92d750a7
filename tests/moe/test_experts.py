"""Grouped experts == reference loop; the router's methods on hand-checkable inputs."""
from __future__ import annotations

import pytest
import torch

from wideep.moe.config import MoEConfig
from wideep.moe.experts import Experts
from wideep.moe.gate import Gate


@pytest.mark.parametrize("pad_limit", [0, 16, 1000])  # per-expert GEMMs / auto / padded bmm
@pytest.mark.parametrize("R,E,k", [(1, 4, 1), (37, 8, 3), (200, 16, 6), (5, 64, 6)])
@torch.no_grad()
def test_grouped_equals_reference(R, E, k, pad_limit):
    torch.manual_seed(R + E)
    ex = Experts(E, 32, 24)
    ex.PAD_LIMIT = pad_limit
    with torch.no_grad():
        ex.w13.normal_(0, 0.2)
        ex.w2.normal_(0, 0.2)
    x = torch.randn(R, 32)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(R)])
    ids[torch.rand(R, k) < 0.2] = -1  # slots whose expert lives on another rank
    w = torch.rand(R, k)
    torch.testing.assert_close(ex.forward_grouped(x, ids, w), ex.forward_reference(x, ids, w), atol=1e-5, rtol=1e-5)


def test_experts_zero_rows():
    ex = Experts(4, 8, 8)
    assert ex(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 8)


def _gate(**kw) -> Gate:
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, n_routed_experts=8, n_shared_experts=0, **kw)
    g = Gate(cfg)
    with torch.no_grad():
        g.weight.zero_()
    return g


def test_noaux_tc_bias_selects_but_does_not_weigh():
    g = _gate(top_k=2, n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
              norm_topk_prob=False, routed_scaling_factor=2.0)
    with torch.no_grad():
        g.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 1.0, 0.5]))
    ids, w = g(torch.zeros(1, 4))  # all scores sigmoid(0) = 0.5
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5 * 2.0))


def test_group_limited_greedy_keeps_best_groups():
    g = _gate(top_k=2, n_group=4, topk_group=1, topk_method="group_limited_greedy", scoring_func="softmax")
    with torch.no_grad():
        g.weight[:, 0] = torch.tensor([0, 0, 0, 0, 5.0, 0, 4.0, 4.5])  # group 2 has the max, group 3 the most mass
    ids, _ = g(torch.tensor([[1.0, 0, 0, 0]]))
    assert sorted(ids[0].tolist()) == [4, 5]


def test_norm_topk_prob_sums_to_scaling_factor():
    g = _gate(top_k=3, topk_method="greedy", scoring_func="softmax", norm_topk_prob=True, routed_scaling_factor=2.5)
    with torch.no_grad():
        g.weight.normal_()
    _, w = g(torch.randn(5, 4))
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))
