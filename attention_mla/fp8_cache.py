"""FP8 (e4m3) latent KV cache: the packed row layout, its quantiser and dequantiser.

Legend: T tokens, C kv_lora_rank, R rope dim, D = C + R, G scale groups, W bytes per packed row.
With kv_cache_dtype "fp8" each layer's pool is uint8 [S, W], one row per token (slot for slot, as the
full-precision pool [S, D]):

    bytes [0, C)                   the no-RoPE latent c, e4m3 (448 = the largest finite e4m3 value)
    bytes [scale_offset, +4G)      one float32 scale per group of `group` values of c (amax / 448)
    bytes [rope_offset, +R*e)      the rotated k_pe, unquantised, in the model dtype (e bytes each)
    (padding to a multiple of 4 bytes between the parts and at the end: every part stays aligned)

Why one packed row and not an e4m3 pool beside a scale pool: everything that moves a token's cached
state copies the rows of `LatentKVPool.layer_pools(layer)` as they are — the prefix cache (it shares
blocks), the tiered store's host and disk tiers (kvstore/) and the disaggregated KV transfer (disagg/)
— so a packed row needs no change in any of them, and one block's bytes stay contiguous. Why the
RoPE part is not quantised: it carries the positional signal of every score and is 1/9 of the
latent; DeepSeek's FlashMLA FP8 cache (V3.2) keeps it unquantised too. Groups: 128 values per scale
when 128 divides C (DeepSeek-V3's C = 512: 4 scales), else one scale per token (the tiny models).

Every read dequantises (the torch forms here, the Triton and C decode kernels in place), and the
tokens a step writes are read back from the cache as well, so a prefix-cache hit, a chunked prefill
and a recomputation see the same latents.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp4_cache import Fp4Latent

# auto = the model dtype; fp8 is fp8_e4m3, fp4 is fp4_e2m1 (attention_mla/fp4_cache.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp4", "fp4_e2m1")
E4M3_MAX = 448.0
GROUP = 128


def check_kv_cache_dtype(name) -> str:
    """-> "auto" | "fp8_e4m3" | "fp4_e2m1" (the canonical name); anything else is a ValueError naming it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return {"fp8": "fp8_e4m3", "fp4": "fp4_e2m1"}.get(name, name)


def _align4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class Fp8Latent:
    """The packed row of one token: kv_lora_rank C, rope_dim R, rope_dtype (the model dtype)."""
    kv_lora_rank: int
    rope_dim: int
    rope_dtype: torch.dtype = torch.float32
    name = "fp8_e4m3"      # the canonical kv_cache_dtype (LatentKVPool.kv_cache_dtype)

    def __post_init__(self):
        if self.kv_lora_rank < 1 or self.rope_dim < 0:
            raise ValueError(f"Fp8Latent needs kv_lora_rank >= 1 and rope_dim >= 0, got {self.kv_lora_rank}, "
                             f"{self.rope_dim}")

    @property
    def group(self) -> int:
        C = self.kv_lora_rank
        return GROUP if C % GROUP == 0 else C

    @property
    def num_groups(self) -> int:
        return self.kv_lora_rank // self.group

    @property
    def scale_offset(self) -> int:
        return _align4(self.kv_lora_rank)

    @property
    def rope_offset(self) -> int:
        return self.scale_offset + 4 * self.num_groups

    @property
    def row_bytes(self) -> int:
        return _align4(self.rope_offset + self.rope_dim * self.rope_dtype.itemsize)

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [T, C+R] -> packed rows uint8 [T, W]: per group scale = amax / 448 (1 where amax is 0,
        so an all-zero group stays 0 and nothing divides by 0)."""
        C, R, G = self.kv_lora_rank, self.rope_dim, self.num_groups
        T = latent.shape[0]
        if latent.shape != (T, C + R):
            raise ValueError(f"Fp8Latent.quantize: latent must be [T, {C + R}], got {tuple(latent.shape)}")
        c = latent[:, :C].float().view(T, G, self.group)
        scale = c.abs().amax(-1) / E4M3_MAX                                          # [T, G]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (c / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out = torch.zeros(T, self.row_bytes, dtype=torch.uint8, device=latent.device)
        out[:, :C] = q.view(T, C).view(torch.uint8)
        out[:, self.scale_offset:self.rope_offset] = scale.view(torch.uint8)
        rope = latent[:, C:].to(self.rope_dtype).contiguous().view(torch.uint8)      # [T, R*e]
        out[:, self.rope_offset:self.rope_offset + rope.shape[1]] = rope
        return out

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """rows uint8 [..., W] -> latents [..., C+R] in `dtype` (default: rope_dtype)."""
        C, R, G, W = self.kv_lora_rank, self.rope_dim, self.num_groups, self.row_bytes
        if rows.dtype != torch.uint8 or rows.shape[-1] != W:
            raise ValueError(f"Fp8Latent.dequantize: rows must be uint8 [..., {W}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        dtype = dtype or self.rope_dtype
        lead = rows.shape[:-1]
        rows = rows.reshape(-1, W)
        scale = rows[:, self.scale_offset:self.rope_offset].contiguous().view(torch.float32)       # [n, G]
        c = rows[:, :C].contiguous().view(torch.float8_e4m3fn).float().view(-1, G, self.group) * scale[..., None]
        rope = rows[:, self.rope_offset:self.rope_offset + R * self.rope_dtype.itemsize]
        rope = rope.contiguous().view(self.rope_dtype)
        return torch.cat((c.view(-1, C).to(dtype), rope.to(dtype)), dim=-1).view(*lead, C + R)

    def write(self, pool: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """pool uint8 [S, W]; latent [T, C+R] quantised into rows slots [T]."""
        pool.index_copy_(0, slots, self.quantize(latent))


def latent_layout(kv_cache_dtype: str, kv_lora_rank: int, rope_dim: int,
                  dtype: torch.dtype) -> Fp8Latent | Fp4Latent | None:
    """The packed layout for kv_cache_dtype "fp8"/"fp8_e4m3" or "fp4"/"fp4_e2m1", None for "auto" (rows of the
    model dtype). Both layouts have the same fields (kv_lora_rank, rope_dim, rope_dtype, name, row_bytes,
    scale_offset, rope_offset, group, num_groups) and methods (quantize, dequantize, write)."""
    kind = check_kv_cache_dtype(kv_cache_dtype)
    if kind == "auto":
        return None
    return (Fp8Latent if kind == "fp8_e4m3" else Fp4Latent)(kv_lora_rank, rope_dim, dtype)
