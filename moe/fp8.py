"""FP8 (e4m3) block quantisation as DeepSeek-V3 checkpoints store it.

A weight W [rows, cols] is stored as q = float8_e4m3fn(W / s) with one fp32 `weight_scale_inv`
s per (block_rows x block_cols) tile: scale_inv [ceil(rows/br), ceil(cols/bc)]. Edge tiles may be
partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows = 4.5 tiles of 128).
On CPU FP8 is a storage format only: dequantise at load.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (q [rows, cols] float8_e4m3fn, scale_inv [ceil(rows/br), ceil(cols/bc)] fp32)."""
    br, bc = _check_block(block)
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = w.new_zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(nr, br, nc, bc)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nr, nc]
    scale_inv = amax / FP8_MAX
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale_inv.contiguous()


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
