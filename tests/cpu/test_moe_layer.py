"""An MoE layer's half after attention as one C call (cpu/fused.py moe_layer, the decode plan's) against
the same layer's operations run one by one: the output, EPLB's load counts, the dispatcher's counters
and routing histogram; and every case where the decode plan must leave the work to the operations."""
from __future__ import annotations

import pytest
import torch

from wideep.cpu import fused
from wideep.cpu.build import unusable
from wideep.cpu.decode_plan import DecodePlan
from wideep.cpu.linear import MAX_ROWS
from wideep.dbo.schedule import run_sequential
from wideep.dbo.state import Microbatch, OpState
from wideep.moe.config import MoEConfig
from wideep.moe.layer import ExpertShard, MoELayer
from wideep.parallel.context import ParallelContext
from wideep.parallel.dispatch import LocalDispatcher
from wideep.parallel.step_plan import StepPlan
from tests.cpu.kernels import CPU

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
    layer = MoELayer(cfg, experts_backend="cpu", linear=CPU.linear, kernels=CPU)
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
def test_moe_layer_equals_the_operations(case, T):
    layer = _layer(*case)
    E = case[2]
    h, x = torch.randn(T, H), torch.randn(T, H)
    ref_d, fused_d = _dispatcher(E), _dispatcher(E)
    layer.routing.load_counts = torch.zeros(E, dtype=torch.int64)
    ref = _by_operations(layer, h, x, ref_d)
    ref_counts, layer.routing.load_counts = layer.load_counts, torch.zeros(E, dtype=torch.int64)
    assert DecodePlan._moe_unfit(layer) is None and DecodePlan._counts_fit(layer)
    w = fused.moe_layer_weights(layer.gate, layer.experts.w13, layer.experts.w2, layer.shared_experts)
    out, _, _ = fused.moe_layer(h, x, w, layer.load_counts)
    fused_d.account_local(T)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.load_counts, ref_counts) and int(ref_counts.sum()) == T * case[3]
    assert fused_d.stats.as_dict() | {"comm_s": 0} == ref_d.stats.as_dict() | {"comm_s": 0}
    assert fused_d.routing.tolist() == ref_d.routing.tolist() == [0, T]


def test_what_the_plan_leaves_to_the_operations():
    """The layer-level conditions (checked once, when the plan builds its structs) and the per-step ones."""
    layer = _layer(*CASES[0])
    E = CASES[0][2]
    assert DecodePlan._moe_unfit(layer) is None
    layer.routing.load_counts = torch.zeros(E + 1, dtype=torch.int64)                    # a counter of another size
    assert not DecodePlan._counts_fit(layer)
    layer.routing.load_counts = torch.zeros(E, dtype=torch.int32)
    assert not DecodePlan._counts_fit(layer)
    layer.routing.load_counts = None
    layer.shared_experts.up_proj.bias = torch.nn.Parameter(torch.zeros(layer.shared_experts.up_proj.out_features))
    assert DecodePlan._moe_unfit(layer) == "shared-expert biases"                # a bias the kernel has no slot for
    layer.shared_experts.up_proj.bias = None
    layer.experts.backend = "grouped"
    assert "experts backend 'grouped'" in DecodePlan._moe_unfit(layer)
    layer.experts.backend = "cpu"
    w13 = layer.experts.w13.data
    layer.experts.w13.data = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert "not contiguous CPU tensors of one dtype" in DecodePlan._moe_unfit(layer)
    layer.experts.w13.data = w13.bfloat16()                                      # w2 still float32
    assert "not contiguous CPU tensors of one dtype" in DecodePlan._moe_unfit(layer)
    layer.experts.w13.data = w13.half()
    assert "float32 or bfloat16" in DecodePlan._moe_unfit(layer)
    layer.experts.w13.data = w13
    layer.gate.weight.data = layer.gate.weight.data.bfloat16()                   # the router stays float32
    assert DecodePlan._moe_unfit(layer) == "a router whose weights are not float32 contiguous CPU tensors"


def test_redundant_slots_on_one_rank_run_the_operations():
    """EPLB's redundant slots on one rank: more local slots than logical experts, physical ids that are
    not the router's: the fused call would read the wrong slots, so the operations run."""
    cfg = _layer(*CASES[0]).cfg
    layer = MoELayer(cfg, ExpertShard(cfg.n_routed_experts + 2), experts_backend="cpu", linear=CPU.linear,
                     kernels=CPU)
    assert "18 local slots for 16 experts" in DecodePlan._moe_unfit(layer)


def test_add_local_is_for_one_node():
    d = _dispatcher(8)
    d.routing.add_local(3)
    assert d.routing.tolist() == [0, 3]
    d.routing.nodes = type(d.routing.nodes)(4, 2, 0)   # a two-node EP group
    with pytest.raises(ValueError, match="one-node EP group, this one spans 2 nodes"):
        d.routing.add_local(1)


@pytest.mark.parametrize("dtype,tiles", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)],
                         ids=["bf16", "bf16-tiles", "f32"])
def test_experts_hand_bigger_bf16_batches_to_blas_sooner(dtype, tiles):
    """bfloat16 weights: past EXPERTS_MAX_ROWS_BF16 rows per expert (where the CPU has bf16 dot products) the experts
    run on forward_grouped's BLAS GEMMs, unless the C kernels run on AMX tiles (then every batch stays in C);
    float32 keeps the C kernel up to EXPERTS_MAX_ROWS; all paths agree (cpu/linear.py experts_max_rows)."""
    from wideep.cpu import gemm
    from wideep.cpu.linear import EXPERTS_MAX_ROWS, EXPERTS_MAX_ROWS_BF16, experts_max_rows
    from wideep.moe.experts import Experts
    from wideep.layers.kernels import Kernels
    from wideep.cpu.kernels import table
    if tiles and not gemm.amx_supported():
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    E, H, I, k = 8, 64, 32, 2
    ex = Experts(E, H, I, dtype=dtype, backend="cpu", kernels=Kernels.from_table("cpu", table()))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    T = 4 * EXPERTS_MAX_ROWS_BF16 * E // k   # 4x the bf16 limit, well under float32's
    x = torch.randn(T, H, dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    grouped = []
    real = Experts.forward_grouped
    before = gemm.amx()
    gemm.amx(tiles)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Experts, "forward_grouped", lambda self, *a: grouped.append(1) or real(self, *a))
            with torch.no_grad():
                got = ex.forward_cpu(x, ids, w)
                ref = ex.kernels.experts(x, ex.w13, ex.w2, ids, w, limit=ex.limit)
        limit = experts_max_rows(dtype, dtype)
    finally:
        gemm.amx(before)
    blas = dtype == torch.bfloat16 and gemm.bf16_dot_supported() and not tiles
    assert limit == (None if tiles else EXPERTS_MAX_ROWS_BF16 if blas else EXPERTS_MAX_ROWS)
    assert len(grouped) == int(blas)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
