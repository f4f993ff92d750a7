"""Paged latent KV cache: one pool per layer of fixed-size blocks, and a block allocator.

MLA caches the compressed latent, not per-head K/V: per token per layer C + R values
(kv_lora_rank + qk_rope_head_dim; 576 for DeepSeek-V3).
Legend: S slots = num_blocks * block_size, D = C + R.
"""
from __future__ import annotations

import torch


class LatentKVPool:
    """pools[layer]: [S, D]. Zero-initialised so padded reads of never-written slots stay finite."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.latent_dim = num_blocks, block_size, latent_dim
        self.pools = [torch.zeros(num_blocks * block_size, latent_dim, dtype=dtype, device=device)
                      for _ in range(num_layers)]

    @property
    def bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools)


class BlockAllocator:
    """Free list of block ids. Never touches the device."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache out of blocks: need {n}, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
