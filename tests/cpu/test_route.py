"""The fused C router (cpu/layers.py route) against moe/gate.py's torch path, every method and
scoring, with and without the correction bias, renormalisation and scaling."""
from __future__ import annotations

import pytest
import torch

from wideep.moe.config import MoEConfig
from tests.cpu.kernels import CPU
from wideep.moe.gate import Gate

pytest.importorskip("wideep.cpu.layers")
from wideep.cpu.build import unusable  # noqa: E402

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")

CASES = [   # (method, scoring, E, k, groups, topk_group, norm, scale)
    ("noaux_tc", "sigmoid", 64, 6, 8, 4, True, 2.5),          # DeepSeek-V3
    ("noaux_tc", "sigmoid", 32, 4, 4, 1, False, 1.0),
    ("group_limited_greedy", "softmax", 64, 6, 8, 3, False, 16.0),   # DeepSeek-V2
    ("greedy", "softmax", 16, 2, 1, 1, True, 1.0),
    ("greedy", "sigmoid", 20, 3, 1, 1, False, 1.0),
]


def _gate(method, scoring, E, k, G, tg, norm, scale, seed=0):
    cfg = MoEConfig(n_routed_experts=E, n_shared_experts=0, hidden_size=48, moe_intermediate_size=16, top_k=k,
                    n_group=G, topk_group=tg, topk_method=method, scoring_func=scoring, norm_topk_prob=norm,
                    routed_scaling_factor=scale)
    torch.manual_seed(seed)
    ref, fused = Gate(cfg), Gate(cfg, kernels=CPU)
    torch.nn.init.normal_(ref.weight, std=0.3)
    if ref.e_score_correction_bias is not None:
        torch.nn.init.normal_(ref.e_score_correction_bias, std=0.2)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-E{c[2]}" for c in CASES])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_route_matches_the_torch_gate(case, T):
    ref, fused = _gate(*case)
    x = torch.randn(T, 48)
    with torch.no_grad():
        (ri, rw), (fi, fw) = ref(x), fused(x)
    assert fi.dtype == torch.int64 and fi.shape == ri.shape == (T, case[3]) and fw.shape == rw.shape
    assert torch.equal(fi, ri)                       # same experts, same (descending) order
    torch.testing.assert_close(fw, rw, rtol=1e-5, atol=1e-6)


def test_route_keeps_ids_in_range_on_nan_input():
    ref, fused = _gate("noaux_tc", "sigmoid", 64, 6, 8, 4, True, 2.5)
    x = torch.full((3, 48), float("nan"))
    ids, _ = fused(x)
    assert ids.min() >= 0 and ids.max() < 64
    assert all(len(set(r)) == 6 for r in ids.tolist())   # k distinct experts per token, whatever the scores


def test_route_rejects_mismatched_shapes():
    from wideep.cpu.layers import route
    ref, _ = _gate("greedy", "softmax", 16, 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="route: x"):
        route(torch.randn(4, 40), ref.weight.detach(), None, ref.cfg)
    with pytest.raises(ValueError, match="bias has 3 entries"):
        route(torch.randn(4, 48), ref.weight.detach(), torch.zeros(3), ref.cfg)
