"""Triton W8A16 linear: y = x W^T with W stored float8_e4m3fn in block-scaled tiles (DeepSeek-V3's
fp8 checkpoints), dequantised per K tile in registers, so no high-precision copy of W exists.

Legend: M rows, K in_features, N out_features; W [N, K] fp8, scale_inv [ceil(N/qn), ceil(K/qk)] fp32.
Reference: F.linear(x, moe.fp8.dequantize_fp8_block(W, scale_inv)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from wideep.parallel.device import triton_interpreting

from .fp8 import FP8_DTYPE
from .tiles import MoETiles, pick_tiles
from .triton_moe import ACT_DTYPES, _block_coords, _check, _dot, _out, _precision, _upcast


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       QN: tl.constexpr, QK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _block_coords(M, N, BM, BN, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    r_ok = rows < M
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    kk = tl.arange(0, BK)
    a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :]
    b_ptrs = w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None]               # [BK, BN] = W^T tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = kk < K - k0
        a = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.load(s_ptr + (n // QN) * stride_sn + k0 // QK, mask=n_ok, other=0.0)
        acc = _dot(a, (b.to(tl.float32) * s[None, :]).to(a.dtype), acc, PREC, UPCAST)
        a_ptrs += BK
        b_ptrs += BK
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
               tiles: MoETiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, contiguous), weight [N, K] fp8, scale_inv [ceil(N/qn), ceil(K/qk)] -> [M, N]."""
    _check(x.dim() == 2 and x.is_contiguous() and x.dtype in ACT_DTYPES,
           f"x must be a contiguous [M, K] tensor in {ACT_DTYPES}, got {tuple(x.shape)} {x.dtype} "
           f"contiguous={x.is_contiguous()}")
    M, K = x.shape
    _check(weight.dim() == 2 and weight.shape[1] == K and weight.dtype == FP8_DTYPE and weight.is_contiguous(),
           f"weight must be a contiguous float8_e4m3fn [N, K={K}] tensor, got {tuple(weight.shape)} {weight.dtype}")
    N = weight.shape[0]
    want = (-(-N // block[0]), -(-K // block[1]))
    _check(tuple(scale_inv.shape) == want and scale_inv.dtype == torch.float32 and scale_inv.is_contiguous(),
           f"scale_inv must be a contiguous fp32 {want} tensor for a {N}x{K} weight in {block[0]}x{block[1]} "
           f"blocks, got {tuple(scale_inv.shape)} {scale_inv.dtype}")
    _check(len({x.device, weight.device, scale_inv.device}) == 1,
           f"x ({x.device}), weight ({weight.device}) and scale_inv ({scale_inv.device}) must share a device")
    tiles = tiles or pick_tiles(M, 1, interpret=triton_interpreting(), quant_k=block[1], fp32=x.dtype == torch.float32)
    _check(block[1] % tiles.block_k == 0, f"block_k ({tiles.block_k}) must divide the fp8 block along K ({block[1]})")
    out = _out(out, (M, N), x.dtype, x.device, "out")
    if M:
        grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
        _fp8_linear_kernel[grid](x, weight, scale_inv, out, M, N, K, x.stride(0), weight.stride(0),
                                 scale_inv.stride(0), out.stride(0), QN=block[0], QK=block[1],
                                 PREC=_precision(x.dtype), UPCAST=_upcast(x.dtype), BM=tiles.block_m,
                                 BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m,
                                 num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
