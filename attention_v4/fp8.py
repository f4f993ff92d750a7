"""DeepSeek-V4's fp8 KV cache (kv_cache_dtype "fp8"): the packed entry of the window and compressed streams and of
the CSA indexer keys, their quantisers and dequantisers.

Legend: D head_dim, R rope dim (the trailing R channels of a KV row are rotated), n = D - R the no-RoPE channels,
G = ceil(n / 64) scale tiles, e the model dtype's bytes, DI index_head_dim.

    KV entry (window rows, CSA/HCA `compressed`), uint8 [..., W], the layout vLLM publishes as fp8_ds_mla for V4:
        bytes [0, n)              the no-RoPE channels, e4m3, one scale per tile of 64 channels
        bytes [n, n + R*e)        the RoPE channels unquantised, in the model dtype
        bytes [n + R*e, +G)       the tiles' scales, powers of two, each its exponent byte (ue8m0: 2^(b - 127))
        padded to a multiple of 8 bytes: W = n + R*e + ceil8(G). D 512, R 64, bf16: 448 + 128 + 8 = 584.
    index key (CSA indexer), uint8 [..., DI + 4]: DI e4m3 values, then one float32 scale (amax / 448).

Tiles: 64 channels; n need not be a multiple of 64 (the tiny models: n = 24), the last tile is then the
remainder (ceil(n / 64) tiles). Power-of-two scales: the scale is the amax / 448 rounded up to a power of two, so
no value saturates and a scale is one byte. The RoPE part is kept unquantised as in FlashMLA's record: it carries
the positions of every score. The compressor states (slot tensors) stay in the model dtype: they are summed into
later entries, and are small. A chunk's queries read its own window rows quantised too (PagedLayerStreams
.write_window gives them back as stored), and the compressed entries are read back from the pool, so the outputs do not depend on how a prompt
is cut into chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
TILE = 64


def _ceil(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class KVEntryFp8:
    """The packed KV entry: head_dim D, rope_dim R, rope_dtype (the model dtype)."""
    head_dim: int
    rope_dim: int
    rope_dtype: torch.dtype

    def __post_init__(self):
        if not 0 <= self.rope_dim < self.head_dim:
            raise ValueError(f"KVEntryFp8 needs 0 <= rope_dim < head_dim, got {self.rope_dim}, {self.head_dim}")

    @property
    def nope(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_tiles(self) -> int:
        return -(-self.nope // TILE)

    @property
    def scale_offset(self) -> int:
        return self.nope + self.rope_dim * self.rope_dtype.itemsize

    @property
    def entry_bytes(self) -> int:
        return self.scale_offset + _ceil(self.num_tiles, 8)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> uint8 [T, W]."""
        n, R, G = self.nope, self.rope_dim, self.num_tiles
        T = x.shape[0]
        if x.shape != (T, self.head_dim):
            raise ValueError(f"KVEntryFp8.quantize: x must be [T, {self.head_dim}], got {tuple(x.shape)}")
        c = torch.nn.functional.pad(x[:, :n].float(), (0, G * TILE - n)).view(T, G, TILE)
        amax = c.abs().amax(-1)                                                           # [T, G]
        # 2^ceil(log2(amax / 448)): amax / scale <= 448; an all-zero tile gets scale 1 (exponent byte 127)
        exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)), torch.zeros_like(amax)).clamp(-127, 127)
        q = (c / torch.exp2(exp)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out = torch.zeros(T, self.entry_bytes, dtype=torch.uint8, device=x.device)
        out[:, :n] = q.view(T, G * TILE)[:, :n].view(torch.uint8)
        out[:, n:self.scale_offset] = x[:, n:].to(self.rope_dtype).contiguous().view(torch.uint8).view(T, -1)
        out[:, self.scale_offset:self.scale_offset + G] = (exp + 127).to(torch.uint8)
        return out

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows uint8 [..., W] -> [..., D] in dtype."""
        n, G, W = self.nope, self.num_tiles, self.entry_bytes
        if rows.dtype != torch.uint8 or rows.shape[-1] != W:
            raise ValueError(f"KVEntryFp8.dequantize: rows must be uint8 [..., {W}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        lead, rows = rows.shape[:-1], rows.reshape(-1, W)
        scale = torch.exp2(rows[:, self.scale_offset:self.scale_offset + G].float() - 127)       # [T, G]
        c = rows[:, :n].contiguous().view(torch.float8_e4m3fn).float()
        c = c * scale.repeat_interleave(TILE, dim=1)[:, :n]
        rope = rows[:, n:self.scale_offset].contiguous().view(self.rope_dtype)
        return torch.cat((c.to(dtype), rope.to(dtype)), dim=-1).view(*lead, self.head_dim)


@dataclass(frozen=True)
class IndexKeyFp8:
    """The packed indexer key: width DI e4m3 values and one float32 scale."""
    width: int

    @property
    def entry_bytes(self) -> int:
        return self.width + 4

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, DI] -> uint8 [T, DI + 4]."""
        T = x.shape[0]
        if x.shape != (T, self.width):
            raise ValueError(f"IndexKeyFp8.quantize: x must be [T, {self.width}], got {tuple(x.shape)}")
        x = x.float()
        scale = x.abs().amax(-1, keepdim=True) / E4M3_MAX                                 # [T, 1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows uint8 [..., DI + 4] -> [..., DI] in dtype."""
        if rows.dtype != torch.uint8 or rows.shape[-1] != self.entry_bytes:
            raise ValueError(f"IndexKeyFp8.dequantize: rows must be uint8 [..., {self.entry_bytes}], got "
                             f"{rows.dtype} {tuple(rows.shape)}")
        lead, rows = rows.shape[:-1], rows.reshape(-1, self.entry_bytes)
        scale = rows[:, self.width:].contiguous().view(torch.float32)                        # [T, 1]
        x = rows[:, :self.width].contiguous().view(torch.float8_e4m3fn).float() * scale
        return x.to(dtype).view(*lead, self.width)


V4_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}   # name -> canonical name


def check_v4_kv_cache_dtype(name: str) -> str:
    """-> "auto" | "fp8_e4m3"; fp4 and anything else is a ValueError naming it."""
    if name not in V4_KV_CACHE_DTYPES:
        raise ValueError(f"DeepSeek-V4's KV streams support kv_cache_dtype 'auto' or 'fp8' (= 'fp8_e4m3'), not "
                         f"{name!r}")
    return V4_KV_CACHE_DTYPES[name]


def v4_codecs(cfg, kv_cache_dtype: str, dtype: torch.dtype) -> dict:
    """cfg: attention_v4.config.V4AttentionConfig -> pool tensor name -> its packed entry (KVEntryFp8 /
    IndexKeyFp8); empty for "auto" (every pool in the model dtype)."""
    if check_v4_kv_cache_dtype(kv_cache_dtype) == "auto":
        return {}
    kv = KVEntryFp8(cfg.head_dim, cfg.rope_dim, dtype)
    return {"window": kv, "compressed": kv, "index_keys": IndexKeyFp8(cfg.index_head_dim)}
