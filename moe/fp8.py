"""FP8 (e4m3) block quantisation as DeepSeek-V3 checkpoints store it.

A weight W [rows, cols] is stored as q = float8_e4m3fn(W / s) with one fp32 `weight_scale_inv`
s per (block_rows x block_cols) tile: scale_inv [ceil(rows/br), ceil(cols/bc)]. Edge tiles may be
partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows = 4.5 tiles of 128).
With a kernel backend (the CPU's C kernels, Triton, DeepGEMM) the routed experts and the projections stay
fp8 and the kernels apply the scales per tile (quantize_experts_fp8 layout; on CPU cpu/csrc/gemm_fp8.c); the
torch backend, or quantization "none" (engine/model/build.py), dequantises at load.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                       scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (q [rows, cols] float8_e4m3fn, scale_inv [ceil(rows/br), ceil(cols/bc)] fp32): each tile's
    scale its absolute maximum / 448 (at least 1e-12 / 448), q = w / scale clamped to +-448, rounded to e4m3.
    scratch: w is a float32 tensor the caller gives up (its values are overwritten): no copy of it is made."""
    br, bc = _check_block(block)
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    if rows % br or cols % bc:   # partial edge tiles: zeros around them (they change no tile's maximum)
        padded = w.new_zeros(nr * br, nc * bc, dtype=torch.float32)
        padded[:rows, :cols] = w
    elif scratch and w.dtype == torch.float32 and w.is_contiguous():
        padded = w
    else:
        padded = w.to(torch.float32, copy=True).contiguous()
    tiles = padded.view(nr, br, nc, bc)
    # max |x| = max(max x, -min x): two reads, no |x| written
    amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg_()).clamp_(min=1e-12)  # [nr, nc]
    scale_inv = amax / FP8_MAX
    q = tiles.div_(scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nr * br, nc * bc)
    return (q if q.shape == (rows, cols) else q[:rows, :cols].contiguous()), scale_inv.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [rows, cols] fp8 + scale_inv [ceil(rows/br), ceil(cols/bc)] -> W [rows, cols] in `dtype`."""
    br, bc = _check_block(block)
    rows, cols = q.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} "
                         f"for a {rows}x{cols} weight in {br}x{bc} blocks")
    s = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (q.float() * s).to(dtype)


def quantize_experts_fp8(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """Stacked expert weights -> the layout the fp8 kernels read, gate and up quantised separately
    (as checkpoints store them): w13 [El, 2I, H] -> q [El, 2I, H], scale [El, 2*ceil(I/br), ceil(H/bc)];
    w2 [El, H, I] -> q [El, H, I], scale [El, ceil(H/br), ceil(I/bc)]."""
    I = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (qg, sg), (qu, su) = quantize_fp8_block(w13[e, :I], block), quantize_fp8_block(w13[e, I:], block)
        q13.append(torch.cat((qg, qu)))
        s13.append(torch.cat((sg, su)))
        q, s = quantize_fp8_block(w2[e], block)
        q2.append(q)
        s2.append(s)
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def dequantize_experts_fp8(q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor,
                           block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32):
    """Inverse of quantize_experts_fp8 (the reference the fp8 kernels are tested against)."""
    I, half = q13.shape[1] // 2, s13.shape[1] // 2
    w13 = torch.stack([torch.cat((dequantize_fp8_block(q[:I], s[:half], block, dtype),
                                  dequantize_fp8_block(q[I:], s[half:], block, dtype))) for q, s in zip(q13, s13)])
    w2 = torch.stack([dequantize_fp8_block(q, s, block, dtype) for q, s in zip(q2, s2)])
    return w13, w2


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation quantisation as DeepSeek-V3 does it (1 x group tiles): x [M, K] ->
    q [M, K] float8_e4m3fn, scale [M, ceil(K/group)] fp32 with x ~= q * scale per group."""
    if x.dim() != 2:
        raise ValueError(f"per-token-group quantisation takes [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    G = -(-K // group)
    padded = x.new_zeros(M, G * group, dtype=torch.float32)
    padded[:, :K] = x.float()
    tiles = padded.view(M, G, group)
    scale = tiles.abs().amax(-1).clamp(min=1e-10) / FP8_MAX                 # [M, G]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, G * group)[:, :K].contiguous(), scale
