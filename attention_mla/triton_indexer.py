"""Triton lightning-indexer scores over the paged indexer-key cache (DSA decode).

Legend: B sequences (one query each), NI indexer heads, Dk indexer head dim, S cache slots, M max blocks
per sequence, L a sequence's length, BN positions per program.
Program (position block, b) reads BN keys of sequence b through its block table (no gather copy) and
writes I[b, j] = sum_h w[b, h] * relu(q[b, h] . key[j] * scale) for its positions, -inf past L[b];
the QK^T product is one [NI, Dk] x [Dk, BN] GEMM. Reference: attention_mla.indexer.Indexer.scores over
the gathered keys. The top-k and the sparse attention then run as in attention_mla/sparse_mla.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from wideep.parallel.device import triton_interpreting

from .triton_decode import _dot, check_tables, need


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, lens_ptr, out_ptr, NI, Dk, block_size, scale,
                         stride_qb, stride_qh, stride_wb, stride_k, stride_bt, stride_ob, max_len,
                         BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                         PREC: tl.constexpr, UPCAST: tl.constexpr):
    nb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    L = tl.load(lens_ptr + b)
    j = nb * BN + tl.arange(0, BN)
    j_ok = j < L
    h = tl.arange(0, BH)
    h_ok = h < NI
    d = tl.arange(0, BD)
    d_ok = d < Dk
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)                               # [BH, BD]
    w = tl.load(w_ptr + b * stride_wb + h, mask=h_ok, other=0.0)                            # [BH] fp32
    blk = tl.load(bt_ptr + b * stride_bt + j // block_size, mask=j_ok, other=0)
    slot = (blk * block_size + j % block_size).to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * stride_k + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
    s = _dot(q, tl.trans(k), tl.zeros((BH, BN), dtype=tl.float32), PREC, UPCAST) * scale   # [BH, BN]
    score = tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)                                      # [BN]
    tl.store(out_ptr + b * stride_ob + j, tl.where(j_ok, score, float("-inf")), mask=j < max_len)


def index_scores_paged(q: torch.Tensor, w: torch.Tensor, index_pool: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int, scale: float, max_len: int,
                       block_n: int = 64) -> torch.Tensor:
    """q [B, NI, Dk] (index_pool's dtype), w [B, NI] fp32, index_pool [S, Dk], block_table [B, M] int,
    seq_lens [B] int32 (>= 1) -> scores [B, max_len] fp32, -inf at positions >= seq_lens[b].
    max_len: a host bound on seq_lens (sizes the grid, no sync)."""
    need(q.dim() == 3 and q.stride(-1) == 1, f"q must be [B, NI, Dk] with unit stride on Dk, got {tuple(q.shape)} "
                                             f"strides {q.stride()}")
    B, NI, Dk = q.shape
    need(index_pool.dim() == 2 and index_pool.shape[1] == Dk and index_pool.stride(1) == 1,
         f"index_pool must be [S, Dk={Dk}] with unit stride, got {tuple(index_pool.shape)} strides {index_pool.stride()}")
    need(q.dtype == index_pool.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16),
         f"q ({q.dtype}) and index_pool ({index_pool.dtype}) must share one of fp32/bf16/fp16")
    need(w.shape == (B, NI) and w.dtype == torch.float32 and w.stride(-1) == 1,
         f"w must be a float32 [B={B}, NI={NI}] tensor with unit stride, got {tuple(w.shape)} {w.dtype}")
    check_tables(block_table, seq_lens, B, block_size, max_len, "max_len")
    need(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}")
    devices = {t.device for t in (q, w, index_pool, block_table, seq_lens)}
    need(len(devices) == 1, f"inputs are on different devices: {sorted(map(str, devices))}")
    out = torch.empty(B, max_len, dtype=torch.float32, device=q.device)
    if B == 0 or max_len == 0:
        return out
    _index_scores_kernel[(triton.cdiv(max_len, block_n), B)](
        q, w, index_pool, block_table, seq_lens, out, NI, Dk, block_size, scale,
        q.stride(0), q.stride(1), w.stride(0), index_pool.stride(0), block_table.stride(0), out.stride(0), max_len,
        BH=max(16, triton.next_power_of_2(NI)), BN=block_n, BD=max(16, triton.next_power_of_2(Dk)),
        PREC="ieee" if q.dtype == torch.float32 else None,
        UPCAST=triton_interpreting() and q.dtype == torch.bfloat16)
    return out
