"""An MoE layer's half after attention as one C call (moe/layer.py MoELayer.decode_layer, cpu/fused.py
moe_layer) against the same layer's operations run one by one: the output, EPLB's load counts, the
dispatcher's counters and routing histogram; and every case where it must leave the work to the
operations (None)."""
from __future__ import annotations

import pytest
import torch

from cpu.build import unusable
from cpu.linear import MAX_ROWS, Linear as CpuLinear
from dbo.schedule import run_sequential
from dbo.state import Microbatch, OpState
from moe.config import MoEConfig
from moe.layer import ExpertShard, MoELayer
from parallel.context import ParallelContext
from parallel.dispatch import LocalDispatcher
from parallel.step_plan import StepPlan

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")

CASES = [   # (method, scoring, E, k, groups, topk_group, shared, norm, scale)
    ("noaux_tc", "sigmoid", 16, 4, 4, 2, 1, True, 2.5),           # DeepSeek-V3-like, a shared expert
    ("group_limited_greedy", "softmax", 12, 3, 3, 2, 2, False, 1.0),   # V2-like, two shared experts
    ("greedy", "softmax", 8, 2, 1, 1, 0, True, 1.0),              # no shared experts
]
H, I = 48, 24


def _layer(method, scoring, E, k, G, tg, shared, norm, scale, seed=0) -> MoELayer:
    cfg = MoEConfig(n_routed_experts=E, n_shared_experts=shared, hidden_size=H, moe_intermediate_size=I, top_k=k,
                    n_group=G, topk_group=tg, topk_method=method, scoring_func=scoring, norm_topk_prob=norm,
                    routed_scaling_factor=scale)
    torch.manual_seed(seed)
    layer = MoELayer(cfg, experts_backend="cpu", linear=CpuLinear)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _dispatcher(E: int) -> LocalDispatcher:
    return LocalDispatcher(ParallelContext.single("cpu"), E, H)


def _by_operations(layer: MoELayer, h: torch.Tensor, x: torch.Tensor, dispatcher) -> torch.Tensor:
    s = OpState(Microbatch(0, None, None, [], StepPlan(), dispatcher), mlp_in=x)
    return h + run_sequential(layer.ops(), s).result("mlp_out")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("T", [1, 5, MAX_ROWS])
def test_decode_layer_equals_the_operations(case, T):
    layer = _layer(*case)
    E = case[2]
    h, x = torch.randn(T, H), torch.randn(T, H)
    ref_d, fused_d = _dispatcher(E), _dispatcher(E)
    layer.load_counts = torch.zeros(E, dtype=torch.int64)
    ref = _by_operations(layer, h, x, ref_d)
    ref_counts, layer.load_counts = layer.load_counts, torch.zeros(E, dtype=torch.int64)
    out = layer.decode_layer(h, x, fused_d)
    assert out is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.load_counts, ref_counts) and int(ref_counts.sum()) == T * case[3]
    assert fused_d.stats.as_dict() | {"comm_s": 0} == ref_d.stats.as_dict() | {"comm_s": 0}
    assert fused_d.routing.tolist() == ref_d.routing.tolist() == [0, T]


def test_decode_layer_leaves_the_rest_to_the_operations():
    layer = _layer(*CASES[0])
    E, d = CASES[0][2], _dispatcher(CASES[0][2])
    h, x = torch.randn(3, H), torch.randn(3, H)
    assert layer.decode_layer(h[:0], x[:0], d) is None                           # no tokens
    big = torch.randn(MAX_ROWS + 1, H)
    assert layer.decode_layer(big, big, d) is None                               # past MAX_ROWS: BLAS
    assert layer.decode_layer(h, x.t().contiguous().t(), d) is None              # not contiguous
    assert layer.decode_layer(h, x, object()) is None                            # a dispatcher that moves tokens

    class Moving(LocalDispatcher):
        local_only = False
    assert layer.decode_layer(h, x, Moving(ParallelContext.single("cpu"), E, H)) is None
    layer.expert_map = lambda ids: ids                                           # EPLB's map: the operations
    assert layer.decode_layer(h, x, d) is None
    layer.expert_map = None
    layer.load_counts = torch.zeros(E + 1, dtype=torch.int64)                    # a counter of another size
    assert layer.decode_layer(h, x, d) is None
    layer.load_counts = None
    layer.shared_experts.up_proj.bias = torch.nn.Parameter(torch.zeros(layer.shared_experts.up_proj.out_features))
    assert layer.decode_layer(h, x, d) is None                                   # a bias the kernel has no slot for
    layer.shared_experts.up_proj.bias = None
    layer.experts.backend = "grouped"
    assert layer.decode_layer(h, x, d) is None
    layer.experts.backend = "cpu"
    assert d.stats.dispatch_calls == 0 and d.routing.tolist() == [0, 0]          # nothing recorded by a refusal
    assert layer.decode_layer(h, x, d) is not None and d.stats.dispatch_calls == 1


def test_redundant_slots_on_one_rank_run_the_operations():
    """EPLB's redundant slots on one rank: more local slots than logical experts, physical ids that are
    not the router's: the fused call would read the wrong slots, so the operations run."""
    cfg = _layer(*CASES[0]).cfg
    layer = MoELayer(cfg, ExpertShard(cfg.n_routed_experts + 2), experts_backend="cpu", linear=CpuLinear)
    x = torch.randn(2, H)
    assert layer.decode_layer(x, x, _dispatcher(cfg.n_routed_experts + 2)) is None


def test_add_local_is_for_one_node():
    d = _dispatcher(8)
    d.routing.add_local(3)
    assert d.routing.tolist() == [0, 3]
    d.routing.nodes = type(d.routing.nodes)(4, 2, 0)   # a two-node EP group
    with pytest.raises(ValueError, match="one-node EP group, this one spans 2 nodes"):
        d.routing.add_local(1)
