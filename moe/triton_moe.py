"""Triton fused MoE: gate_up GEMM + SiLU·mul, down GEMM + routing weight, sum over top-k.

Legend: R rows, k top-k, P = R*k pairs, H hidden, I moe_intermediate_size, El local experts,
Mmax rows of the aligned layout (moe/align.py). Weights: w13 [El, 2I, H] (gate rows then up rows),
w2 [El, H, I], in the activation dtype, or float8_e4m3fn with block scales
(w13_scale [El, 2*ceil(I/qn), ceil(H/qk)]: gate's scale rows then up's; w2_scale [El, ceil(H/qn), ceil(I/qk)])
that the kernels apply per K tile, so no dequantised copy of the weights ever exists.
Every kernel sits above its launcher; only launchers are public. Reference: Experts.forward_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from wideep.parallel.device import triton_interpreting

from .align import Alignment, align_by_expert
from .fp8 import FP8_DTYPE
from .tiles import MoETiles, pick_tiles

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _precision(dtype: torch.dtype):
    return "ieee" if dtype == torch.float32 else None  # fp32 must not silently become tf32


def _upcast(dtype: torch.dtype) -> bool:
    # Triton 3.8's interpreter multiplies bf16 tl.dot operands as raw 16-bit integers; fp32 is exact there
    return triton_interpreting() and dtype == torch.bfloat16


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _block_coords(Mmax, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share each column sweep, so weight tiles stay in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(Mmax, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, act_ptr, sorted_ptr, bexp_ptr, npad_ptr,
                    num_pairs, top_k, Mmax, I, K, up_scale_row,
                    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
                    FP8: tl.constexpr, QN: tl.constexpr, QK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _block_coords(Mmax, I, BM, BN, GROUP_M)
    if pid_m * BM >= tl.load(npad_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < I
    kk = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + kk[None, :]
    g_ptrs = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None]   # [BK, BN] = W^T tile
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = kk < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            s_base = s_ptr + e * stride_se + k0 // QK
            sg = tl.load(s_base + (n // QN) * stride_sn, mask=n_ok, other=0.0)
            su = tl.load(s_base + (n // QN + up_scale_row) * stride_sn, mask=n_ok, other=0.0)
            bg = (bg.to(tl.float32) * sg[None, :]).to(a.dtype)
            bu = (bu.to(tl.float32) * su[None, :]).to(a.dtype)
        acc_g = _dot(a, bg, acc_g, PREC, UPCAST)
        acc_u = _dot(a, bu, acc_u, PREC, UPCAST)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_am + n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :])


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, align: Alignment, top_k: int, tiles: MoETiles,
                w13_scale: torch.Tensor | None = None, quant_block: tuple[int, int] = (128, 128),
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, H], w13 [El, 2I, H] -> act [Mmax, I] = silu(x w_gate^T) * (x w_up^T), rows in aligned order
    (rows >= num_padded are left unwritten)."""
    _check(x.dim() == 2 and x.is_contiguous(), f"x must be a contiguous [R, H] tensor, got {tuple(x.shape)} "
                                                f"contiguous={x.is_contiguous()}")
    _check(x.dtype in ACT_DTYPES, f"x dtype {x.dtype} is not one of {ACT_DTYPES}")
    R, H = x.shape
    _check(w13.dim() == 3 and w13.shape[2] == H and w13.shape[1] % 2 == 0 and w13.is_contiguous(),
           f"w13 must be a contiguous [El, 2I, H={H}] tensor, got {tuple(w13.shape)} contiguous={w13.is_contiguous()}")
    El, I = w13.shape[0], w13.shape[1] // 2
    fp8 = _check_weight(w13, w13_scale, x, (El, 2 * -(-I // quant_block[0]), -(-H // quant_block[1])), "w13")
    _check(tiles.block_m == align.block_m, f"tiles.block_m ({tiles.block_m}) != alignment block ({align.block_m})")
    _check(align.sorted_pairs.numel() % tiles.block_m == 0 and align.sorted_pairs.device == x.device,
           f"alignment of {align.sorted_pairs.numel()} rows on {align.sorted_pairs.device} does not fit "
           f"block_m {tiles.block_m} on {x.device}")
    if fp8:
        _check(quant_block[1] % tiles.block_k == 0, f"block_k ({tiles.block_k}) must divide the fp8 block "
                                                    f"along H ({quant_block[1]})")
    Mmax = align.max_rows
    out = _out(out, (Mmax, I), x.dtype, x.device, "act")
    s = w13_scale if fp8 else w13  # a placeholder pointer when not fp8: never read
    bn = max(16, tiles.block_n // 2)  # two accumulators (gate, up): half the width keeps registers in budget
    grid = (triton.cdiv(Mmax, tiles.block_m) * triton.cdiv(I, bn),)
    _gate_up_kernel[grid](x, w13, s, out, align.sorted_pairs, align.block_expert, align.num_padded,
                          R * top_k, top_k, Mmax, I, H, -(-I // quant_block[0]),
                          x.stride(0), w13.stride(0), w13.stride(1),
                          s.stride(0) if fp8 else 0, s.stride(1) if fp8 else 0, out.stride(0),
                          FP8=fp8, QN=quant_block[0], QK=quant_block[1], PREC=_precision(x.dtype),
                          UPCAST=_upcast(x.dtype), BM=tiles.block_m, BN=bn, BK=tiles.block_k, GROUP_M=tiles.group_m,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


@triton.jit
def _down_kernel(a_ptr, w_ptr, s_ptr, y_ptr, tw_ptr, sorted_ptr, bexp_ptr, npad_ptr,
                 num_pairs, Mmax, N, K,
                 stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                 FP8: tl.constexpr, QN: tl.constexpr, QK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _block_coords(Mmax, N, BM, BN, GROUP_M)
    if pid_m * BM >= tl.load(npad_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    kk = tl.arange(0, BK)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :]
    b_ptrs = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = kk < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            sb = tl.load(s_ptr + e * stride_se + (n // QN) * stride_sn + k0 // QK, mask=n_ok, other=0.0)
            b = (b.to(tl.float32) * sb[None, :]).to(a.dtype)
        acc = _dot(a, b, acc, PREC, UPCAST)
        a_ptrs += BK
        b_ptrs += BK
    w = tl.load(tw_ptr + pair, mask=valid, other=0.0)
    acc = acc * w[:, None]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * stride_ym + n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def moe_down(act: torch.Tensor, w2: torch.Tensor, align: Alignment, topk_weights: torch.Tensor, tiles: MoETiles,
             w2_scale: torch.Tensor | None = None, quant_block: tuple[int, int] = (128, 128),
             out: torch.Tensor | None = None) -> torch.Tensor:
    """act [Mmax, I] (aligned order), w2 [El, H, I], topk_weights [R, k] -> y [P, H]: pair p's expert
    output times its routing weight (rows of pairs whose expert is not local are left unwritten)."""
    _check(act.dim() == 2 and act.is_contiguous() and act.dtype in ACT_DTYPES,
           f"act must be a contiguous [Mmax, I] tensor in {ACT_DTYPES}, got {tuple(act.shape)} {act.dtype}")
    Mmax, I = act.shape
    _check(Mmax == align.max_rows, f"act has {Mmax} rows, the alignment {align.max_rows}")
    _check(w2.dim() == 3 and w2.shape[2] == I and w2.is_contiguous(),
           f"w2 must be a contiguous [El, H, I={I}] tensor, got {tuple(w2.shape)} contiguous={w2.is_contiguous()}")
    El, H = w2.shape[0], w2.shape[1]
    fp8 = _check_weight(w2, w2_scale, act, (El, -(-H // quant_block[0]), -(-I // quant_block[1])), "w2")
    _check(topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32,
           f"topk_weights must be a contiguous fp32 [R, k] tensor, got {tuple(topk_weights.shape)} "
           f"{topk_weights.dtype}")
    if fp8:
        _check(quant_block[1] % tiles.block_k == 0, f"block_k ({tiles.block_k}) must divide the fp8 block "
                                                    f"along I ({quant_block[1]})")
    P = topk_weights.numel()
    out = _out(out, (P, H), act.dtype, act.device, "y")
    s = w2_scale if fp8 else w2
    grid = (triton.cdiv(Mmax, tiles.block_m) * triton.cdiv(H, tiles.block_n),)
    _down_kernel[grid](act, w2, s, out, topk_weights, align.sorted_pairs, align.block_expert, align.num_padded,
                       P, Mmax, H, I, act.stride(0), w2.stride(0), w2.stride(1),
                       s.stride(0) if fp8 else 0, s.stride(1) if fp8 else 0, out.stride(0),
                       FP8=fp8, QN=quant_block[0], QK=quant_block[1], PREC=_precision(act.dtype),
                       UPCAST=_upcast(act.dtype),
                       BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m,
                       num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


@triton.jit
def _sum_kernel(y_ptr, ids_ptr, out_ptr, H, TOP_K: tl.constexpr, BH: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = h < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + r * TOP_K + j)
        # A branch, not `mask=h_ok & (e >= 0)`: the interpreter broadcasts a scalar comparison to int32 data,
        # which Triton 3.9's interpreted load rejects as a mask; on the GPU the branch is uniform per program
        # and skips the read of a slot that is not local.
        if e >= 0:
            acc += tl.load(y_ptr + (r * TOP_K + j) * H + h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def moe_sum(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [P, H], topk_ids [R, k] -> [R, H]: sum over each row's local slots (fp32 accumulation)."""
    _check(topk_ids.dim() == 2 and topk_ids.is_contiguous(), f"topk_ids must be a contiguous [R, k] tensor, "
                                                             f"got {tuple(topk_ids.shape)}")
    R, k = topk_ids.shape
    _check(y.dim() == 2 and y.shape[0] == R * k and y.is_contiguous(),
           f"y must be a contiguous [R*k={R * k}, H] tensor, got {tuple(y.shape)}")
    H = y.shape[1]
    out = _out(out, (R, H), y.dtype, y.device, "out")
    if R:
        BH = min(1024, triton.next_power_of_2(H))
        _sum_kernel[(R, triton.cdiv(H, BH))](y, topk_ids, out, H, TOP_K=k, BH=BH)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, quant_block: tuple[int, int] = (128, 128),
              tiles: MoETiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, H], topk_ids [R, k] local ids (-1: not here), topk_weights [R, k] -> [R, H]
    = sum over local slots of weight * w2 (silu(w_gate x) * w_up x). Same contract as Experts.forward."""
    _check(topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
           f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
           f"[R={x.shape[0]}, k]")
    _check(not topk_ids.is_floating_point(), f"topk_ids must be integer, got {topk_ids.dtype}")
    R, k = topk_ids.shape
    El = w13.shape[0]
    if tiles is None:
        tiles = pick_tiles(R * k, El, interpret=triton_interpreting(),
                           quant_k=quant_block[1] if w13.dtype == FP8_DTYPE else None,
                           fp32=x.dtype == torch.float32)
    ids = topk_ids.to(torch.int32).contiguous()
    align = align_by_expert(ids, El, tiles.block_m)
    act = moe_gate_up(x, w13, align, k, tiles, w13_scale, quant_block)
    y = moe_down(act, w2, align, topk_weights.float().contiguous(), tiles, w2_scale, quant_block)
    return moe_sum(y, ids, out)


def _check_weight(w: torch.Tensor, scale: torch.Tensor | None, act: torch.Tensor,
                  scale_shape: tuple[int, ...], name: str) -> bool:
    """-> whether w is fp8 (then `scale` must be its fp32 block scales of `scale_shape`)."""
    act_dtype = act.dtype
    _check(w.device == act.device, f"{name} is on {w.device}, the activations on {act.device}")
    if w.dtype == FP8_DTYPE:
        _check(scale is not None, f"{name} is float8_e4m3fn but no {name}_scale was given")
        _check(tuple(scale.shape) == scale_shape and scale.dtype == torch.float32 and scale.is_contiguous(),
               f"{name}_scale must be a contiguous fp32 {scale_shape} tensor, got {tuple(scale.shape)} "
               f"{scale.dtype} contiguous={scale.is_contiguous()}")
        _check(scale.device == w.device, f"{name}_scale is on {scale.device}, {name} on {w.device}")
        return True
    _check(w.dtype == act_dtype, f"{name} dtype {w.dtype} != activation dtype {act_dtype} (or float8_e4m3fn)")
    _check(scale is None, f"{name}_scale given but {name} is {w.dtype}, not float8_e4m3fn")
    return False


def _out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
         name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _check(tuple(out.shape) == shape and out.dtype == dtype and out.device == device and out.is_contiguous(),
           f"{name} buffer must be a contiguous {shape} {dtype} tensor on {device}, got {tuple(out.shape)} "
           f"{out.dtype} on {out.device} contiguous={out.is_contiguous()}")
    return out
