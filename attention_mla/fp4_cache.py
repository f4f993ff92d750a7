"""FP4 (e2m1) latent KV cache, NVFP4-style: the packed row layout, its quantiser and dequantiser.

Legend: T tokens, C kv_lora_rank (a multiple of 16), R rope dim, G = C / 16 scale groups, W bytes per row.
With kv_cache_dtype "fp4" each layer's pool is uint8 [S, W], one row per token, like the fp8 cache's
(attention_mla/fp8_cache.py, whose reasons for one packed row hold here too):

    bytes [0, C/2)                 the no-RoPE latent c as e2m1 codes, two a byte: value 2i in the low
                                   nibble, 2i+1 in the high one (code = sign << 3 | magnitude index into
                                   E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6})
    bytes [scale_offset, +G)       one e4m3 scale per 16 values of c, relative to the token scale
    bytes [token_offset, +4)       the token's float32 scale
    bytes [rope_offset, +R*e)      the rotated k_pe, unquantised, in the model dtype (e bytes each)
    (padding to a multiple of 4 bytes before the token scale and at the end)

A value reads back as E2M1[code] * (e4m3(scale byte) * token scale), both products in float32 in that
order, here and in both kernels (so the C kernel matches this dequantiser bit for bit).

Why NVFP4-style (16 values per e4m3 scale, a second-level float32 scale) and not MXFP4 (32 values per
power-of-two e8m0 scale): e2m1 has 3 bits of magnitude, and a power-of-two scale wastes up to half of the
range of a group whose amax is not near a power of two, while an e4m3 scale puts every group's amax within
2^-4 of 6. On RMS-normed latents with log-normal channel gains NVFP4-style reconstructs with 0.089
relative RMS error against MXFP4's 0.149 (and 1/2.8 of its softmax KL) for 20 more bytes per token per
layer (DeepSeek-V3: 420 against 400). NVFP4's second scale is per tensor, calibrated offline; a cache
written token by token has no tensor amax to calibrate, so it is per token here: amax of the group scales
/ 448, which puts the largest group scale at e4m3's largest value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # the magnitudes of codes 0..7
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GROUP = 16
# the midpoints between neighbouring magnitudes; a tie goes to the even code (round to nearest even):
# at an even-indexed midpoint the lower code is even (ties stay below), at an odd one the upper code is
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """x (any shape, float) -> e2m1 codes uint8 (same shape): round to nearest even, magnitudes past 6
    saturate to 6, and a value that rounds to 0 is +0 (no negative-zero code is ever written)."""
    mag = x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for k, m in enumerate(_MIDPOINTS):
        code += (mag > m if k % 2 == 0 else mag >= m).to(torch.uint8)
    return code | (((x < 0) & (code > 0)).to(torch.uint8) << 3)


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """codes uint8 (any shape, low 4 bits) -> their values float32."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=code.device)
    return table[(code & 15).long()]


def _align4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class Fp4Latent:
    """The packed row of one token: kv_lora_rank C, rope_dim R, rope_dtype (the model dtype)."""
    kv_lora_rank: int
    rope_dim: int
    rope_dtype: torch.dtype = torch.float32
    name = "fp4_e2m1"      # the canonical kv_cache_dtype (LatentKVPool.kv_cache_dtype)
    group = GROUP

    def __post_init__(self):
        if self.kv_lora_rank < GROUP or self.kv_lora_rank % GROUP or self.rope_dim < 0:
            raise ValueError(f"kv_cache_dtype fp4 needs kv_lora_rank a positive multiple of {GROUP} (one e4m3 scale "
                             f"per {GROUP} values) and rope_dim >= 0, got {self.kv_lora_rank}, {self.rope_dim}")

    @property
    def num_groups(self) -> int:
        return self.kv_lora_rank // GROUP

    @property
    def scale_offset(self) -> int:
        return self.kv_lora_rank // 2

    @property
    def token_offset(self) -> int:
        return _align4(self.scale_offset + self.num_groups)

    @property
    def rope_offset(self) -> int:
        return self.token_offset + 4

    @property
    def row_bytes(self) -> int:
        return _align4(self.rope_offset + self.rope_dim * self.rope_dtype.itemsize)

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [T, C+R] -> packed rows uint8 [T, W]. Group scale amax / 6, token scale = the largest group
        scale / 448 (1 for an all-zero token); a group whose relative scale rounds to 0 in e4m3 (amax below
        ~2^-18 of the token's largest) reads back as zeros."""
        C, R, G = self.kv_lora_rank, self.rope_dim, self.num_groups
        T = latent.shape[0]
        if latent.shape != (T, C + R):
            raise ValueError(f"Fp4Latent.quantize: latent must be [T, {C + R}], got {tuple(latent.shape)}")
        c = latent[:, :C].float().view(T, G, GROUP)
        group_scale = c.abs().amax(-1) / E2M1_MAX                                    # [T, G]
        token = group_scale.amax(-1) / E4M3_MAX                                      # [T]
        token = torch.where(token > 0, token, torch.ones_like(token))
        s8 = (group_scale / token[:, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scale = s8.float() * token[:, None]                                          # [T, G] as read back
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.where(scale[..., None] > 0, e2m1_codes(c / safe[..., None]), 0).view(T, C)
        out = torch.zeros(T, self.row_bytes, dtype=torch.uint8, device=latent.device)
        out[:, :C // 2] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        out[:, self.scale_offset:self.scale_offset + G] = s8.view(torch.uint8)
        out[:, self.token_offset:self.rope_offset] = token.view(T, 1).view(torch.uint8)
        rope = latent[:, C:].to(self.rope_dtype).contiguous().view(torch.uint8)      # [T, R*e]
        out[:, self.rope_offset:self.rope_offset + rope.shape[1]] = rope
        return out

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """rows uint8 [..., W] -> latents [..., C+R] in `dtype` (default: rope_dtype)."""
        C, R, G, W = self.kv_lora_rank, self.rope_dim, self.num_groups, self.row_bytes
        if rows.dtype != torch.uint8 or rows.shape[-1] != W:
            raise ValueError(f"Fp4Latent.dequantize: rows must be uint8 [..., {W}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        dtype = dtype or self.rope_dtype
        lead = rows.shape[:-1]
        rows = rows.reshape(-1, W)
        packed = rows[:, :C // 2]
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(-1, G, GROUP)     # [n, G, 16]
        token = rows[:, self.token_offset:self.rope_offset].contiguous().view(torch.float32)        # [n, 1]
        s8 = rows[:, self.scale_offset:self.scale_offset + G].contiguous().view(torch.float8_e4m3fn)
        scale = s8.float() * token                                                      # [n, G]
        c = e2m1_values(codes) * scale[..., None]
        rope = rows[:, self.rope_offset:self.rope_offset + R * self.rope_dtype.itemsize]
        rope = rope.contiguous().view(self.rope_dtype)
        return torch.cat((c.view(-1, C).to(dtype), rope.to(dtype)), dim=-1).view(*lead, C + R)

    def write(self, pool: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """pool uint8 [S, W]; latent [T, C+R] quantised into rows slots [T]."""
        pool.index_copy_(0, slots, self.quantize(latent))
