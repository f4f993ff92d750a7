"""How DeepSeek-V4's KV streams are cut into blocks: one pool per stream, each with its own block size and one block
table per sequence. Pure host arithmetic (no torch): the block manager (engine/sched/v4_blocks.py) and the device
pools (attention_v4/paged.py) share it.

Legend: bs the engine's block_size, W sliding_window, W' = W - 1 (the raw rows a query reads besides its own),
m a compress ratio, E entries per block, c the tokens a sequence holds before a step, n its tokens in the step.

    window  every layer's raw KV, one row per token, bs rows per block: logical block j holds tokens j*bs ..
            j*bs + bs - 1. A chunk [c, c+n) reads tokens [c - W', c) and writes its last W' tokens (with
            whole_chunks, for DBO, every token: a chunk cut between two microbatches has its first part's tail
            read by the second part); after the step the blocks holding only tokens before c + n - W' return
            to the pool (no later query reads them). The table maps logical block -> pool block, live ones only.
    csa     CSA layers' compressed entries and indexer keys, one per m tokens (m = 4), E = max(1, bs // m)
            entries per block; entry e in row e % E of table[e // E]. Grows, never trimmed.
    hca     HCA layers' compressed entries (m = 128), E = max(1, bs // m): with bs = 64 a block is one entry
            (128 tokens), no row unused.
    slot    the per-sequence compressor states of the open windows (max_num_seqs of them, attention_v4/paged.py).
    state   with prefix caching (boundary U > 0) and CSA layers: snapshots of the CSA compressors' state at a
            prefix-cache boundary, one row per block; U tokens per block (see `boundary`).
Prefix caching (engine/sched/v4_blocks.py) lets a new sequence start at a boundary P, a multiple of
U = lcm(bs, every compress ratio): there every window is closed, so no compressor has open rows, and what the next
token depends on is the compressed blocks of entries before P (whole blocks: each stream's tokens per block divide
U), the window blocks of tokens P - W' .. P - 1, and the CSA compressors' overlap rows of the window that closed at
P (a `state` row). With prefix caching every window row a chunk computes is written (a later hit reads the rows
before its boundary), so a chunk gets window blocks for all of its tokens (as with whole_chunks).
One table per stream serves every layer of the stream's kind (their blocks have the same geometry).
Example: W = 128, bs = 64: a decode at c = 1000 reads tokens 873 .. 999 and writes 1000, in window blocks 13
(tokens 832 .. 895), 14 and 15; after it the next query reads from 874, so block 13 stays; it returns to the pool
after the decode at c = 1022 (first_live(1023) = (1023 - 127) // 64 = 14).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def _span(tokens: int, bs: int) -> int:
    """The most blocks of bs tokens that `tokens` consecutive tokens can touch."""
    return 0 if tokens <= 0 else -(-(tokens - 1) // bs) + 1


@dataclass(frozen=True)
class StreamGeometry:
    window: int                           # W': raw rows a query reads from the window stream (0: no such stream)
    block_size: int                       # bs: tokens per window block
    ratios: tuple[tuple[str, int], ...]   # (stream, m) of the compressed streams the model's layers have
    boundary: int = 0                     # U: prefix-cache boundaries are its multiples (0: no prefix caching)

    @classmethod
    def of(cls, cfg, kinds, block_size: int, prefix_caching: bool = False) -> "StreamGeometry":
        """cfg: attention_v4.config.V4AttentionConfig; kinds: the layers' kinds."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        ratios = tuple((k, cfg.ratio(k)) for k in ("csa", "hca") if k in kinds)
        boundary = 0
        if prefix_caching:
            odd = [f"{k} ratio {m}" for k, m in ratios if block_size % m and m % block_size]
            if odd:
                raise ValueError(f"DeepSeek-V4 prefix caching needs block_size ({block_size}) to be a multiple or a "
                                 f"divisor of every compress ratio ({', '.join(odd)}): a cached block must hold whole "
                                 f"compressed blocks (or pass enable_prefix_caching=False)")
            boundary = math.lcm(block_size, *(m for _, m in ratios))
        return cls(cfg.sliding_window - 1, block_size, ratios, boundary)

    @property
    def streams(self) -> tuple[str, ...]:
        state = ("state",) * (self.boundary > 0 and any(s == "csa" for s, _ in self.ratios))
        return ("window",) * (self.window > 0) + tuple(s for s, _ in self.ratios) + state

    def ratio(self, stream: str) -> int:
        """Tokens per row of a stream (1 for the window, U for the boundary states)."""
        if stream == "state":
            return self.boundary
        return 1 if stream == "window" else dict(self.ratios)[stream]

    def rows(self, stream: str) -> int:
        """Rows (tokens or entries) per block of a stream."""
        if stream == "state":
            return 1
        return self.block_size if stream == "window" else max(1, self.block_size // self.ratio(stream))

    def tokens_per_block(self, stream: str) -> int:
        return self.rows(stream) * self.ratio(stream)

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

    # -- the compressed streams ----------------------------------------------------------------------
    def entry_blocks(self, stream: str, tokens: int) -> int:
        """Blocks of a compressed stream that a sequence of `tokens` tokens fills (its closed windows)."""
        return -(-(tokens // self.ratio(stream)) // self.rows(stream))

    def peak(self, tokens: int, max_chunk: int, whole_chunks: bool) -> dict[str, int]:
        """stream -> the most blocks one sequence of up to `tokens` tokens holds in a step of chunks up to
        max_chunk tokens: what a pool must hold for that sequence to run alone."""
        out = {s: self.entry_blocks(s, tokens) for s, _ in self.ratios}
        if self.window:
            w = min(tokens, max_chunk) if whole_chunks or self.boundary else min(tokens, max_chunk, self.window)
            out["window"] = min(-(-tokens // self.block_size),
                                _span(self.window, self.block_size) + _span(w, self.block_size))
        return out


@dataclass(eq=False)
class StreamTables:
    """One sequence's slot and block tables, one per stream: what the block manager gives it (host lists)."""
    slot: int
    window: dict[int, int] = field(default_factory=dict)   # logical block -> pool block, live blocks only
    csa: list[int] = field(default_factory=list)
    hca: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)   # state rows held: `restore`'s and the snapshots'
    restore: int | None = None   # prefix hit: the state row to copy into the slot before its first step (-1: none)
    snapshots: list[tuple[int, int]] = field(default_factory=list)   # (boundary P, state row) this step writes
    first_written: int = 0   # window rows before this token were never written here (a transferred prompt's head)

    def held(self) -> dict[str, list[int]]:
        out = {"window": list(self.window.values()), "csa": self.csa, "hca": self.hca}
        return out | {"state": self.state} if self.state else out
