"""FP4 (e2m1) weights as DeepSeek-V4 checkpoints store their routed experts, and e8m0 (ue8m0) scales.

A weight W [rows, cols] is stored as int8/uint8 [rows, cols/2]: two e2m1 codes per byte, column 2j in the low
nibble and 2j+1 in the high one; with one power-of-two scale per 1 x 32 block, scale [rows, cols/32], stored
as float8_e8m0fnu (or its raw byte b: 2^(b-127)). W = e2m1(code) * scale. On the torch backends FP4 is a storage
format only: dequantised at load.
"""
from __future__ import annotations

import torch

# e2m1: sign, 2 exponent bits, 1 mantissa bit -> these 16 values by code
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCK = 32
PACKED_DTYPES = (torch.int8, torch.uint8)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A block-scale tensor as fp32: float8_e8m0fnu as is, raw e8m0 bytes (uint8) as 2^(b-127), floats as floats."""
    if scale.dtype == torch.uint8:
        return (scale.float() - 127.0).exp2()
    return scale.float()


def scale_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """A block-scale tensor as its raw e8m0 bytes (uint8, b for 2^(b-127)), what the CPU kernels read: float8_e8m0fnu
    and uint8 as stored; floats must be powers of two in [2^-127, 2^127] (anything else has no e8m0 byte)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    f = scale.float()
    m, e = torch.frexp(f)                                      # f = m * 2^e, m in [0.5, 1)
    b = e.to(torch.int64) + 126
    bad = (m != 0.5) | (b < 0) | (b > 254)
    if bad.any():
        v = f[bad][0].item()
        raise ValueError(f"an fp4 scale of {v:g} is not a power of two in [2^-127, 2^127]: it has no e8m0 byte")
    return b.to(torch.uint8)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [rows, cols/2] int8/uint8 + scale [rows, cols/32] -> W [rows, cols] in `dtype`."""
    if packed.dtype not in PACKED_DTYPES or packed.dim() != 2:
        raise ValueError(f"an FP4 weight is a 2-D int8/uint8 tensor of packed pairs, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if tuple(scale.shape) != (rows, -(-cols // FP4_BLOCK)):
        raise ValueError(f"an FP4 weight of {rows}x{cols} needs scales [{rows}, {-(-cols // FP4_BLOCK)}] (one per "
                         f"1x{FP4_BLOCK} block), got {tuple(scale.shape)}")
    u8 = packed.view(torch.uint8).long()
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack([lut[u8 & 0xF], lut[u8 >> 4]], dim=-1).view(rows, cols)
    s = scale_to_float(scale).repeat_interleave(FP4_BLOCK, 1)[:, :cols]
    return (values * s).to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes [rows, cols] (0..15, cols even) -> packed [rows, cols/2] uint8, as checkpoints store them."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [rows, cols] (cols a multiple of 32) -> (packed [rows, cols/2] uint8, e8m0 scale bytes [rows, cols/32]):
    per 1x32 block the smallest power-of-two scale that puts the block's largest |value| within e2m1's 6, each
    value its nearest e2m1 code (for benchmarks and tests; checkpoints come quantised)."""
    rows, cols = w.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"quantize_fp4: cols ({cols}) must be a multiple of {FP4_BLOCK}")
    amax = w.float().view(rows, cols // FP4_BLOCK, FP4_BLOCK).abs().amax(-1)
    e = torch.ceil(torch.log2((amax / 6.0).clamp(min=2.0 ** -127))).clamp(-127, 127)
    x = w.float() / torch.exp2(e).repeat_interleave(FP4_BLOCK, 1)
    lut = torch.tensor(E2M1)
    codes = torch.empty(rows, cols, dtype=torch.long)
    for r in range(0, rows, 1024):   # [1024, cols, 16] at a time
        codes[r:r + 1024] = (x[r:r + 1024, :, None] - lut).abs().argmin(-1)
    return pack_fp4(codes), (e + 127).to(torch.uint8)
