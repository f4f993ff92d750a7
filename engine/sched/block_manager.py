"""Blocks per sequence, with prefix caching. Never touches the device.

A full block is named by a stable hash of its parent block's hash and its tokens (kvstore/hashing.py),
so equal prefixes give equal hash chains — on every rank, at the front, and across restarts. A new
sequence reuses the cached blocks of its longest cached prefix (reference counted; a hit on a block
nobody holds takes it back from the free list). Blocks of finished sequences keep their contents and
hash until the allocator hands them out again: free blocks are reused least-recently-freed first,
which is LRU eviction of the cache.

With lower tiers (store: kvstore.store.TieredStore, which moves the bytes), an evicted block spills
to the host tier (and from there to disk) instead of being lost, and a prefix that continues in a
lower tier is loaded back into fresh blocks; blocks still on disk are read while other sequences run.
Every block that comes or goes is marked in `log`, from which the rank tells the front what it holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from wideep.attention_mla.kv_cache import BlockAllocator
from wideep.kvstore.events import HeldLog, KVEvents
from wideep.kvstore.hashing import chain, prefix_chain

from .sequence import Sequence


@dataclass
class PrefixMatch:
    """What match_prefix gave a sequence."""
    tokens: int = 0            # its tokens whose KV is now in its blocks (its num_computed)
    device: int = 0            # blocks found in the device cache
    host: int = 0              # blocks loaded from the host tier
    disk: int = 0              # blocks loaded that came up from the disk tier
    reading: list[int] = field(default_factory=list)   # hashes of further blocks being read from disk


class BlockManager:
    register_every_step = False   # register_computed matters only with prefix caching (V4's manager: always)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, store=None,
                 log: HeldLog | None = None, on_free=None):
        """on_free(seq): called whenever a sequence's blocks are freed (preempted, finished, aborted): a cache that
        keeps more than the blocks per sequence (DeepSeek-V4's streams, engine/model/v4_cache.py) drops it."""
        self.on_free = on_free
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.store = store
        self.log = log or HeldLog(enabled=False)
        self._by_hash: dict[int, int] = {}     # full-block hash -> block id
        self._hash_of: dict[int, int] = {}     # block id -> its hash (while its contents are valid)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.hit_blocks = {"device": 0, "host": 0, "disk": 0}

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def usage(self) -> dict[str, int]:
        """Per-pool figures beyond the totals (one pool here: none)."""
        return {}

    def capacity_error(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens tokens could never run, even alone (None: it can)."""
        need = self.blocks_for(num_tokens)
        return f"needs {need} KV blocks, the cache has {self.num_blocks}" if need > self.num_blocks else None

    @property
    def num_cached(self) -> int:
        """Blocks whose contents are named by a hash (in use or free)."""
        return len(self._by_hash)

    def cached_per_stream(self) -> dict[str, int]:
        """stream -> named blocks (in use or free): one stream, the latents."""
        return {"latent": self.num_cached}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix. At least
        one token is always left to compute (its logits are needed); sequences that want prompt
        logprobs skip the cache, since the cached positions' logits are never computed."""
        m = PrefixMatch()
        if not self.enable_prefix_caching or seq.block_ids or seq.params.prompt_logprobs is not None:
            return m
        hashes = prefix_chain(seq.token_ids, self.block_size)
        hits = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            hits.append(b)
        for b in hits:
            if self.allocator.refs[b] == 0:
                self.allocator.take(b)
            else:
                self.allocator.incref(b)
        seq.block_ids, seq.block_hashes = hits, hashes[:len(hits)]
        m.device = len(hits)
        if self.store is not None and len(hits) < len(hashes):
            self._load(seq, hashes[len(hits):], m)
        seq.num_computed = m.tokens = len(seq.block_ids) * self.block_size
        return m

    def _load(self, seq: Sequence, rest: list[int], m: PrefixMatch) -> None:
        """The prefix continues below the device cache: load what the host tier holds into fresh
        blocks, and start reading what follows on disk (once per sequence)."""
        store = self.store
        store.poll()
        want = rest[:min(store.in_host(rest), self.num_free)]
        store.pin(want)   # the spills of the blocks allocated here must not push them out
        try:
            for b, h in zip(self.allocator.allocate(len(want)), want):
                self._forget(b)
                if store.load(b, h):
                    m.disk += 1
                else:
                    m.host += 1
                self._by_hash[h], self._hash_of[b] = b, h
                self.log.mark(h)
                seq.block_ids.append(b)
                seq.block_hashes.append(h)
        finally:
            store.unpin(want)
        if len(want) < len(rest) and not seq.kv_prefetched:
            m.reading = store.prefetch(rest[len(want):])
            seq.kv_prefetched += bool(m.reading)

    def reading(self, hashes: list[int]) -> bool:
        """Are some of these blocks still being read from disk? (Installs finished reads first.)"""
        if self.store is None:
            return False
        self.store.poll()
        return self.store.reading(hashes)

    def wait_reads(self, hashes: list[int], timeout_s: float) -> None:
        if self.store is not None:
            self.store.wait(hashes, timeout_s)

    def record_query(self, num_tokens: int, match: PrefixMatch) -> None:
        """Prefix-cache statistics, counted once per admitted sequence."""
        self.queried_tokens += num_tokens
        self.hit_tokens += match.tokens
        for tier in self.hit_blocks:
            self.hit_blocks[tier] += getattr(match, tier)

    def missing(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks the sequence lacks for num_new_tokens more tokens (<= 0: none)."""
        return self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_ids)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.missing(seq, num_new_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for positions up to num_computed + num_new_tokens - 1 (caller checked can_grow)."""
        need = self.missing(seq, num_new_tokens)
        for b in self.allocator.allocate(need) if need > 0 else []:
            self._forget(b)  # handed out again: its old contents go to a lower tier, or are gone
            seq.block_ids.append(b)

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]
            if self.store is not None:
                self.store.spill(block, h)
            self.log.mark(h)

    def register_computed(self, seq: Sequence) -> None:
        """After a step: hash the sequence's full, computed blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= len(seq.block_hashes):
            return
        seq.block_hashes = chain(seq.token_ids, self.block_size, full, seq.block_hashes)
        for b, h in zip(seq.block_ids[:full], seq.block_hashes):
            if b not in self._hash_of and h not in self._by_hash:  # else: cached already, here or elsewhere
                self._by_hash[h] = b
                self._hash_of[b] = h
                self.log.mark(h)

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_ids)
        seq.block_ids, seq.block_hashes = [], []
        if self.on_free is not None:
            self.on_free(seq)

    # -- what the rank holds -------------------------------------------------------------------------
    def holds(self, h: int) -> bool:
        """Is block h in any tier of this rank?"""
        return h in self._by_hash or (self.store is not None and self.store.holds(h))

    def take_events(self) -> KVEvents | None:
        return self.log.take(self.holds)

    def cached_blocks(self) -> list[tuple[int, int]]:
        """(block, hash) of every device block with named contents, oldest registration first."""
        return [(b, h) for h, b in self._by_hash.items()]
