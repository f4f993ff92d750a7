"""How DeepSeek-V4's KV streams are cut into blocks, as a KV spec (kvstore/spec.py: the stream kinds, their
arithmetic and the per-sequence tables): one pool per stream, each with its own block size and one block table per
sequence. The block manager (engine/sched/block_manager.py) and the device pools (attention_v4/paged.py) share it.

Legend: bs the engine's block_size, W sliding_window, W' = W - 1 (the raw rows a query reads besides its own),
m a compress ratio, E entries per block.

    window  (window) every layer's raw KV, one row per token, bs rows per block, the last W' tokens' live.
    csa     (full) CSA layers' compressed entries and indexer keys, one per m tokens (m = 4), E = max(1, bs // m)
            entries per block.
    hca     (full) HCA layers' compressed entries (m = 128), E = max(1, bs // m): with bs = 64 a block is one entry
            (128 tokens), no row unused.
    slot    the per-sequence compressor states of the open windows (max_num_seqs of them, attention_v4/paged.py).
    state   (state) with prefix caching and CSA layers: snapshots of the CSA compressors' state at a prefix-cache
            boundary, one row per block.
Prefix caching lets a new sequence start at a boundary P, a multiple of U = lcm(bs, every compress ratio): there
every window is closed, so no compressor has open rows, and what the next token depends on is the compressed blocks
of entries before P (whole blocks: each stream's tokens per block divide U), the window blocks of tokens P - W' ..
P - 1, and the CSA compressors' overlap rows of the window that closed at P (a `state` row).
One table per stream serves every layer of the stream's kind (their blocks have the same geometry).
"""
from __future__ import annotations

import math

from wideep.kvstore.spec import FULL, STATE, WINDOW, KVSpec, StreamSpec


def v4_streams(window: int, block_size: int, ratios: tuple[tuple[str, int], ...], boundary: int = 0) -> KVSpec:
    """DeepSeek-V4's spec from its geometry: W' (0: no window stream), bs, (stream, m) of the compressed streams the
    layers have, U (0: no prefix caching). A state stream joins with a boundary and CSA layers."""
    layout = [StreamSpec(WINDOW, WINDOW, rows=block_size, window=window)] if window > 0 else []
    layout += [StreamSpec(s, FULL, ratio=m, rows=max(1, block_size // m)) for s, m in ratios]
    if boundary and any(s == "csa" for s, _ in ratios):
        layout.append(StreamSpec(STATE, STATE, ratio=boundary))
    return KVSpec(block_size, tuple(layout), boundary, slots=True, model="DeepSeek-V4")


def v4_kv_spec(cfg, kinds, block_size: int, prefix_caching: bool = False) -> KVSpec:
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
    return v4_streams(cfg.sliding_window - 1, block_size, ratios, boundary)
