"""A decoder layer's modules as the fused CPU calls take them (engine/model/fused_weights.py): the struct built from
each module runs, as one C call, what the module's operations run (the attention half: input norm, MLA on the cpu
backend, residual, post-attention norm; the MoE half: router, experts, shared experts, residual, with EPLB's load
counts and the dispatcher's counters; a dense MLP half, float32 or fp8 projections); and every case where the decode
plan must leave a half to the operations, with its reason. The raw launchers: tests/cpu/test_fused.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import fused
from wideep.cpu.build import unusable
from wideep.cpu.linear import MAX_ROWS
from wideep.dbo.schedule import run_sequential
from wideep.dbo.state import Microbatch, OpState
from wideep.engine.model.fused_decode import DecodePlan
from wideep.engine.model.fused_weights import (attention_unfit, mla_layer_weights, mlp_layer_weights, mlp_unfit,
                                               moe_layer_weights, moe_unfit)
from wideep.layers import MLP, RMSNorm
from wideep.moe.config import MoEConfig
from wideep.moe.layer import ExpertShard, MoELayer
from wideep.parallel.context import ParallelContext
from wideep.parallel.dispatch import LocalDispatcher
from wideep.parallel.step_plan import StepPlan
from tests.cpu.kernels import CPU

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")


# -- the attention half ---------------------------------------------------------------------------------------
def _attention(q_lora, sparse: bool = False):
    """An MLA (or SparseMLA) on the cpu backend with the test module's config and its two norms, as the engine
    builds them -> a DecoderLayer's attention fields (self_attn, input_layernorm, post_attention_layernorm)."""
    from wideep.attention_mla.config import DSAConfig
    from wideep.attention_mla.mla import MLA
    from wideep.attention_mla.rope import RotaryEmbedding
    from wideep.attention_mla.sparse_mla import SparseMLA
    from tests.attention_mla.test_mla import _mla
    cfg = _mla(q_lora).cfg
    kw = dict(linear=CPU.linear, backend="cpu", kernels=CPU)
    rope = RotaryEmbedding(cfg.rope, kernels=CPU)
    mla = (SparseMLA(cfg, DSAConfig(index_n_heads=4, index_head_dim=16, index_topk=8, rope_dim=cfg.qk_rope_head_dim,
                                    q_lora_rank=q_lora), rope, **kw) if sparse else MLA(cfg, rope, **kw))
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.2)
    norms = [RMSNorm(48, 1e-6, kernels=CPU), RMSNorm(48, 1e-5, kernels=CPU)]
    for n in norms:
        torch.nn.init.normal_(n.weight, 1.0, 0.2)
    return SimpleNamespace(self_attn=mla, input_layernorm=norms[0], post_attention_layernorm=norms[1])


@pytest.mark.parametrize("q_lora", [None, 20])
def test_mla_layer_equals_the_operations(q_lora):
    """fused.mla_layer on mla_layer_weights' struct == input norm, MLA forward on the cpu backend, residual,
    post-attention norm run one by one: outputs and the cache; a bad slot is named and nothing is written."""
    from wideep.attention_mla.meta import AttnMeta
    from tests.attention_mla.test_mla import _meta
    torch.manual_seed(8)
    layer = _attention(q_lora)
    mla, norms = layer.self_attn, [layer.input_layernorm, layer.post_attention_layernorm]
    assert attention_unfit(layer) is None
    w = mla_layer_weights(*norms, mla)
    lens, bs = [5, 1, 9], 4
    meta = _meta(lens, bs)
    pool = torch.zeros(64 * bs, 32)
    with torch.no_grad():
        mla(torch.randn(sum(lens), 48), meta, pool, *mla.rope.cos_sin(meta.positions))   # prefill
        assert meta.paged_decode_tables(mla.mode) is None                                # not a decode step
        pos = list(lens)
        slots = [int(meta.block_table[b, p // bs]) * bs + p % bs for b, p in enumerate(pos)]
        dmeta = AttnMeta(torch.tensor(pos), torch.tensor(slots), meta.block_table, [1, 1, 1], [p + 1 for p in pos], bs)
        x = torch.randn(3, 48)
        cos, sin = mla.rope.cos_sin(dmeta.positions)
        ref_pool = pool.clone()
        h_ref = x + mla(norms[0](x), dmeta, ref_pool, cos, sin)
        table, lens_t, max_len = dmeta.paged_decode_tables(mla.mode)
        h, mlp_in = fused.mla_layer(x, w, mla.w_uk_t(), cos, sin, pool, dmeta.slot_mapping, table, lens_t, max_len, bs)
        torch.testing.assert_close(h, h_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(mlp_in, norms[1](h_ref), atol=1e-6, rtol=1e-6)
        assert torch.equal(pool, ref_pool)                                  # the same latents, same rows
        bad = torch.tensor([slots[0], 64 * bs, slots[2]])
        with pytest.raises(ValueError, match=f"token 1's slot {64 * bs} is outside the pool's {64 * bs} rows"):
            fused.mla_layer(x, w, mla.w_uk_t(), cos, sin, pool, bad, table, lens_t, max_len, bs)
        assert torch.equal(pool, ref_pool)                                  # nothing written


def test_what_the_plan_leaves_to_the_attention_operations():
    layer = _attention(20)
    assert attention_unfit(_attention(20, sparse=True)) == "sparse attention (DSA)"
    layer.self_attn.backend = "torch"
    assert attention_unfit(layer) == "attention backend 'torch'"
    layer.self_attn.backend = "cpu"
    layer.input_layernorm.kernel = None
    assert attention_unfit(layer) == "norms without the C kernel"
    layer.input_layernorm.kernel = CPU.rmsnorm
    layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(48))
    assert attention_unfit(layer) == "projection biases"
    layer.self_attn.o_proj.bias = None
    layer.self_attn.o_proj.weight.data = layer.self_attn.o_proj.weight.data.bfloat16()   # the others float32
    assert attention_unfit(layer).startswith("weights that are not contiguous CPU tensors of one dtype")


# -- the MoE half ---------------------------------------------------------------------------------------------
CASES = [   # (method, scoring, E, k, groups, topk_group, shared, norm, scale)
    ("noaux_tc", "sigmoid", 16, 4, 4, 2, 1, True, 2.5),           # DeepSeek-V3-like, a shared expert
    ("group_limited_greedy", "softmax", 12, 3, 3, 2, 2, False, 1.0),   # V2-like, two shared experts
    ("greedy", "softmax", 8, 2, 1, 1, 0, True, 1.0),              # no shared experts
]
H, I = 48, 24


def _moe(method, scoring, E, k, G, tg, shared, norm, scale, seed=0) -> MoELayer:
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
    """fused.moe_layer on moe_layer_weights' struct == the MoE layer's operations: the output, EPLB's load counts,
    the dispatcher's counters and routing histogram (the plan's fused half accounts its rows as local)."""
    layer = _moe(*case)
    E = case[2]
    h, x = torch.randn(T, H), torch.randn(T, H)
    ref_d, fused_d = _dispatcher(E), _dispatcher(E)
    layer.routing.load_counts = torch.zeros(E, dtype=torch.int64)
    ref = _by_operations(layer, h, x, ref_d)
    ref_counts, layer.routing.load_counts = layer.load_counts, torch.zeros(E, dtype=torch.int64)
    assert moe_unfit(layer) is None and DecodePlan._counts_fit(layer)
    w = moe_layer_weights(layer.gate, layer.experts.w13, layer.experts.w2, layer.shared_experts)
    out, _, _ = fused.moe_layer(h, x, w, layer.load_counts)
    fused_d.account_local(T)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.load_counts, ref_counts) and int(ref_counts.sum()) == T * case[3]
    assert fused_d.stats.as_dict() | {"comm_s": 0} == ref_d.stats.as_dict() | {"comm_s": 0}
    assert fused_d.routing.tolist() == ref_d.routing.tolist() == [0, T]


def test_what_the_plan_leaves_to_the_moe_operations():
    """The layer-level conditions (checked once, when the plan builds its structs) and the per-step ones."""
    layer = _moe(*CASES[0])
    E = CASES[0][2]
    assert moe_unfit(layer) is None
    layer.routing.load_counts = torch.zeros(E + 1, dtype=torch.int64)                    # a counter of another size
    assert not DecodePlan._counts_fit(layer)
    layer.routing.load_counts = torch.zeros(E, dtype=torch.int32)
    assert not DecodePlan._counts_fit(layer)
    layer.routing.load_counts = None
    layer.shared_experts.up_proj.bias = torch.nn.Parameter(torch.zeros(layer.shared_experts.up_proj.out_features))
    assert moe_unfit(layer) == "shared-expert biases"                # a bias the kernel has no slot for
    layer.shared_experts.up_proj.bias = None
    layer.experts.backend = "grouped"
    assert "experts backend 'grouped'" in moe_unfit(layer)
    layer.experts.backend = "cpu"
    w13 = layer.experts.w13.data
    layer.experts.w13.data = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert "not contiguous CPU tensors of one dtype" in moe_unfit(layer)
    layer.experts.w13.data = w13.bfloat16()                                      # w2 still float32
    assert "not contiguous CPU tensors of one dtype" in moe_unfit(layer)
    layer.experts.w13.data = w13.half()
    assert "float32 or bfloat16" in moe_unfit(layer)
    layer.experts.w13.data = w13
    layer.gate.weight.data = layer.gate.weight.data.bfloat16()                   # the router stays float32
    assert moe_unfit(layer) == "a router whose weights are not float32 contiguous CPU tensors"


def test_redundant_slots_on_one_rank_run_the_operations():
    """EPLB's redundant slots on one rank: more local slots than logical experts, physical ids that are
    not the router's: the fused call would read the wrong slots, so the operations run."""
    cfg = _moe(*CASES[0]).cfg
    layer = MoELayer(cfg, ExpertShard(cfg.n_routed_experts + 2), experts_backend="cpu", linear=CPU.linear,
                     kernels=CPU)
    assert "18 local slots for 16 experts" in moe_unfit(layer)


# -- a dense layer's MLP half ---------------------------------------------------------------------------------
@pytest.mark.parametrize("T,h,i,block", [(1, 40, 22, None), (64, 40, 22, None), (1, 200, 136, (128, 128)),
                                         (3, 40, 22, (16, 16)), (17, 64, 48, (32, 32))])
def test_mlp_layer_equals_the_mlp(T, h, i, block):
    """fused.mlp_layer on mlp_layer_weights' struct == h + MLP(x): float32 projections, or an fp8 checkpoint's kept
    as stored (Fp8Linear: e4m3 + block scales, given to C as Fp8Mat structs; torch dequantises)."""
    from wideep.moe.fp8 import quantize_fp8_block
    from wideep.moe.fp8_linear import Fp8Linear
    torch.manual_seed(T + h + i)
    mlp = MLP(h, i, linear=torch.nn.Linear if block is None else Fp8Linear.factory(block, backend="torch"))
    with torch.no_grad():
        for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if block is None:
                m.weight.normal_(0, 0.2)
            else:
                q, sc = quantize_fp8_block(torch.randn(m.out_features, m.in_features) * 0.2, block)
                m.weight.copy_(q)
                m.weight_scale_inv.copy_(sc)
    assert mlp_unfit(mlp) is None
    w = mlp_layer_weights(mlp)
    assert (w.H, w.Is, len(w.fp8_mats)) == (h, i, 0 if block is None else 3) and (w.wdt == 2) == (block is not None)
    res, x = torch.randn(T, h), torch.randn(T, h)
    with torch.no_grad():
        ref = res + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(fused.mlp_layer(res, x, w), ref, atol=1e-5, rtol=1e-5)


def test_what_the_plan_leaves_to_the_dense_mlp():
    from wideep.moe.fp8_linear import Fp8Linear
    mlp = MLP(40, 22, linear=CPU.linear)
    mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(22))
    assert mlp_unfit(mlp) == "its projections are not bias-free float32 or bfloat16 CPU weights"
    mlp.up_proj.bias = None
    mlp.down_proj.weight.data = mlp.down_proj.weight.data.bfloat16()
    assert mlp_unfit(mlp) == "its projections are not bias-free float32 or bfloat16 CPU weights"
    mlp.down_proj = Fp8Linear(22, 40, block=(16, 8), backend="torch")   # beside plain ones, K block not 16s
    assert mlp_unfit(mlp).startswith("fp8 projections with biases, beside plain ones")
