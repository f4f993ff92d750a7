"""Triton per-token-group FP8 activation quantisation (DeepGEMM's lhs format).

Legend: M rows, K columns, G = ceil(K / group). Reference: moe.fp8.quantize_per_token_group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from wideep.parallel.device import triton_interpreting

from .fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _round_to_e4m3_grid(x, FMAX: tl.constexpr):
    """Round to the nearest e4m3 value in fp32 (3 mantissa bits; subnormal spacing below 2^-6).
    Triton 3.8's interpreter converts fp32 -> fp8 wrongly when rounding carries into the exponent
    (124.3 -> 64); exact e4m3 values convert correctly, so the interpreter rounds first."""
    ax = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(ax, 1e-30))), -6.0)
    step = tl.exp2(e - 3.0)
    r = tl.minimum(tl.floor(ax / step + 0.5) * step, FMAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qm, stride_sm, stride_sg,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr, PREROUND: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    ok = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + m * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / FMAX
    q = tl.clamp(x / scale, -FMAX, FMAX)
    if PREROUND:
        q = _round_to_e4m3_grid(q, FMAX)
    tl.store(q_ptr + m * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, out_q: torch.Tensor | None = None,
                              out_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/bf16/fp16, contiguous) -> q [M, K] float8_e4m3fn, scale [M, G] fp32.
    `out_scale` may be any [M, G] fp32 view (DeepGEMM's old API wants it column-major)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [M, K] tensor, got {tuple(x.shape)} contiguous={x.is_contiguous()}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x dtype {x.dtype} cannot be quantised (fp32/bf16/fp16)")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    M, K = x.shape
    G = -(-K // group)
    if out_q is None:
        out_q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    if out_scale is None:
        out_scale = torch.empty(M, G, dtype=torch.float32, device=x.device)
    if tuple(out_q.shape) != (M, K) or out_q.dtype != FP8_DTYPE or not out_q.is_contiguous():
        raise ValueError(f"out_q must be a contiguous ({M}, {K}) float8_e4m3fn tensor, got "
                         f"{tuple(out_q.shape)} {out_q.dtype}")
    if tuple(out_scale.shape) != (M, G) or out_scale.dtype != torch.float32:
        raise ValueError(f"out_scale must be a ({M}, {G}) fp32 tensor, got {tuple(out_scale.shape)} {out_scale.dtype}")
    if M and K:
        _group_quant_kernel[(M, G)](x, out_q, out_scale, K, G, x.stride(0), out_q.stride(0),
                                    out_scale.stride(0), out_scale.stride(1),
                                    GROUP=group, BLOCK=triton.next_power_of_2(group), FMAX=FP8_MAX,
                                    PREROUND=triton_interpreting())
    return out_q, out_scale
