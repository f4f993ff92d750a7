"""Triton paged MLA decode (absorbed form): split-K over the sequence, then a reduction.

Legend: B sequences, N heads, C kv_lora_rank, R rope dim, D = C + R, S cache slots, M max blocks
per sequence, K splits. Stage 1: program (b, head block, split) runs an online softmax over its
slice of the sequence, reading latents through the block table, and writes its normalised partial
output [BH, C] and log-sum-exp. Stage 2: program (b, head) merges the K partials by their LSE.
All heads of a sequence share one latent stream, so a program takes BH heads at once (the QK^T
and PV products are [BH, D] x [D, BN] GEMMs). Reference: attention_mla.paged_decode.paged_decode_reference.
An fp8 cache (attention_mla/fp8_cache.py) is read as packed uint8 rows: the e4m3 bytes and their group's
float32 scale are loaded and dequantised to q's dtype in registers, the RoPE part read as stored; the
dots and the softmax are then the same as over a full-precision cache. An fp4 cache (attention_mla/fp4_cache.py)
likewise: each byte is loaded once and split into its two nibbles (interleaved back in registers), each
decoded to its e2m1 value and multiplied by its group's e4m3 scale times the token's float32 scale (the
dequantiser's order of products).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from wideep.parallel.device import triton_interpreting

from .fp4_cache import Fp4Latent
from .fp8_cache import Fp8Latent

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeTiles:
    """The defaults are the production config (tests/kernels/test_sm90_compile.py compiles them for sm_90).
    Registers bind: at 64 heads x 512 latent dims the fp32 accumulator alone takes 128 of a thread's 255
    at 8 warps. 32 latents per step fit Triton 3.8 (231 registers) but spill under 3.9, whose codegen
    holds the wgmma descriptors of the loop-invariant q in registers; 16 fit both, and a third stage
    keeps 32 latents in flight as 32 x 2 stages did."""
    block_h: int = 64      # heads per program: 64 rows reach Hopper's wgmma; 128 heads read each latent twice
    block_n: int = 16      # latents per inner step
    num_warps: int = 8
    num_stages: int = 3
    min_split_tokens: int = 256  # split-K only when every split gets at least this many latents

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"DecodeTiles.{name} must be a power of two >= 16 (tl.dot), got {v}")
        if self.min_split_tokens < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"DecodeTiles: min_split_tokens ({self.min_split_tokens}), num_warps "
                             f"({self.num_warps}) and num_stages ({self.num_stages}) must be >= 1")


def choose_splits(batch: int, heads: int, max_len: int, tiles: DecodeTiles, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU twice over, never a split shorter than min_split_tokens."""
    programs = batch * triton.cdiv(heads, tiles.block_h)
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    return max(1, min(want, triton.cdiv(max_len, tiles.min_split_tokens), 64))


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton 3.8's interpreter multiplies bf16 dot operands as raw integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, bt_ptr, lens_ptr, part_ptr, lse_ptr,
                         N, C, R, block_size, qk_scale,
                         stride_qb, stride_qh, stride_kv, stride_bt, stride_pb, stride_ph, stride_ps,
                         stride_lb, stride_lh, scale_off, rope_off, tok_off,
                         BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                         PREC: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
                         FP4: tl.constexpr):
    hb = tl.program_id(0)  # fastest-varying: a sequence's head blocks run together and share its latents in L2
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    L = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(L, BN), num_splits) * BN
    start = split * per_split
    end = tl.minimum(start + per_split, L)
    heads = hb * BH + tl.arange(0, BH)
    h_ok = heads < N
    c = tl.arange(0, BC)
    c_ok = c < C
    r = tl.arange(0, BR)
    r_ok = r < R
    q_base = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_base + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)          # [BH, BC]
    q_r = tl.load(q_base + C + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)      # [BH, BR]
    m = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BC), dtype=tl.float32)
    for j0 in range(start, end, BN):
        j = j0 + tl.arange(0, BN)
        j_ok = j < end
        blk = tl.load(bt_ptr + b * stride_bt + j // block_size, mask=j_ok, other=0)
        slot = (blk * block_size + j % block_size).to(tl.int64)
        row = kv_ptr + slot[:, None] * stride_kv           # [BN, 1]: the latents' rows (bytes when FP8)
        kc_ok = j_ok[:, None] & c_ok[None, :]
        kr_ok = j_ok[:, None] & r_ok[None, :]
        if FP4:   # GROUP values per e4m3 scale, relative to the token's float32 scale at tok_off
            cb = tl.arange(0, BC // 2)
            byte = tl.load(row + cb[None, :], mask=j_ok[:, None] & (cb[None, :] * 2 < C), other=0)   # [BN, BC/2]
            nib = tl.reshape(tl.join(byte & 15, byte >> 4), (BN, BC))          # value 2i: low nibble, 2i+1: high
            # twice the magnitude of code m (0..7 -> 0, 1, 2, 3, 4, 6, 8, 12) = m + max(m - 4, 0) + 2 max(m - 6, 0)
            code = (nib & 7).to(tl.int32)
            twice = code + tl.maximum(code - 4, 0) + 2 * tl.maximum(code - 6, 0)
            k4 = (tl.where((nib & 8) != 0, -twice, twice)).to(tl.float32) * 0.5                   # [BN, BC]
            tok = tl.load((row + tok_off).to(tl.pointer_type(tl.float32)), mask=j_ok[:, None], other=0.0)
            g = tl.arange(0, BC // GROUP)
            s8 = tl.load(row + scale_off + g[None, :], mask=j_ok[:, None] & (g[None, :] * GROUP < C), other=0)
            sc = s8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tok                         # [BN, BC/GROUP]
            k_c = tl.reshape(tl.reshape(k4, (BN, BC // GROUP, GROUP)) * sc[:, :, None], (BN, BC)).to(q_c.dtype)
            k_r = tl.load((row + rope_off).to(tl.pointer_type(q_ptr.dtype.element_ty)) + r[None, :], mask=kr_ok,
                          other=0.0)
        elif FP8:   # GROUP 0: one scale per token; else one per GROUP values (a power of two dividing BC)
            k8 = tl.load(row + c[None, :], mask=kc_ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scales = (row + scale_off).to(tl.pointer_type(tl.float32))
            if GROUP == 0:
                k_c = (k8 * tl.load(scales, mask=j_ok[:, None], other=0.0)).to(q_c.dtype)
            else:
                g = tl.arange(0, BC // GROUP)
                sc = tl.load(scales + g[None, :], mask=j_ok[:, None] & (g[None, :] * GROUP < C), other=0.0)
                k_c = tl.reshape(tl.reshape(k8, (BN, BC // GROUP, GROUP)) * sc[:, :, None], (BN, BC)).to(q_c.dtype)
            k_r = tl.load((row + rope_off).to(tl.pointer_type(q_ptr.dtype.element_ty)) + r[None, :], mask=kr_ok,
                          other=0.0)
        else:
            k_c = tl.load(row + c[None, :], mask=kc_ok, other=0.0)
            k_r = tl.load(row + C + r[None, :], mask=kr_ok, other=0.0)
        s = _dot(q_c, tl.trans(k_c), tl.zeros((BH, BN), dtype=tl.float32), PREC, UPCAST)
        s = _dot(q_r, tl.trans(k_r), s, PREC, UPCAST) * qk_scale
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = _dot(p.to(k_c.dtype), k_c, acc * alpha[:, None], PREC, UPCAST)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + c[None, :], out,
             mask=h_ok[:, None] & c_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_ok)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, C, num_splits,
                          stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                          BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, BC)
    c_ok = c < C
    lse_base = lse_ptr + b * stride_lb + h * stride_lh
    m = tl.load(lse_base)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(lse_base + s))
    m = tl.where(m > float("-inf"), m, 0.0)  # every split empty: the weights below are all 0
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BC,), dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(lse_base + s)
        w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
        part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s * stride_ps + c, mask=c_ok, other=0.0)
        acc += tl.where(w > 0, part * w, 0.0)  # an empty split's partial is 0, never read as NaN
        total += w
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + c, out.to(out_ptr.dtype.element_ty), mask=c_ok)


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tables(block_table: torch.Tensor, seq_lens: torch.Tensor, B: int, block_size: int, max_len: int,
                 max_name: str) -> None:
    """The paged kernels' shared checks (this file's and triton_indexer.py's): block_table [B, M] int with
    unit stride, seq_lens [B] int32 contiguous, and M blocks enough for the host bound max_len (named
    max_name in the error)."""
    need(block_table.dim() == 2 and block_table.shape[0] == B and not block_table.is_floating_point()
         and block_table.stride(1) == 1, f"block_table must be an integer [B={B}, M] tensor with unit stride, "
                                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    need(seq_lens.shape == (B,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
         f"seq_lens must be a contiguous int32 [B={B}] tensor, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    need(block_table.shape[1] * block_size >= max_len,
         f"block_table holds {block_table.shape[1]} blocks of {block_size} < {max_name} {max_len}")


def mla_decode(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, kv_lora_rank: int, sm_scale: float, max_seq_len: int,
               num_splits: int | None = None, tiles: DecodeTiles | None = None,
               out: torch.Tensor | None = None, fp8: Fp8Latent | Fp4Latent | None = None) -> torch.Tensor:
    """q [B, N, D], kv_pool [S, D] (same dtype), block_table [B, M] int, seq_lens [B] int32 (>= 1)
    -> [B, N, C] in q's dtype. max_seq_len: a host bound on seq_lens (sizes the split, no sync).
    fp8: the pool's packed layout, fp8 or fp4 (kv_pool uint8 [S, fp8.row_bytes], q in fp8.rope_dtype)."""
    tiles = tiles or DecodeTiles()
    need(q.dim() == 3 and q.stride(-1) == 1, f"q must be [B, N, D] with unit stride on D, got {tuple(q.shape)} "
                                             f"strides {q.stride()}")
    B, N, D = q.shape
    C = kv_lora_rank
    need(0 < C < D, f"kv_lora_rank ({C}) must be in (0, D={D})")
    W, kv_dtype = (D, q.dtype) if fp8 is None else (fp8.row_bytes, torch.uint8)
    need(fp8 is None or (fp8.kv_lora_rank, fp8.rope_dim, fp8.rope_dtype) == (C, D - C, q.dtype),
         f"the {fp8.name if fp8 else ''} layout ({fp8}) does not fit q {tuple(q.shape)} {q.dtype} with kv_lora_rank {C}")
    need(kv_pool.dim() == 2 and kv_pool.shape[1] == W and kv_pool.stride(1) == 1,
         f"kv_pool must be [S, {W}] with unit stride, got {tuple(kv_pool.shape)} strides {kv_pool.stride()}")
    need(kv_pool.dtype == kv_dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16),
         f"q ({q.dtype}) and kv_pool ({kv_pool.dtype}) must share one of fp32/bf16/fp16" if fp8 is None else
         f"an {fp8.name.split('_')[0]} cache's kv_pool must be uint8 (got {kv_pool.dtype}) and q fp32/bf16/fp16 (got {q.dtype})")
    check_tables(block_table, seq_lens, B, block_size, max_seq_len, "max_seq_len")
    devices = {t.device for t in (q, kv_pool, block_table, seq_lens)}
    need(len(devices) == 1, f"q, kv_pool, block_table, seq_lens are on different devices: {sorted(map(str, devices))}")
    if out is None:
        out = torch.empty(B, N, C, dtype=q.dtype, device=q.device)
    need(tuple(out.shape) == (B, N, C) and out.dtype == q.dtype and out.stride(-1) == 1 and out.device == q.device,
         f"out must be a ({B}, {N}, {C}) {q.dtype} tensor on {q.device} with unit stride on C, got "
         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if B == 0:
        return out
    K = num_splits or choose_splits(B, N, max_seq_len, tiles)
    part = torch.empty(B, N, K, C, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, N, K, dtype=torch.float32, device=q.device)
    BC, BR = triton.next_power_of_2(C), triton.next_power_of_2(D - C)
    upcast = triton_interpreting() and q.dtype == torch.bfloat16
    fp4 = isinstance(fp8, Fp4Latent)
    _decode_split_kernel[(triton.cdiv(N, tiles.block_h), B, K)](
        q, kv_pool, block_table, seq_lens, part, lse, N, C, D - C, block_size, sm_scale * LOG2E,  # exp2 domain
        q.stride(0), q.stride(1), kv_pool.stride(0), block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        *((0, 0) if fp8 is None else (fp8.scale_offset, fp8.rope_offset)), getattr(fp8, "token_offset", 0),
        BH=tiles.block_h, BN=tiles.block_n, BC=BC, BR=BR,
        PREC="ieee" if q.dtype == torch.float32 else None, UPCAST=upcast, FP8=isinstance(fp8, Fp8Latent),
        GROUP=fp8.group if fp8 is not None and (fp4 or fp8.num_groups > 1) else 0, FP4=fp4,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _decode_reduce_kernel[(B, N)](part, lse, out, C, K, part.stride(0), part.stride(1), part.stride(2),
                                  lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), BC=BC)
    return out
