"""What disaggregated prefill/decode moves of a DeepSeek-V4 sequence, layer by layer (disagg/prefill.py sends,
disagg/receiver.py stores): the pieces of one layer's pools (attention_v4/paged.py) that a chunk of tokens
[lo, hi) completes, gathered from the prefill rank's blocks and scattered into the decode rank's, in the pools'
own storage (whatever its dtype), in the same order on both sides.

Per layer and chunk:
    compressed      the entries the chunk's windows closed: lo // m .. hi // m - 1 (CSA and HCA layers)
    index_keys      the same entries' indexer keys (CSA)
and with the prompt's last chunk (last=True), what only the end of the prompt needs:
    window          the raw rows of tokens max(0, hi - W') .. hi - 1 (the only ones a later query reads)
    slot rows       the compressor states at hi: the open window's hi % m buffered rows (kv, gate) and, for CSA,
                    the last closed window's overlap rows (compressor and indexer)
The decode rank's tables come from its own block manager (it grows the sequence for the whole prompt before the
first piece lands); only the rows differ in place, so every index is recomputed there from (lo, hi).
"""
from __future__ import annotations

import torch

from .paged import PagedLayerStreams


def pieces(layer: PagedLayerStreams, lo: int, hi: int, last: bool) -> list[tuple[str, str, int, int]]:
    """-> (tensor name, where: entries / window / slot, first, end) of what chunk [lo, hi) of this layer moves."""
    out, m, t = [], layer.m, layer.t
    if m and hi // m > lo // m:
        out.append(("compressed", "entries", lo // m, hi // m))
        if "index_keys" in t:
            out.append(("index_keys", "entries", lo // m, hi // m))
    if not last:
        return out
    if "window" in t and layer.geo.window:
        out.append(("window", "window", max(0, hi - layer.geo.window), hi))
    for name in ("compressor", "index_compressor"):
        if name + ".buf_kv" not in t:
            continue
        if hi % m:
            out += [(name + ".buf_kv", "slot", 0, hi % m), (name + ".buf_gate", "slot", 0, hi % m)]
        if name + ".prev_kv" in t and hi // m:
            out += [(name + ".prev_kv", "slot", 0, m), (name + ".prev_gate", "slot", 0, m)]
    return out


def _index(layer: PagedLayerStreams, name: str, where: str, a: int, b: int):
    pool = layer.t[name]
    if where == "entries":
        return layer._entry_index(layer.stream_of[name], a, b, pool.device)
    if where == "window":
        return layer._window_index(a, b, pool.device)
    return layer.seq.tables.slot, slice(a, b)


def gather(layer: PagedLayerStreams, lo: int, hi: int, last: bool) -> list[torch.Tensor]:
    """The chunk's pieces of this layer, copied out of the pools (the blocks stay writable)."""
    return [layer.t[n][_index(layer, n, w, a, b)].clone() for n, w, a, b in pieces(layer, lo, hi, last)]


def staging(layer: PagedLayerStreams, lo: int, hi: int, last: bool) -> list[torch.Tensor]:
    """Empty tensors of the pieces' shapes and dtypes, to receive into."""
    out = []
    for n, w, a, b in pieces(layer, lo, hi, last):
        pool = layer.t[n]
        out.append(torch.empty(b - a, *pool.shape[2:], dtype=pool.dtype, device=pool.device))
    return out


def scatter(layer: PagedLayerStreams, rows: list[torch.Tensor], lo: int, hi: int, last: bool) -> None:
    """Write received pieces into this sequence's blocks and slot."""
    want = pieces(layer, lo, hi, last)
    if len(want) != len(rows):
        raise RuntimeError(f"{len(rows)} DeepSeek-V4 KV pieces received for tokens {lo} .. {hi - 1}, expected "
                           f"{len(want)}")
    for (n, w, a, b), r in zip(want, rows):
        layer.t[n][_index(layer, n, w, a, b)] = r
