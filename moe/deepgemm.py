"""DeepGEMM grouped FP8 GEMMs for the routed experts: contiguous layout (prefill), masked (decode).

Legend: R rows, k top-k, P = R*k pairs, H hidden, I moe_intermediate_size, El local experts,
A the contiguous-layout alignment (DeepGEMM's, 128), Mm rows per expert in the masked layout.
DeepGEMM computes out[m] = lhs[m] @ rhs[g]^T with fp8 lhs scaled per 1 x 128 group and fp8 rhs
per 128 x 128 block, bf16 out. Two API generations are found by name, never by version number:
  v1: m_grouped_gemm_fp8_fp8_bf16_nt_contiguous / ..._masked; lhs scales column-major, TMA-aligned
      (get_col_major_tma_aligned_tensor), alignment get_m_alignment_for_contiguous_layout()
  v2: m_grouped_fp8_gemm_nt_contiguous / m_grouped_fp8_gemm_nt_masked; takes row-major fp32
      scales and lays them out itself, alignment get_mk_alignment_for_contiguous_layout(), skips
      rows whose m_index is -1 (so the worst-case-sized layout needs no host sync)
Both take ((lhs, lhs_scale), (rhs, rhs_scale), out, m_indices) and
((lhs, lhs_scale), (rhs, rhs_scale), out, masked_m, expected_m).
Reference: Experts.forward_reference on the dequantised weights (activation quantisation adds ~1e-2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .align import align_by_expert
from .fp8 import quantize_per_token_group

GENERATIONS = {
    "v2": ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
           "get_mk_alignment_for_contiguous_layout"),
    "v1": ("m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
           "get_m_alignment_for_contiguous_layout"),
}
MASKED_MAX_ROWS = 256  # decode batches up to this many rows per rank use the masked layout


@dataclass(frozen=True)
class DeepGemmApi:
    generation: str
    contiguous: Callable[..., Any]
    masked: Callable[..., Any] | None
    alignment: int
    scale_layout: Callable[[torch.Tensor], torch.Tensor] | None  # v1's column-major TMA-aligned copy


def probe(module) -> DeepGemmApi | None:
    """The grouped FP8 GEMMs a deep_gemm module offers, newest generation first; None if neither."""
    for gen, (contig, masked, align_fn) in GENERATIONS.items():
        fn = getattr(module, contig, None)
        if callable(fn):
            get_align = getattr(module, align_fn, None)
            alignment = int(get_align()) if callable(get_align) else 128
            layout = getattr(module, "get_col_major_tma_aligned_tensor", None) if gen == "v1" else None
            return DeepGemmApi(gen, fn, getattr(module, masked, None), alignment, layout)
    return None


def load() -> DeepGemmApi | None:
    """deep_gemm's API when it imports (and has a grouped FP8 GEMM), else None."""
    try:
        import deep_gemm
    except Exception:  # ImportError, or a build that fails on import (no GPU, wrong CUDA)
        return None
    return probe(deep_gemm)


def _quant(api: DeepGemmApi, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] bf16 -> (fp8 [..., K], scales [..., K/128]) in the layout the API generation wants."""
    shape = x.shape
    if x.is_cuda:
        from .triton_quant import per_token_group_quant_fp8
        q, s = per_token_group_quant_fp8(x.reshape(-1, shape[-1]).contiguous())
    else:
        q, s = quantize_per_token_group(x.reshape(-1, shape[-1]))
    q, s = q.view(*shape), s.view(*shape[:-1], s.shape[-1])
    if api.scale_layout is not None:
        s = api.scale_layout(s)
    return q, s


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_contiguous(api: DeepGemmApi, x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                       w2: tuple[torch.Tensor, torch.Tensor], topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
    """x [R, H] bf16, w13 = (fp8 [El, 2I, H], scale), w2 = (fp8 [El, H, I], scale) -> [R, H].
    Pairs are sorted by expert into A-aligned segments (padding rows: m_index -1, zero input)."""
    R, k = topk_ids.shape
    El, I2 = w13[0].shape[:2]
    H = x.shape[1]
    align = align_by_expert(topk_ids, El, api.alignment)
    P, Mmax = R * k, align.max_rows
    m_indices = align.block_expert.repeat_interleave(api.alignment)          # [Mmax] int32, -1 past the end
    pairs = align.sorted_pairs
    if api.generation == "v1":
        # v2 skips m_index -1 rows; v1 would index rhs[-1], so its rows are cut to the used ones
        Mmax = int(align.num_padded)  # SYNC: v1 takes the row count from the tensor shape
        m_indices, pairs = m_indices[:Mmax], pairs[:Mmax]
    valid = pairs < P                                                         # [Mmax]
    src = (pairs.long() // k).clamp(max=max(R - 1, 0))
    lhs = torch.where(valid[:, None], x[src], 0)                              # [Mmax, H]
    h = torch.empty(Mmax, I2, dtype=torch.bfloat16, device=x.device)
    api.contiguous(_quant(api, lhs), w13, h, m_indices)
    y = torch.empty(Mmax, H, dtype=torch.bfloat16, device=x.device)
    api.contiguous(_quant(api, _silu_mul(h)), w2, y, m_indices)
    return _combine(y, valid, pairs.long(), topk_weights, R, k)


def experts_masked(api: DeepGemmApi, x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                   w2: tuple[torch.Tensor, torch.Tensor], topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
    """Same contract as experts_contiguous, in the masked layout [El, Mm, H] (Mm >= R: an expert sees
    a row at most once), with masked_m [El] = pairs per expert; expected_m from host ints, no sync."""
    if api.masked is None:
        raise RuntimeError(f"deep_gemm {api.generation} has no masked grouped GEMM")
    R, k = topk_ids.shape
    El, I2 = w13[0].shape[:2]
    H = x.shape[1]
    Mm = -(-R // 64) * 64
    flat = topk_ids.reshape(-1).long()
    bucket = torch.where(flat >= 0, flat, El)
    order = torch.argsort(bucket, stable=True)                                # [P] pairs by expert
    e = bucket[order]
    counts = torch.bincount(bucket, minlength=El + 1)[:El]
    valid = e < El
    e_safe = e.clamp(max=El - 1)
    within = torch.arange(e.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[e_safe]
    lhs = torch.zeros(El, Mm, H, dtype=torch.bfloat16, device=x.device)
    lhs[e_safe[valid], within[valid]] = x[order[valid] // k]
    masked_m = counts.to(torch.int32)
    expected_m = max(1, -(-R * k // El))
    h = torch.empty(El, Mm, I2, dtype=torch.bfloat16, device=x.device)
    api.masked(_quant(api, lhs), w13, h, masked_m, expected_m)
    y = torch.empty(El, Mm, H, dtype=torch.bfloat16, device=x.device)
    api.masked(_quant(api, _silu_mul(h)), w2, y, masked_m, expected_m)
    rows = y[e_safe, within.clamp(min=0, max=Mm - 1)]                        # [P, H] in sorted order
    return _combine(rows, valid, order, topk_weights, R, k)


def _combine(y: torch.Tensor, valid: torch.Tensor, pair: torch.Tensor, topk_weights: torch.Tensor,
             R: int, k: int) -> torch.Tensor:
    """y [M, H] rows of `pair` (valid where `valid`) -> [R, H] weighted sums (fp32 accumulation)."""
    H = y.shape[1]
    per_pair = torch.zeros(R * k, H, dtype=torch.float32, device=y.device)
    p = pair[valid]
    per_pair[p] = y[valid].float() * topk_weights.reshape(-1)[p, None].float()
    return per_pair.view(R, k, H).sum(1).to(y.dtype)


def experts_forward(api: DeepGemmApi, x: torch.Tensor, w13, w2, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
    """Masked layout for small (decode) batches when the API has it, contiguous otherwise."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"DeepGEMM experts take bf16 activations, got {x.dtype}")
    if api.masked is not None and x.shape[0] <= MASKED_MAX_ROWS:
        return experts_masked(api, x, w13, w2, topk_ids, topk_weights)
    return experts_contiguous(api, x, w13, w2, topk_ids, topk_weights)
