"""Paged latent KV cache: one pool per layer of fixed-size blocks, and a reference-counted allocator.

MLA caches the compressed latent, not per-head K/V: per token per layer C + R values
(kv_lora_rank + qk_rope_head_dim; 576 for DeepSeek-V3). With kv_cache_dtype "fp8" a token's latent is
one packed uint8 row instead (attention_mla/fp8_cache.py: e4m3 no-RoPE part, float32 scales, RoPE part
in the model dtype): 656 bytes for DeepSeek-V3 in bf16 instead of 1152; with "fp4" (attention_mla/fp4_cache.py:
e2m1 no-RoPE part, an e4m3 scale per 16 values and a float32 one per token, RoPE part in the model dtype) 420.
Legend: S slots = num_blocks * block_size, D = C + R. A token at position j of a sequence lives in
slot block_table[j // block_size] * block_size + j % block_size.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .fp4_cache import Fp4Latent
from .fp8_cache import Fp8Latent


class LatentKVPool:
    """pools[layer]: [S, D]. Zero-initialised so padded reads of never-written slots stay finite.
    index_dim > 0 (DeepSeek Sparse Attention) adds index_pools[layer]: [S, Dk], the indexer's key of
    each token in the same slot as its latent (so one block table, prefix cache and transfer serve both);
    index_pools is None otherwise.
    fp8: the packed layout (kv_cache_dtype "fp8", or "fp4": an Fp4Latent, the same fields): pools[layer] is
    then uint8 [S, fp8.row_bytes]; the
    indexer keys stay in `dtype` (they are 128 values against the latent's 576 and pick the top-k, where
    a flipped choice costs more than the bytes saved)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", index_dim: int = 0,
                 fp8: Fp8Latent | Fp4Latent | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if fp8 is not None and fp8.kv_lora_rank + fp8.rope_dim != latent_dim:
            raise ValueError(f"fp8 layout {fp8.kv_lora_rank} + {fp8.rope_dim} != latent_dim {latent_dim}")
        self.num_blocks, self.block_size, self.latent_dim = num_blocks, block_size, latent_dim
        self.index_dim, self.fp8 = index_dim, fp8
        S = num_blocks * block_size
        width, pool_dtype = (latent_dim, dtype) if fp8 is None else (fp8.row_bytes, torch.uint8)
        self.pools = [torch.zeros(S, width, dtype=pool_dtype, device=device) for _ in range(num_layers)]
        self.index_pools = ([torch.zeros(S, index_dim, dtype=dtype, device=device) for _ in range(num_layers)]
                            if index_dim else None)

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        """Everything cached per token for `layer`, slot for slot: [latent [S, D]] (+ [index keys [S, Dk]])."""
        return [self.pools[layer]] + ([self.index_pools[layer]] if self.index_pools is not None else [])

    def all_pools(self) -> list[torch.Tensor]:
        """layer_pools of every layer, in layer order: everything a block's state is made of."""
        return [t for layer in range(len(self.pools)) for t in self.layer_pools(layer)]

    def bytes_per_token(self) -> dict[str, int]:
        """Cache bytes one token takes over all layers: the latent's (packed rows with fp8 / fp4: the
        quantised values, scales, RoPE part) and the indexer keys' (0 without DSA)."""
        L = len(self.pools)
        index = L * self.index_dim * self.index_pools[0].element_size() if self.index_pools is not None else 0
        return {"latent": L * self.pools[0].shape[1] * self.pools[0].element_size(), "index_keys": index}

    @property
    def kv_cache_dtype(self) -> str:
        """The canonical name of the latent cache's format: "auto" | "fp8_e4m3" | "fp4_e2m1" (from `fp8`)."""
        return "auto" if self.fp8 is None else self.fp8.name

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
                        index_dim: int = 0, fp8: Fp8Latent | Fp4Latent | None = None) -> int:
        """The bytes a block takes over all layers (what sizes the cache from kv_cache_memory)."""
        size = torch.empty(0, dtype=dtype).element_size()
        latent = latent_dim * size if fp8 is None else fp8.row_bytes
        return num_layers * block_size * (latent + index_dim * size)


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
