"""A model's KV cache as the block manager and the tiers see it: named streams, each with a pool of blocks of its own
and a block table per sequence (in the manner of vLLM's per-layer KVCacheSpec). A model family declares its KVSpec
(the MLA family: one "latent" stream, engine/model/mla_cache.py; DeepSeek-V4: window, compressed entries and boundary
states, attention_v4/pool_layout.py); the block manager (engine/sched/block_manager.py) and the KV tiers
(kvstore/store.py) work from it alone. Pure host arithmetic (no torch).

Legend: bs block_size (tokens per hash-chain block), m a stream's tokens per row, E its rows per block, W' a window
stream's reach (the rows a query reads besides its own), U the prefix-cache boundary, c the tokens a sequence holds
before a step, n its tokens in the step.

    full     kept for the whole sequence: a row per m tokens, E rows per block; row e is row e % E of table[e // E].
             Grows, never trimmed. The MLA latent (m = 1, E = bs: a row per token; DSA's indexer keys share its
             rows), DeepSeek-V4's compressed entries (m = 4, 128; E = max(1, bs // m)).
    window   a row per token, bs rows per block: logical block j holds tokens j*bs .. j*bs + bs - 1. A chunk
             [c, c+n) reads tokens [c - W', c) and writes its last W' tokens (with whole_chunks, for DBO, every
             token: a chunk cut between two microbatches has its first part's tail read by the second part); after
             the step the blocks holding only tokens before c + n - W' go back to the pool (no later query reads
             them). The table maps logical block -> pool block, live ones only.
    state    with prefix caching: a row per boundary, holding the sequence's slot state there (U tokens per row).
A spec with `slots` gives each sequence a slot besides its blocks: state of the model's own that every sequence holds
whatever its length (DeepSeek-V4: its compressors' open windows). A spec has at most one window and one state stream,
named by their kind.

Prefix caching starts a new sequence at a boundary P, a multiple of U (every full stream's tokens per block divide
it): what the next token depends on is the full streams' blocks before P, the window blocks of tokens P - W' .. P - 1
and the state row at P. With prefix caching every window row a chunk computes is written (a later hit reads the rows
before its boundary), so a chunk gets window blocks for all of its tokens (as with whole_chunks).
A `chain` spec (one full stream, a row per token, bs rows per block, no slots: the MLA family) has every block a
boundary; a sequence's one table is its block_ids.
Example (a window stream of W' = 127, bs = 64): a decode at c = 1000 reads tokens 873 .. 999 and writes 1000, in
window blocks 13 (tokens 832 .. 895), 14 and 15; after it the next query reads from 874, so block 13 stays; it
returns to the pool after the decode at c = 1022 (first_live(1023) = (1023 - 127) // 64 = 14).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

FULL, WINDOW, STATE = "full", "window", "state"


def _span(tokens: int, bs: int) -> int:
    """The most blocks of bs tokens that `tokens` consecutive tokens can touch."""
    return 0 if tokens <= 0 else -(-(tokens - 1) // bs) + 1


@dataclass(frozen=True)
class StreamSpec:
    """One KV stream: a pool of its own, rows per block, tokens per row."""
    name: str
    kind: str = FULL
    ratio: int = 1       # m: tokens per row (a state stream: U)
    rows: int = 1        # E: rows per block
    window: int = 0      # W': a window stream's reach

    @property
    def tokens_per_block(self) -> int:
        return self.rows * self.ratio


@dataclass(frozen=True)
class KVSpec:
    block_size: int                      # bs: tokens per hash-chain block (and per window block)
    layout: tuple[StreamSpec, ...]       # the streams, in pool order
    boundary: int = 0                    # U: prefix-cache boundaries are its multiples (0: no prefix caching)
    slots: bool = False                  # each sequence holds a slot besides its blocks
    model: str = "the model"             # whose cache this is, for messages

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        names = [s.name for s in self.layout]
        bad = [f"{s.name!r} ({s.kind})" for s in self.layout
               if s.kind not in (FULL, WINDOW, STATE) or (s.kind != FULL and s.name != s.kind)
               or s.rows < 1 or s.ratio < 1]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"KV streams {names}: names must be unique, kinds one of full / window / state (a window "
                             f"or state stream named by its kind), rows and tokens per row >= 1; not so: "
                             f"{', '.join(bad) or 'the names'}")
        if STATE in names and not (self.boundary and self.slots):
            raise ValueError(f"a state stream holds slot state at prefix-cache boundaries: it needs slots and a "
                             f"boundary (slots {self.slots}, boundary {self.boundary})")

    @cached_property
    def streams(self) -> tuple[str, ...]:
        """The streams' names, in pool order."""
        return tuple(s.name for s in self.layout)

    @cached_property
    def _by_name(self) -> dict[str, StreamSpec]:
        return {s.name: s for s in self.layout}

    @cached_property
    def full(self) -> tuple[str, ...]:
        """The full streams' names."""
        return tuple(s.name for s in self.layout if s.kind == FULL)

    @cached_property
    def window(self) -> int:
        """W' of the window stream (0: none)."""
        w = self._by_name.get(WINDOW)
        return w.window if w is not None else 0

    @cached_property
    def chain(self) -> bool:
        """One full stream of a row per token, bs rows per block, no slots: every block is a boundary."""
        return (not self.slots and len(self.layout) == 1 and self.layout[0].kind == FULL
                and self.layout[0].ratio == 1 and self.layout[0].rows == self.block_size)

    def stream(self, name: str) -> StreamSpec:
        return self._by_name[name]

    def ratio(self, name: str) -> int:
        """Tokens per row of a stream."""
        return self._by_name[name].ratio

    def rows(self, name: str) -> int:
        """Rows (tokens or entries) per block of a stream."""
        return self._by_name[name].rows

    def tokens_per_block(self, name: str) -> int:
        return self._by_name[name].tokens_per_block

    # -- the window stream ---------------------------------------------------------------------------
    def first_live(self, end: int) -> int:
        """The first window block a sequence of `end` tokens still needs (the next query reads end - W' ..)."""
        return max(0, end - self.window) // self.block_size

    def window_reads(self, c: int) -> set[int]:
        """Logical window blocks a chunk starting at c reads (tokens c - W' .. c - 1)."""
        bs = self.block_size
        return set(range(max(0, c - self.window) // bs, -(-c // bs))) if self.window else set()

    def window_blocks(self, c: int, n: int, whole_chunks: bool) -> set[int]:
        """Logical window blocks a step of tokens [c, c+n) reads or writes."""
        if not self.window:
            return set()
        wlo = c if whole_chunks or self.boundary else max(c, c + n - self.window)
        return self.window_reads(c) | set(range(wlo // self.block_size, -(-(c + n) // self.block_size)))

    def decode_window(self) -> int:
        """Window blocks a decoding sequence holds: W' + 1 consecutive tokens."""
        return _span(self.window + 1, self.block_size) if self.window else 0

    # -- the full streams ----------------------------------------------------------------------------
    def entry_blocks(self, name: str, tokens: int) -> int:
        """Blocks of a full stream that a sequence of `tokens` tokens fills (its rows' tokens all there)."""
        s = self._by_name[name]
        return -(-(tokens // s.ratio) // s.rows)

    def peak(self, tokens: int, max_chunk: int, whole_chunks: bool) -> dict[str, int]:
        """stream -> the most blocks one sequence of up to `tokens` tokens holds in a step of chunks up to
        max_chunk tokens: what a pool must hold for that sequence to run alone."""
        out = {s: self.entry_blocks(s, tokens) for s in self.full}
        if self.window:
            w = min(tokens, max_chunk) if whole_chunks or self.boundary else min(tokens, max_chunk, self.window)
            out[WINDOW] = min(-(-tokens // self.block_size),
                              _span(self.window, self.block_size) + _span(w, self.block_size))
        return out


@dataclass(eq=False)
class StreamTables:
    """One sequence's slot and block tables, one per stream, for a spec that is not a chain (host lists: the block
    manager's; read by the family's cache at each step)."""
    slot: int                                                 # -1: the spec has no slots
    full: dict[str, list[int]] = field(default_factory=dict)   # full stream -> its table
    window: dict[int, int] = field(default_factory=dict)   # logical block -> pool block, live blocks only
    state: list[int] = field(default_factory=list)   # state rows held: `restore`'s and the snapshots'
    restore: int | None = None   # prefix hit: the state row to copy into the slot before its first step (-1: none)
    snapshots: list[tuple[int, int]] = field(default_factory=list)   # (boundary P, state row) this step writes
    first_written: int = 0   # window rows before this token were never written here (a transferred prompt's head)

    def table(self, stream: str):
        """A stream's table: the window's dict, the state rows, or a full stream's list."""
        return self.window if stream == WINDOW else self.state if stream == STATE else self.full[stream]

    def held(self) -> dict[str, list[int]]:
        out = {WINDOW: list(self.window.values())} | self.full
        return out | {STATE: self.state} if self.state else out
