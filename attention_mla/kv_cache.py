"""Paged latent KV cache: one pool per layer of fixed-size blocks, and a reference-counted allocator.

MLA caches the compressed latent, not per-head K/V: per token per layer C + R values
(kv_lora_rank + qk_rope_head_dim; 576 for DeepSeek-V3).
Legend: S slots = num_blocks * block_size, D = C + R. A token at position j of a sequence lives in
slot block_table[j // block_size] * block_size + j % block_size.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class LatentKVPool:
    """pools[layer]: [S, D]. Zero-initialised so padded reads of never-written slots stay finite.
    index_dim > 0 (DeepSeek Sparse Attention) adds index_pools[layer]: [S, Dk], the indexer's key of
    each token in the same slot as its latent (so one block table, prefix cache and transfer serve both);
    index_pools is None otherwise."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", index_dim: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.latent_dim = num_blocks, block_size, latent_dim
        self.index_dim = index_dim
        S = num_blocks * block_size
        self.pools = [torch.zeros(S, latent_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.index_pools = ([torch.zeros(S, index_dim, dtype=dtype, device=device) for _ in range(num_layers)]
                            if index_dim else None)

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        """Everything cached per token for `layer`, slot for slot: [latent [S, D]] (+ [index keys [S, Dk]])."""
        return [self.pools[layer]] + ([self.index_pools[layer]] if self.index_pools is not None else [])

    def bytes_per_token(self) -> dict[str, int]:
        """Cache bytes one token takes over all layers: the latent's and the indexer keys' (0 without DSA)."""
        size, L = self.pools[0].element_size(), len(self.pools)
        return {"latent": L * self.latent_dim * size, "index_keys": L * self.index_dim * size}

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    def slot_list(self, block_ids: list[int], lo: int, hi: int) -> list[int]:
        """Slots of positions lo .. hi-1 of a sequence with these blocks (the one home of the formula)."""
        bs = self.block_size
        return [block_ids[j // bs] * bs + j % bs for j in range(lo, hi)]

    def slots(self, block_ids: list[int], lo: int, hi: int) -> torch.Tensor:
        """slot_list as an int64 tensor [hi - lo] on the pools' device."""
        return torch.tensor(self.slot_list(block_ids, lo, hi), dtype=torch.int64, device=self.device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, latent_dim: int, dtype: torch.dtype,
                        index_dim: int = 0) -> int:
        return num_layers * block_size * (latent_dim + index_dim) * torch.empty(0, dtype=dtype).element_size()


class BlockAllocator:
    """Free list + reference counts. A block is free when its count drops to 0 (the prefix cache
    may still remember its contents until it is handed out again). The free list hands out the
    least recently freed block first, so cached contents are evicted LRU. Never touches the device."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache out of blocks: need {n}, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def incref(self, block: int) -> None:
        self.refs[block] += 1

    def decref(self, block: int) -> bool:
        """-> True when the block became free."""
        if self.refs[block] <= 0:
            raise RuntimeError(f"block {block} freed twice")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None
            return True
        return False

    def free(self, blocks: list[int]) -> None:
        # the tail of a sequence is evicted before its head: heads are the likelier shared prefixes
        for b in reversed(blocks):
            self.decref(b)

    def take(self, block: int) -> None:
        """Reclaim a specific free block (a prefix-cache hit on a block nobody holds)."""
        del self._free[block]
        self.refs[block] = 1


def gather_reference(pool: torch.Tensor, block_ids: list[int], length: int, block_size: int) -> torch.Tensor:
    """Readable reference: a sequence's first `length` latents, block by block. pool [S, D] -> [length, D].
    (The step path gathers all sequences at once through AttnMeta.context_slots.)"""
    rows = [pool[b * block_size:(b + 1) * block_size] for b in block_ids]
    return torch.cat(rows)[:length] if rows else pool[:0]
