"""A decoder layer's modules as the fused CPU decode calls take them: why a half cannot be fused (checked once per
layer by the decode plan, fused_decode.py), and the structs of cpu/fused.py built from the modules that can.

The modules are the MLA family's (model.py DecoderLayer): MLA (attention_mla/mla.py; SparseMLA, DSA, is declined),
RMSNorm and the dense MLP (layers/), MoELayer with its Gate, Experts and shared-expert MLP (moe/). Their projections
are plain linears with float32 or bfloat16 weights, or an fp8 checkpoint's kept as stored (moe/fp8_linear.py
Fp8Linear: e4m3 bytes + float32 block scales), which go to C as a cpu/fused.py Fp8Mat; the norms, kv_b_proj and the
router stay in the model dtype (the router float32, as moe/gate.py keeps it).

Legend: E experts (every one local), H hidden, I moe_intermediate_size. A struct points into the modules' tensors:
the caller keeps them (and the Fp8Mat structs, kept on the struct as `fp8_mats`) alive while it uses the struct.
"""
from __future__ import annotations

import ctypes

import torch

from wideep.attention_mla.mla import MLA
from wideep.attention_mla.sparse_mla import SparseMLA
from wideep.cpu.fused import Fp8Mat, MlaWeights, MlpWeights, MoeWeights
from wideep.cpu.gemm import FP8, WD_FP8, WDT
from wideep.cpu.layers import ROUTE_METHODS
from wideep.layers import MLP, RMSNorm
from wideep.moe.experts import Experts
from wideep.moe.fp8_linear import Fp8Linear
from wideep.moe.gate import Gate
from wideep.moe.layer import MoELayer

from .model import DecoderLayer

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)   # what the fused calls read as stored (cpu/gemm.py WDT)


# -- why a half cannot be fused ---------------------------------------------------------------------------
def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and not t.is_cuda and t.is_contiguous())


def _fits(dtype: torch.dtype, *ts: torch.Tensor) -> bool:
    """Every tensor is a contiguous CPU tensor of `dtype` (the layer's weight dtype)."""
    return all(t.dtype == dtype and not t.is_cuda and t.is_contiguous() for t in ts)


def _no_bias(*linears) -> bool:
    return all(getattr(m, "bias", None) is None for m in linears)


def is_fp8(linear) -> bool:
    """Whether a projection keeps an fp8 checkpoint's weight as stored (Fp8Linear, weight float8_e4m3fn) in a block
    the C takes (K side a multiple of 16)."""
    return isinstance(linear, Fp8Linear) and linear.weight.dtype == FP8 and linear.block[1] % 16 == 0


def _fp8_fits(linear) -> bool:
    """An fp8 projection the fused calls read as stored: contiguous e4m3 weight and float32 scales on the CPU, in a
    block whose K side is whole 16-float vectors."""
    return (is_fp8(linear) and _fits(linear.weight.dtype, linear.weight)
            and _fits(torch.float32, linear.weight_scale_inv))


def attention_unfit(layer: DecoderLayer) -> str | None:
    """Why the layer's attention half (input norm, MLA, residual, post-attention norm) cannot be one
    cpu/fused.py mla_layer call, or None."""
    a: MLA = layer.self_attn
    if a.backend != "cpu":
        return f"attention backend {a.backend!r}"
    if a.kv_fp8 is not None:
        return f"an {a.kv_fp8.name.split('_')[0]} latent cache"
    if isinstance(a, SparseMLA):
        return "sparse attention (DSA)"
    if layer.input_layernorm.kernel is None or layer.post_attention_layernorm.kernel is None \
            or a.kv_a_layernorm.kernel is None or (a.cfg.q_lora_rank and a.q_a_layernorm.kernel is None):
        return "norms without the C kernel"
    projs = ([a.q_a_proj, a.q_b_proj] if a.cfg.q_lora_rank else [a.q_proj]) + [a.kv_a_proj_with_mqa, a.kv_b_proj,
                                                                                a.o_proj]
    if not _no_bias(*projs):
        return "projection biases"
    if not all(hasattr(p, "weight") for p in projs):
        return "projections without a weight"
    norms = [layer.input_layernorm, layer.post_attention_layernorm, a.kv_a_layernorm]
    norms += [a.q_a_layernorm] if a.cfg.q_lora_rank else []
    dtype = a.kv_b_proj.weight.dtype
    quantised = [p for p in projs if isinstance(p, Fp8Linear)]
    if quantised:   # an fp8 checkpoint kept as stored: the C reads them as they are (Fp8Mat)
        if len(quantised) != len(projs) - 1 or not all(_fp8_fits(p) for p in quantised):
            return ("fp8 projections beside plain ones, or in a block the C does not take (K side a multiple "
                    "of 16)")
        projs = [a.kv_b_proj]
    if dtype not in WEIGHT_DTYPES or not _fits(dtype, *(p.weight for p in projs), *(n.weight for n in norms)):
        return "weights that are not contiguous CPU tensors of one dtype, float32 or bfloat16 (or fp8 blocks)"
    return None


def _fp8_moe_unfit(ex: Experts, shared: list) -> str | None:
    """Why an MoE half with fp8 routed experts or fp8 shared experts cannot be fused, or None."""
    if ex.fp8_block is not None:
        if ex.fp8_block[1] % 16 or not (_fits(ex.w13.dtype, ex.w13, ex.w2)
                                        and _fits(torch.float32, ex.w13_scale_inv, ex.w2_scale_inv)):
            return "fp8 experts in a block the C does not take, or not contiguous CPU tensors"
    elif ex.w13.dtype not in WEIGHT_DTYPES or not _fits(ex.w13.dtype, ex.w13, ex.w2):
        return "expert weights that are not contiguous CPU tensors of one dtype, float32 or bfloat16"
    if any(isinstance(lin, Fp8Linear) for lin in shared):
        if not all(_fp8_fits(lin) for lin in shared):
            return "shared experts partly fp8, or fp8 in a block the C does not take"
    elif shared and not (shared[0].weight.dtype in WEIGHT_DTYPES
                         and _fits(shared[0].weight.dtype, *(lin.weight for lin in shared))):
        return "shared-expert weights that are not contiguous CPU tensors of one dtype, float32 or bfloat16"
    return None


def moe_unfit(m: MoELayer) -> str | None:
    """Why an MoE layer's half (router, routed and shared experts, residual) cannot be one cpu/fused.py moe_layer
    call, or None (then the layer's MoE operations run: not a reason to leave the fused path)."""
    ex, sh = m.experts, m.shared_experts
    if ex.backend != "cpu":
        return f"experts backend {ex.backend!r}"
    if m.gate.kernel is None:
        return "a router without the C kernel"
    if ex.num_local != m.cfg.n_routed_experts:
        return f"{ex.num_local} local slots for {m.cfg.n_routed_experts} experts (EP shard or replicas)"
    linears = [sh.gate_proj, sh.up_proj, sh.down_proj] if sh is not None else []
    if not _no_bias(*linears):
        return "shared-expert biases"
    if not (_f32(m.gate.weight) and _f32(m.gate.e_score_correction_bias)):
        return "a router whose weights are not float32 contiguous CPU tensors"
    if ex.fp8_block is not None or any(isinstance(lin, Fp8Linear) for lin in linears):
        return _fp8_moe_unfit(ex, linears)
    if ex.w13.dtype not in WEIGHT_DTYPES or not _fits(ex.w13.dtype, ex.w13, ex.w2, *(lin.weight for lin in linears)):
        return "expert weights that are not contiguous CPU tensors of one dtype, float32 or bfloat16"
    return None


def mlp_unfit(mlp: MLP) -> str | None:
    """Why a dense layer's MLP half cannot be one cpu/fused.py mlp_layer call, or None."""
    lins = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(isinstance(lin, Fp8Linear) for lin in lins):
        if not (_no_bias(*lins) and all(_fp8_fits(lin) for lin in lins)):
            return "fp8 projections with biases, beside plain ones or in a block the C does not take"
        return None
    g = mlp.gate_proj.weight
    if not (_no_bias(*lins) and g.dtype in WEIGHT_DTYPES and _fits(g.dtype, g, mlp.up_proj.weight,
                                                                   mlp.down_proj.weight)):
        return "its projections are not bias-free float32 or bfloat16 CPU weights"
    return None


# -- the structs --------------------------------------------------------------------------------------------
def weight_arg(linear, mats: list) -> tuple[int, int]:
    """(pointer, dtype code) of a projection's weight as the fused structs take it: the tensor's data, or for an
    Fp8Linear the address of an Fp8Mat appended to `mats` (which the caller keeps alive with the struct)."""
    if not isinstance(linear, Fp8Linear):
        return linear.weight.data_ptr(), WDT[linear.weight.dtype]
    s = linear.weight_scale_inv
    mats.append(Fp8Mat(linear.weight.data_ptr(), s.data_ptr(), s.shape[1], linear.block[0], linear.block[1]))
    return ctypes.addressof(mats[-1]), WD_FP8


def mla_layer_weights(in_norm: RMSNorm, post_norm: RMSNorm, mla: MLA) -> MlaWeights:
    """The layer's RMSNorms and its MLA -> the struct mla_layer takes (pointers to the weights, their sizes, eps,
    the softmax scale). The projections q_a/q_b (or q), kv_a and o may be fp8 (Fp8Mat structs)."""
    cfg = mla.cfg
    Q = cfg.q_lora_rank or 0
    mats: list[Fp8Mat] = []
    wqa, _ = weight_arg(mla.q_a_proj, mats) if Q else (None, None)
    wq, pwdt = weight_arg(mla.q_b_proj if Q else mla.q_proj, mats)
    (wkva, _), (wo, _) = weight_arg(mla.kv_a_proj_with_mqa, mats), weight_arg(mla.o_proj, mats)
    w = MlaWeights(
        in_norm.weight.data_ptr(), post_norm.weight.data_ptr(), wqa,
        mla.q_a_layernorm.weight.data_ptr() if Q else None, wq, wkva,
        mla.kv_a_layernorm.weight.data_ptr(), mla.kv_b_proj.weight.data_ptr(), wo,
        in_norm.eps, post_norm.eps, mla.q_a_layernorm.eps if Q else 0.0, mla.kv_a_layernorm.eps, cfg.softmax_scale,
        in_norm.weight.shape[0], Q, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
        cfg.v_head_dim, int(mla.rope.cfg.interleave), WDT[mla.kv_b_proj.weight.dtype], pwdt)
    w.fp8_mats = mats
    return w


def moe_layer_weights(gate: Gate, w13: torch.Tensor, w2: torch.Tensor, shared: MLP | None,
                      scales=None) -> MoeWeights:
    """The router, w13 [E, 2I, H], w2 [E, H, I] with every expert local (float32 or bfloat16, or float8_e4m3fn with
    scales = (w13_scale_inv, w2_scale_inv, block) as moe/experts.py keeps them), the shared experts (or None;
    float32, bfloat16 or fp8 projections) -> the struct moe_layer takes."""
    cfg, bias = gate.cfg, gate.e_score_correction_bias
    E, I2, H = w13.shape
    mats: list[Fp8Mat] = []
    sw, sdt = (None, None, None), 0
    if shared is not None:
        (sg, sdt), (su, _), (sd, _) = (weight_arg(m, mats) for m in (shared.gate_proj, shared.up_proj,
                                                                     shared.down_proj))
        sw = (sg, su, sd)
    fp8 = w13.dtype == FP8
    s13, s2, (br, bk) = (scales[0].data_ptr(), scales[1].data_ptr(), scales[2]) if fp8 else (None, None, (0, 0))
    w = MoeWeights(gate.weight.data_ptr(), None if bias is None else bias.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                   *sw, cfg.routed_scaling_factor, H, E, I2 // 2,
                   shared.gate_proj.weight.shape[0] if shared is not None else 0, cfg.top_k, cfg.n_group,
                   cfg.topk_group, int(cfg.scoring_func == "sigmoid"), ROUTE_METHODS[cfg.topk_method],
                   int(cfg.norm_topk_prob), WD_FP8 if fp8 else WDT[w13.dtype], s13, s2, br, bk, sdt)
    w.fp8_mats = mats
    return w


def mlp_layer_weights(mlp: MLP) -> MlpWeights:
    """A dense layer's MLP (float32, bfloat16 or fp8 projections) -> the struct mlp_layer and decode_stack take."""
    mats: list[Fp8Mat] = []
    (sg, wdt), (su, _), (sd, _) = (weight_arg(m, mats) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    g = mlp.gate_proj.weight
    w = MlpWeights(sg, su, sd, g.shape[1], g.shape[0], wdt)
    w.fp8_mats = mats
    return w
