"""Blocks per sequence, with prefix caching. Never touches the device.

A full block is identified by hash(parent block's hash, its tokens), so equal prefixes give equal
hash chains. A new sequence reuses the cached blocks of its longest cached prefix (reference counted;
a hit on a block nobody holds takes it back from the free list). Blocks of finished sequences keep
their contents and hash until the allocator hands them out again: free blocks are reused
least-recently-freed first, which is LRU eviction of the cache.
"""
from __future__ import annotations

from attention_mla.kv_cache import BlockAllocator

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._by_hash: dict[int, int] = {}     # full-block hash -> block id
        self._hash_of: dict[int, int] = {}     # block id -> its hash (while its contents are valid)
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain(self, tokens: list[int], n_blocks: int, known: list[int] | None = None) -> list[int]:
        """Hashes of the first n_blocks full blocks, extending the already known prefix of the chain."""
        out, bs = list(known or [])[:n_blocks], self.block_size
        parent = out[-1] if out else 0
        for i in range(len(out), n_blocks):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            out.append(parent)
        return out

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix. At least
        one token is always left to compute (its logits are needed); sequences that want prompt
        logprobs skip the cache, since the cached positions' logits are never computed."""
        if not self.enable_prefix_caching or seq.block_ids or seq.params.prompt_logprobs is not None:
            return 0
        tokens = seq.token_ids
        usable = (len(tokens) - 1) // self.block_size
        hits, hashes = [], []
        for h in self._chain(tokens, usable):
            b = self._by_hash.get(h)
            if b is None:
                break
            hits.append(b)
            hashes.append(h)
        for b in hits:
            if self.allocator.refs[b] == 0:
                self.allocator.take(b)
            else:
                self.allocator.incref(b)
        seq.block_ids, seq.block_hashes = hits, hashes
        seq.num_computed = len(hits) * self.block_size
        return seq.num_computed

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        """Prefix-cache statistics, counted once per admitted sequence."""
        self.queried_tokens += num_tokens
        self.hit_tokens += hit_tokens

    def missing(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks the sequence lacks for num_new_tokens more tokens (<= 0: none)."""
        return self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_ids)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.missing(seq, num_new_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for positions up to num_computed + num_new_tokens - 1 (caller checked can_grow)."""
        need = self.missing(seq, num_new_tokens)
        for b in self.allocator.allocate(need) if need > 0 else []:
            self._forget(b)  # handed out again: its old contents are gone
            seq.block_ids.append(b)

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]

    def register_computed(self, seq: Sequence) -> None:
        """After a step: hash the sequence's full, computed blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= len(seq.block_hashes):
            return
        seq.block_hashes = self._chain(seq.token_ids, full, seq.block_hashes)
        for b, h in zip(seq.block_ids[:full], seq.block_hashes):
            if b not in self._hash_of and h not in self._by_hash:  # else: cached already, here or elsewhere
                self._by_hash[h] = b
                self._hash_of[b] = h

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_ids)
        seq.block_ids, seq.block_hashes = [], []
