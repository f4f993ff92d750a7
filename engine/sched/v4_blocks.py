"""DeepSeek-V4's block manager: a slot and a block table per stream for each sequence, every stream from its own
pool (attention_v4/pool_layout.py has the geometry). Never touches the device.

The scheduler (engine/sched/scheduler.py) drives it exactly as the token-block manager: can_grow / grow before a
step, register_computed after it, free when a sequence is preempted, finishes or is aborted. Here
  - can_grow(seq, n) checks every pool (and a free slot for a sequence that has none) for the blocks tokens
    [c, c+n) need: window blocks the chunk reads or writes, compressed blocks its closed windows fill;
    grow allocates all of them or, when one pool is short, none (MemoryError, nothing taken);
  - register_computed (after every step) returns to the window pool the blocks no later query reads;
  - free returns the slot and every stream's blocks, so a preempted sequence recomputes all of its streams.
Prefix caching, the KV tiers and disaggregation are refused with V4 (engine/worker/core.py); their hooks here are
the empty ones.
"""
from __future__ import annotations

from attention_mla.kv_cache import BlockAllocator
from attention_v4.pool_layout import StreamGeometry, StreamTables
from kvstore.events import HeldLog

from .block_manager import PrefixMatch
from .sequence import Sequence


class V4BlockManager:
    enable_prefix_caching = False
    register_every_step = True   # the scheduler calls register_computed after every step (the window's trim)
    store = None

    def __init__(self, geometry: StreamGeometry, num_blocks: dict[str, int], num_slots: int, max_chunk: int,
                 whole_chunks: bool = False, on_free=None):
        """num_blocks: stream -> pool size; max_chunk: the most tokens a step gives one sequence
        (max_num_batched_tokens); whole_chunks: allocate window blocks for every token of a chunk (DBO may cut it
        between two microbatches, whose second part reads the first's tail). on_free(seq): after a sequence's
        blocks are freed (the runner drops its streams)."""
        self.geometry, self.block_size = geometry, geometry.block_size
        self.allocators = {s: BlockAllocator(num_blocks[s]) for s in geometry.streams}
        self.num_slots, self._free_slots = num_slots, list(range(num_slots - 1, -1, -1))
        self.max_chunk, self.whole_chunks, self.on_free = max_chunk, whole_chunks, on_free
        self.log = HeldLog(enabled=False)
        self.queried_tokens = self.hit_tokens = self.num_cached = 0
        self.hit_blocks = {"device": 0, "host": 0, "disk": 0}

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
    def free_slots(self) -> int:
        return len(self._free_slots)

    def usage(self) -> dict[str, int]:
        """Per pool: blocks used and free; slots used."""
        out = {f"kv_{s}_blocks_used": a.num_blocks - a.num_free for s, a in self.allocators.items()}
        out |= {f"kv_{s}_blocks_free": a.num_free for s, a in self.allocators.items()}
        return out | {"kv_slots_used": self.num_slots - len(self._free_slots)}

    def capacity_error(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens tokens could never run, even alone (None: it can)."""
        peak = self.geometry.peak(num_tokens, self.max_chunk, self.whole_chunks)
        short = [f"{n} {s} blocks, the pool has {self.allocators[s].num_blocks}"
                 for s, n in peak.items() if n > self.allocators[s].num_blocks]
        return "needs " + "; ".join(short) if short else None

    # -- a step's blocks -------------------------------------------------------------------------------
    def _missing(self, seq: Sequence, n: int) -> tuple[dict[str, int], list[int]]:
        """-> (stream -> blocks to allocate, the logical window blocks among them) for tokens [c, c+n)."""
        t, c, g = seq.stream_tables, seq.num_computed, self.geometry
        window = t.window if t is not None else {}
        lost = g.window_reads(c) - window.keys()
        if lost:
            raise RuntimeError(f"request {seq.request_id!r} resumes at token {c} but its window blocks "
                               f"{sorted(lost)} are not in its table")
        new_window = sorted(g.window_blocks(c, n, self.whole_chunks) - window.keys())
        need = {"window": len(new_window)} if g.window else {}
        for s, _ in g.ratios:
            need[s] = g.entry_blocks(s, c + n) - len(getattr(t, s) if t is not None else ())
        return need, new_window

    def can_grow(self, seq: Sequence, n: int) -> bool:
        if seq.stream_tables is None and not self._free_slots:
            return False
        need, _ = self._missing(seq, n)
        return all(k <= self.allocators[s].num_free for s, k in need.items())

    def grow(self, seq: Sequence, n: int) -> None:
        """Every block tokens [c, c+n) need, from every pool, or nothing (MemoryError naming the short pool)."""
        if seq.stream_tables is None and not self._free_slots:
            raise MemoryError(f"no free DeepSeek-V4 slot for request {seq.request_id!r} ({self.num_slots} in all)")
        need, new_window = self._missing(seq, n)
        short = [f"{s}: need {k}, {self.allocators[s].num_free} free" for s, k in need.items()
                 if k > self.allocators[s].num_free]
        if short:
            raise MemoryError(f"DeepSeek-V4 KV pools out of blocks for request {seq.request_id!r}: " + "; ".join(short))
        t = seq.stream_tables
        if t is None:
            t = seq.stream_tables = StreamTables(self._free_slots.pop())
        for j, b in zip(new_window, self.allocators["window"].allocate(len(new_window)) if new_window else ()):
            t.window[j] = b
        for s, _ in self.geometry.ratios:
            if need[s] > 0:
                getattr(t, s).extend(self.allocators[s].allocate(need[s]))

    def register_computed(self, seq: Sequence) -> None:
        """After a step: the window blocks holding only tokens before the next query's window go back."""
        t = seq.stream_tables
        if t is None or not t.window:
            return
        first = self.geometry.first_live(seq.num_computed)
        old = [j for j in t.window if j < first]
        if old:
            self.allocators["window"].free([t.window.pop(j) for j in old])

    def free(self, seq: Sequence) -> None:
        t = seq.stream_tables
        if t is not None:
            for s, ids in t.held().items():
                if ids:
                    self.allocators[s].free(ids)
            self._free_slots.append(t.slot)
            seq.stream_tables = None
        seq.block_ids, seq.block_hashes = [], []
        if self.on_free is not None:
            self.on_free(seq)

    # -- no prefix cache, no tiers (refused with V4) ---------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        return PrefixMatch()

    def record_query(self, num_tokens: int, match: PrefixMatch) -> None:
        self.queried_tokens += num_tokens

    def reading(self, hashes: list[int]) -> bool:
        return False

    def wait_reads(self, hashes: list[int], timeout_s: float) -> None:
        pass

    def holds(self, h: int) -> bool:
        return False

    def take_events(self):
        return None

    def cached_blocks(self) -> list[tuple[int, int]]:
        return []
