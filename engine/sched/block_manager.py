"""Blocks per sequence, from the KV spec the model family declares (kvstore/spec.py): a pool per stream, each with its
own block size and a block table per sequence, a slot per sequence where the spec has them. Never touches the device.

The scheduler (engine/sched/scheduler.py) drives it: can_grow / grow before a step, register_computed after it, free
when a sequence is preempted (it recomputes every stream from its tokens), finishes or is aborted.
  - can_grow(seq, n) checks every pool (and a free slot for a sequence that has none) for the blocks tokens [c, c+n)
    need: full-stream blocks its tokens fill, window blocks the chunk reads or writes; grow allocates all of them or,
    when one pool is short, none (MemoryError naming the short pool, nothing taken);
  - register_computed names the blocks a step completed (prefix caching) and returns to the window pool the blocks no
    later query reads;
  - free returns the slot and every stream's blocks.
A chain spec (one full stream, a row per token, no slots: a latent cache) keeps its table in seq.block_ids; any other
in seq.stream_tables (kvstore/spec.py StreamTables), leaving block_ids empty.

Prefix caching. The hash chain names a block per block_size tokens (kvstore/hashing.py: a stable hash of the parent's
hash and the block's tokens, equal on every rank, at the front and across restarts); a pool block is named by the
hash of the last cache block its rows depend on: window block j by hash j, block i of a full stream with t tokens per
block by hash (i + 1) t / bs - 1, a state row at boundary P by hash P / bs - 1. Blocks stay named while free (LRU
eviction: the allocator hands out the least recently freed first, and a block handed out again loses its name; with
the KV tiers, store: kvstore/store.py, its rows spill to its stream's host tier first). Every name that comes or goes
is marked in `log` (KV-aware routing: a hash counts as held while any pool or tier has a block of that name).
A new sequence starts at the longest cached boundary with at least one prompt token left (sequences that want prompt
logprobs skip the cache: the cached positions' logits are never computed):
  - a chain takes its longest run of named device blocks (reference counted; a hit on a free block takes it back),
    then the blocks that continue it in the host tier, loaded into fresh blocks as far as blocks are free, and starts
    reading what follows on disk (once per sequence) while the sequence steps aside. Its steps name each block once,
    when it is complete.
  - any other spec starts at the longest boundary P for which every block it needs (the full streams' before P, the
    window blocks of tokens P - W' .. P - 1, the state row at P) is in its pool or its stream's host tier, with room
    in every pool for those to load; when the disk tier would give a longer boundary it reads exactly those blocks up
    first while the sequence waits (a second time when a file was a miss: the next boundary down needs its own window
    tail and state row, never more). Snapshots are optional: grow takes state rows for the boundaries a chunk crosses
    while the state pool has free rows, never refusing a step for want of one; the slot gets the boundary's state row
    (the runner copies it before the first step). Every step names the blocks its tokens completed.
Hits are counted in pool blocks per tier.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from wideep.attention_mla.kv_cache import BlockAllocator
from wideep.kvstore.events import HeldLog, KVEvents
from wideep.kvstore.hashing import chain, prefix_chain
from wideep.kvstore.spec import STATE, WINDOW, KVSpec, StreamTables

from .sequence import Sequence


@dataclass
class PrefixMatch:
    """What match_prefix gave a sequence."""
    tokens: int = 0            # its tokens whose KV is now in its blocks (its num_computed)
    device: int = 0            # blocks found in the device cache
    host: int = 0              # blocks loaded from the host tier
    disk: int = 0              # blocks loaded that came up from the disk tier
    reading: list[tuple[str, int]] = field(default_factory=list)   # (stream, hash) of blocks being read from disk


class BlockManager:
    def __init__(self, spec: KVSpec, num_blocks: dict[str, int], num_slots: int = 0, max_chunk: int = 1 << 62,
                 whole_chunks: bool = False, on_free=None, enable_prefix_caching: bool = False,
                 log: HeldLog | None = None, store=None):
        """num_blocks: stream -> pool size; num_slots: the slots (a spec with slots: max_num_seqs); max_chunk: the
        most tokens a step gives one sequence (max_num_batched_tokens); whole_chunks: allocate window blocks for every
        token of a chunk (DBO may cut it between two microbatches, whose second part reads the first's tail).
        on_free(seq): after a sequence's blocks are freed (a cache that keeps more per sequence drops it). log: where
        named hashes come and go. store: kvstore/store.py TieredStore, the host/disk tiers below the pools, or None."""
        self.spec, self.block_size = spec, spec.block_size
        self.allocators = {s: BlockAllocator(num_blocks[s]) for s in spec.streams}
        self.num_slots = num_slots if spec.slots else 0
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.max_chunk, self.whole_chunks, self.on_free = max_chunk, whole_chunks, on_free
        if enable_prefix_caching and not spec.boundary:
            raise ValueError(f"{spec.model} prefix caching needs the pools' geometry built with prefix_caching=True")
        self.enable_prefix_caching = enable_prefix_caching
        self._by_hash = {s: {} for s in spec.streams}   # stream -> hash -> pool block
        self._hash_of = {s: {} for s in spec.streams}   # stream -> pool block -> hash
        self.log = log or HeldLog(enabled=False)
        self.store = store
        self.queried_tokens = self.hit_tokens = 0
        self.hit_blocks = {"device": 0, "host": 0, "disk": 0}
        self.chain = spec.chain
        # the scheduler calls register_computed after every step when a window trims or a slot's state is kept
        self.register_every_step = not self.chain
        if self.chain:   # the hot path's one stream, at hand
            (self._stream,) = spec.streams
            self._alloc = self.allocators[self._stream]

    # -- what the pools hold ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(a.num_blocks for a in self.allocators.values())

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.allocators.values())

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Named blocks (in use or free) of every pool."""
        return sum(len(d) for d in self._by_hash.values())

    def cached_per_stream(self) -> dict[str, int]:
        """stream -> its named blocks (in use or free)."""
        return {s: len(d) for s, d in self._by_hash.items()}

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def usage(self) -> dict[str, int]:
        """Per pool: blocks used and free; slots used (one pool and no slots: nothing beyond the totals)."""
        if len(self.allocators) == 1 and not self.num_slots:
            return {}
        out = {f"kv_{s}_blocks_used": a.num_blocks - a.num_free for s, a in self.allocators.items()}
        out |= {f"kv_{s}_blocks_free": a.num_free for s, a in self.allocators.items()}
        return out | {"kv_slots_used": self.num_slots - len(self._free_slots)}

    def capacity_error(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens tokens could never run, even alone (None: it can)."""
        peak = self.spec.peak(num_tokens, self.max_chunk, self.whole_chunks)
        short = [f"{n} {s} blocks, the pool has {self.allocators[s].num_blocks}"
                 for s, n in peak.items() if n > self.allocators[s].num_blocks]
        return "needs " + "; ".join(short) if short else None

    # -- a step's blocks -------------------------------------------------------------------------------
    def _missing(self, seq: Sequence, n: int) -> tuple[dict[str, int], list[int]]:
        """-> (stream -> blocks to allocate, the logical window blocks among them) for tokens [c, c+n)."""
        t, c, g = seq.stream_tables, seq.num_computed, self.spec
        window = t.window if t is not None else {}
        lost = g.window_reads(c) - window.keys()
        if lost:
            raise RuntimeError(f"request {seq.request_id!r} resumes at token {c} but its window blocks "
                               f"{sorted(lost)} are not in its table")
        new_window = sorted(g.window_blocks(c, n, self.whole_chunks) - window.keys())
        need = {WINDOW: len(new_window)} if g.window else {}
        for s in g.full:
            need[s] = g.entry_blocks(s, c + n) - len(t.full[s] if t is not None else ())
        return need, new_window

    def missing(self, seq: Sequence, n: int) -> int:
        """Blocks of every pool that tokens [c, c+n) still need (<= 0: none; the scheduler's lookahead check)."""
        if self.chain:
            return -(-(seq.num_computed + n) // self.block_size) - len(seq.block_ids)
        return sum(max(0, k) for k in self._missing(seq, n)[0].values())

    def can_grow(self, seq: Sequence, n: int) -> bool:
        if self.chain:
            return self.missing(seq, n) <= self._alloc.num_free
        if seq.stream_tables is None and self.num_slots and not self._free_slots:
            return False
        need, _ = self._missing(seq, n)
        return all(k <= self.allocators[s].num_free for s, k in need.items())

    def grow(self, seq: Sequence, n: int) -> None:
        """Every block tokens [c, c+n) need, from every pool, or nothing (MemoryError naming the short pool)."""
        if self.chain:
            need = self.missing(seq, n)
            if need > 0:
                seq.block_ids.extend(self._allocate(self._stream, need))
            return
        if seq.stream_tables is None and self.num_slots and not self._free_slots:
            raise MemoryError(f"no free {self.spec.model} slot for request {seq.request_id!r} ({self.num_slots} in "
                              f"all)")
        need, new_window = self._missing(seq, n)
        short = [f"{s}: need {k}, {self.allocators[s].num_free} free" for s, k in need.items()
                 if k > self.allocators[s].num_free]
        if short:
            raise MemoryError(f"{self.spec.model} KV pools out of blocks for request {seq.request_id!r}: "
                              + "; ".join(short))
        t = seq.stream_tables
        if t is None:
            t = seq.stream_tables = self._tables()
        for j, b in zip(new_window, self._allocate(WINDOW, len(new_window))):
            t.window[j] = b
        for s in self.spec.full:
            if need[s] > 0:
                t.full[s].extend(self._allocate(s, need[s]))
        if STATE in self.allocators:
            self._snapshots(seq, t, n)

    def _tables(self) -> StreamTables:
        """A sequence's empty tables, and a slot when the spec has them."""
        return StreamTables(self._free_slots.pop() if self.num_slots else -1, {s: [] for s in self.spec.full})

    def _forget(self, stream: str, block: int) -> None:
        """A block handed out again loses its name; its rows go to the host tier before the step overwrites them."""
        h = self._hash_of[stream].pop(block, None)
        if h is not None and self._by_hash[stream].get(h) == block:
            del self._by_hash[stream][h]
            if self.store is not None:
                self.store.spill(stream, block, h)
            self.log.mark(h)

    def _allocate(self, stream: str, n: int) -> list[int]:
        """n blocks of a pool (nameless now)."""
        out = self.allocators[stream].allocate(n) if n > 0 else []
        for b in out:
            self._forget(stream, b)
        return out

    def _snapshots(self, seq: Sequence, t: StreamTables, n: int) -> None:
        """State rows for the boundaries tokens [c, c+n) close whose state no pool row holds yet (as many as the
        state pool has free); a verification's drafts close none (a boundary is named by the hash of real tokens)."""
        U, bs, c = self.spec.boundary, self.block_size, seq.num_computed
        ends = range((c // U + 1) * U, min(c + n, seq.num_tokens) + 1, U)   # (a verification's drafts: not yet tokens)
        if not ends:
            return
        seq.block_hashes = chain(seq.token_ids, bs, max(ends[-1] // bs, len(seq.block_hashes)), seq.block_hashes)
        want = [p for p in ends if seq.block_hashes[p // bs - 1] not in self._by_hash[STATE]]
        rows = self._allocate(STATE, min(len(want), self.allocators[STATE].num_free))
        t.snapshots = list(zip(want, rows))
        t.state.extend(rows)

    def register_computed(self, seq: Sequence) -> None:
        """After a step: with prefix caching the blocks its tokens completed are named; the window blocks holding
        only tokens before the next query's window go back (named, they stay cached until handed out again)."""
        if self.chain:
            if self.enable_prefix_caching:
                self._register_chain(seq)
            return
        t = seq.stream_tables
        if t is None:
            return
        if self.enable_prefix_caching:
            self._register(seq, t)
        if not t.window:
            return
        first = self.spec.first_live(seq.num_computed)
        old = [j for j in t.window if j < first]
        if old:
            self.allocators[WINDOW].free([t.window.pop(j) for j in old])

    def _register_chain(self, seq: Sequence) -> None:
        """Name the blocks completed since the last naming (each block is named once: a block whose hash another
        block holds stays unnamed)."""
        full = seq.num_computed // self.block_size
        if full <= len(seq.block_hashes):
            return
        seq.block_hashes = chain(seq.token_ids, self.block_size, full, seq.block_hashes)
        names, blocks = self._by_hash[self._stream], self._hash_of[self._stream]
        for b, h in zip(seq.block_ids[:full], seq.block_hashes):
            if b not in blocks and h not in names:  # else: cached already, here or elsewhere
                names[h], blocks[b] = b, h
                self.log.mark(h)

    def _name(self, stream: str, block: int, h: int) -> None:
        names = self._by_hash[stream]
        if h not in names and block not in self._hash_of[stream]:   # else: named already, here or in another block
            names[h], self._hash_of[stream][block] = block, h
            self.log.mark(h)

    def _register(self, seq: Sequence, t: StreamTables) -> None:
        g, bs, c = self.spec, self.block_size, seq.num_computed
        full = c // bs
        if full > len(seq.block_hashes):
            seq.block_hashes = chain(seq.token_ids, bs, full, seq.block_hashes)
        hashes = seq.block_hashes
        for j, b in t.window.items():
            if j < full and j * bs >= t.first_written:   # (a block holding unwritten rows is never named)
                self._name(WINDOW, b, hashes[j])
        for s in g.full:
            per = g.tokens_per_block(s) // bs   # cache blocks per pool block
            for i, b in enumerate(t.full[s][:full // per]):
                self._name(s, b, hashes[(i + 1) * per - 1])
        done = [r for p, r in t.snapshots if p <= c]   # written this step: named (or a duplicate), then let go
        for p, r in t.snapshots[:len(done)]:
            self._name(STATE, r, hashes[p // bs - 1])
        # past c: a verification's rejected drafts closed that boundary (its row holds their state); the step that
        # really reaches it takes a row again
        done += [r for _, r in t.snapshots[len(done):]]
        t.snapshots = []
        if t.restore is not None:   # the runner copied it into the slot before this step
            if t.restore >= 0:
                done.append(t.restore)
            t.restore = None
        if done:
            for r in done:
                t.state.remove(r)
            self.allocators[STATE].free(done)

    def free(self, seq: Sequence) -> None:
        if self.chain:
            self._alloc.free(seq.block_ids)
        elif seq.stream_tables is not None:
            t = seq.stream_tables
            for s, ids in t.held().items():
                if ids:
                    self.allocators[s].free(ids)
            if self.num_slots:
                self._free_slots.append(t.slot)
            seq.stream_tables = None
        seq.block_ids, seq.block_hashes = [], []
        if self.on_free is not None:
            self.on_free(seq)

    # -- the prefix cache, and the tiers below it -----------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Start a sequence that holds nothing at its longest cached boundary (the module's docstring says how)."""
        m = PrefixMatch()
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return m
        if self.chain:
            return m if seq.block_ids else self._match_chain(seq, m)
        if seq.stream_tables is not None or (self.num_slots and not self._free_slots):
            return m
        return self._match_boundary(seq, m)

    def _match_chain(self, seq: Sequence, m: PrefixMatch) -> PrefixMatch:
        names, alloc = self._by_hash[self._stream], self._alloc
        hashes = prefix_chain(seq.token_ids, self.block_size)
        hits = []
        for h in hashes:
            b = names.get(h)
            if b is None:
                break
            hits.append(b)
        for b in hits:
            if alloc.refs[b] == 0:
                alloc.take(b)
            else:
                alloc.incref(b)
        seq.block_ids, seq.block_hashes = hits, hashes[:len(hits)]
        m.device = len(hits)
        if self.store is not None and len(hits) < len(hashes):
            self._load_chain(seq, hashes[len(hits):], m)
        seq.num_computed = m.tokens = len(seq.block_ids) * self.block_size
        return m

    def _load_chain(self, seq: Sequence, rest: list[int], m: PrefixMatch) -> None:
        """The chain continues below the device cache: load what the host tier holds into fresh blocks, and start
        reading what follows on disk (once per sequence)."""
        store, s, alloc = self.store, self._stream, self._alloc
        store.poll()
        want = rest[:min(store.in_host(s, rest), alloc.num_free)]
        store.pin(s, want)   # the spills of the blocks allocated here must not push them out
        try:
            for b, h in zip(alloc.allocate(len(want)), want):
                self._forget(s, b)
                if store.load(s, b, h):
                    m.disk += 1
                else:
                    m.host += 1
                self._by_hash[s][h], self._hash_of[s][b] = b, h
                self.log.mark(h)
                seq.block_ids.append(b)
                seq.block_hashes.append(h)
        finally:
            store.unpin(s, want)
        if len(want) < len(rest) and not seq.kv_prefetched:
            m.reading = store.prefetch([(s, h) for h in rest[len(want):]])
            seq.kv_prefetched += bool(m.reading)

    def _match_boundary(self, seq: Sequence, m: PrefixMatch) -> PrefixMatch:
        g, bs = self.spec, self.block_size
        hashes = prefix_chain(seq.token_ids, bs)
        st = self.store
        if st is not None:
            st.poll()
        found = self._longest(hashes, ("device", "host"))
        if st is not None and st.has_disk and seq.kv_prefetched < 2:   # (a second time when a read was a miss)
            deeper = self._longest(hashes, ("device", "host", "disk"))
            if deeper is not None and deeper[0] > (found[0] if found else 0):
                m.reading = st.prefetch([(s, h) for s, need in deeper[1].items() for h, w in need if w == "disk"])
                seq.kv_prefetched += bool(m.reading)
                if m.reading:
                    return m
        if found is None:
            return m
        P, need = found
        t = seq.stream_tables = self._tables()
        got = {}
        for s, hs in need.items():   # the device's blocks first: the loads' allocations must not hand them out
            a, ids = self.allocators[s], []
            for h, w in hs:
                if w == "device":
                    b = self._by_hash[s][h]
                    if a.refs[b] == 0:
                        a.take(b)
                    else:
                        a.incref(b)
                    m.device += 1
                ids.append(b if w == "device" else None)
            got[s] = ids
        for s, hs in need.items():
            want = [h for h, w in hs if w == "host"]
            if not want:
                continue
            st.pin(s, want)   # the spills of the blocks allocated here must not push them out
            try:
                fresh = iter(self._allocate(s, len(want)))
                for k, (h, w) in enumerate(hs):
                    if w == "host":
                        b = got[s][k] = next(fresh)
                        if st.load(s, b, h):
                            m.disk += 1
                        else:
                            m.host += 1
                        self._name(s, b, h)
            finally:
                st.unpin(s, want)
        t.window = dict(zip(sorted(g.window_reads(P)), got.get(WINDOW, [])))
        for s in g.full:
            t.full[s] = got[s]
        t.state = list(got.get(STATE, []))
        t.restore = t.state[0] if t.state else -1
        seq.block_hashes = hashes[:P // bs]
        seq.num_computed = m.tokens = P
        return m

    def _where(self, s: str, h: int) -> str | None:
        """Where stream s's block named h is: "device" | "host" | "disk" | None."""
        if h in self._by_hash[s]:
            return "device"
        return self.store.where(s, h) if self.store is not None else None

    def _longest(self, hashes: list[int], tiers: tuple[str, ...]) -> tuple[int, dict[str, list]] | None:
        """-> (P, stream -> [(hash, tier)] of the blocks a start at P needs, in table order) for the longest
        boundary P whose blocks are all in these tiers, with room in each pool for those to load."""
        g, bs, U = self.spec, self.block_size, self.spec.boundary
        run = {}   # full stream -> its leading blocks found
        for s in g.full:
            per, found = g.tokens_per_block(s) // bs, []
            for i in range(len(hashes) // per):
                h = hashes[(i + 1) * per - 1]
                w = self._where(s, h)
                if w not in tiers:
                    break
                found.append((h, w))
            run[s] = found
        for P in range(len(hashes) * bs // U * U, 0, -U):
            if any(g.entry_blocks(s, P) > len(run[s]) for s in g.full):
                continue
            out = {s: run[s][:g.entry_blocks(s, P)] for s in g.full}
            if g.window:
                out[WINDOW] = [(hashes[j], self._where(WINDOW, hashes[j])) for j in sorted(g.window_reads(P))]
            if STATE in self.allocators:
                h = hashes[P // bs - 1]
                out[STATE] = [(h, self._where(STATE, h))]
            if all(w in tiers for need in out.values() for _, w in need) and self._fits(out):
                return P, out
        return None

    def _fits(self, need: dict[str, list]) -> bool:
        """Room in every pool for the blocks to load, after the free device blocks the hit takes back."""
        for s, hs in need.items():
            a, names = self.allocators[s], self._by_hash[s]
            taken = sum(1 for h, w in hs if w == "device" and a.refs[names[h]] == 0)
            if sum(1 for _, w in hs if w != "device") > a.num_free - taken:
                return False
        return True

    def record_query(self, num_tokens: int, match: PrefixMatch) -> None:
        """Prefix-cache statistics, counted once per admitted sequence."""
        self.queried_tokens += num_tokens
        self.hit_tokens += match.tokens
        for tier in self.hit_blocks:
            self.hit_blocks[tier] += getattr(match, tier)

    def reading(self, pairs: list[tuple[str, int]]) -> bool:
        """Are some of these (stream, hash) blocks still being read from disk? (Installs finished reads first.)"""
        return self.store is not None and self.store.reading(pairs)

    def wait_reads(self, pairs: list[tuple[str, int]], timeout_s: float) -> None:
        if self.store is not None:
            self.store.wait(pairs, timeout_s)

    # -- what the rank holds -------------------------------------------------------------------------
    def holds(self, h: int) -> bool:
        """Does some pool, or a tier below, have a block named h?"""
        return any(h in names for names in self._by_hash.values()) or (self.store is not None and self.store.holds(h))

    def take_events(self) -> KVEvents | None:
        return self.log.take(self.holds)

    def cached_blocks(self) -> dict[str, list[tuple[int, int]]]:
        """stream -> (block, hash) of its named pool blocks, oldest naming first (what the disk tier keeps at close)."""
        return {s: [(b, h) for h, b in names.items()] for s, names in self._by_hash.items()}
