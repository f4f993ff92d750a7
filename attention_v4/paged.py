"""DeepSeek-V4's KV streams as pools: what the engine allocates up front, with the layout per stream.

Legend: B blocks (the engine's token blocks of `block_size` tokens), bs block_size, Z slots (one per running
sequence), W sliding_window, D head_dim, DI index_head_dim, m a layer's ratio, C compressor width (CSA 2D, HCA D).
Per layer:
    window         [Z, W-1, D]          slot z's ring: token p at row p % (W-1)
    compressed     [B, ceil(bs/m), D]   entry e (tokens e*m .. e*m+m-1) in the block holding token e*m,
    index_keys     [B, ceil(bs/m), DI]  row (e*m % bs) // m: the sequence's block table is its token blocks'
    compressor     buf_kv / buf_gate [Z, m-1, C]: the open window's rows (token p at row p % m);
                   CSA: prev_kv / prev_gate [Z, m, D]: the last closed window's overlap rows
    index_compressor                    the same at DI (CSA)
Every count (entries, buffered rows, whether prev is set) follows from the position p0 a chunk starts at, so
the pools hold tensors only. A sequence holds one slot (what it keeps whatever its length) and its token blocks
(what grows); with bs < m (HCA's 128 at blocks of 64) a block keeps one entry row of which 1 in m/bs is used.
PagedLayerStreams has the interface of streams.LayerStreams, the dense reference it is tested against.
"""
from __future__ import annotations

import torch

from .compressor import CompressorState
from .config import V4AttentionConfig


def _layout(cfg: V4AttentionConfig, kind: str, block_size: int) -> tuple[dict, dict]:
    """-> (per-slot shapes, per-block shapes) of one layer's pools, each name -> shape without the leading Z / B."""
    D, DI, W, m = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window, cfg.ratio(kind)
    slot = {"window": (W - 1, D)}
    block = {}
    if m:
        rows = -(-block_size // m)
        block["compressed"] = (rows, D)
        C = 2 * D if kind == "csa" else D
        slot |= {"compressor.buf_kv": (m - 1, C), "compressor.buf_gate": (m - 1, C)}
    if kind == "csa":
        block["index_keys"] = (rows, DI)
        slot |= {"compressor.prev_kv": (m, D), "compressor.prev_gate": (m, D),
                 "index_compressor.buf_kv": (m - 1, 2 * DI), "index_compressor.buf_gate": (m - 1, 2 * DI),
                 "index_compressor.prev_kv": (m, DI), "index_compressor.prev_gate": (m, DI)}
    return slot, block


def _numel(shapes: dict) -> int:
    return sum(a * b for a, b in shapes.values())


class V4Pools:
    """Every layer's pools for `num_blocks` token blocks and `num_slots` sequences."""

    def __init__(self, cfg: V4AttentionConfig, kinds: tuple[str, ...], num_blocks: int, block_size: int,
                 num_slots: int, device, dtype):
        self.cfg, self.kinds, self.block_size = cfg, kinds, block_size
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in kinds:
            slot, block = _layout(cfg, kind, block_size)
            t = {n: torch.zeros(num_slots, *s, device=device, dtype=dtype) for n, s in slot.items()}
            t |= {n: torch.zeros(num_blocks, *s, device=device, dtype=dtype) for n, s in block.items()}
            self.layers.append(t)

    @staticmethod
    def bytes_per_slot(cfg: V4AttentionConfig, kinds, block_size: int, elt: int) -> int:
        return sum(_numel(_layout(cfg, k, block_size)[0]) for k in kinds) * elt

    @staticmethod
    def bytes_per_block(cfg: V4AttentionConfig, kinds, block_size: int, elt: int) -> int:
        return sum(_numel(_layout(cfg, k, block_size)[1]) for k in kinds) * elt

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())


class PagedLayerStreams:
    """One sequence's view of one layer's pools: its slot and its token blocks (`seq.block_ids`)."""

    def __init__(self, pools: V4Pools, layer: int, seq: "PagedSequence"):
        self.t, self.seq = pools.layers[layer], seq
        self.cfg, self.kind, self.bs = pools.cfg, pools.kinds[layer], pools.block_size
        self.m = self.cfg.ratio(self.kind)

    def window_rows(self, p0: int) -> torch.Tensor:
        ring = self.cfg.sliding_window - 1
        n = min(p0, ring)
        pos = torch.arange(p0 - n, p0, device=self.t["window"].device)
        return self.t["window"][self.seq.slot, pos % ring] if ring else self.t["window"][self.seq.slot, :0]

    def write_window(self, kv: torch.Tensor, p0: int) -> None:
        ring = self.cfg.sliding_window - 1
        if not ring:
            return
        T = kv.shape[0]
        keep = min(T, ring)
        pos = torch.arange(p0 + T - keep, p0 + T, device=kv.device)
        self.t["window"][self.seq.slot, pos % ring] = kv[T - keep:]

    def load_state(self, name: str, p0: int) -> CompressorState:
        m, z = self.m, self.seq.slot
        r, entries = p0 % m, p0 // m
        st = CompressorState(self.t[name + ".buf_kv"][z, :r], self.t[name + ".buf_gate"][z, :r], entries=entries)
        if name + ".prev_kv" in self.t and entries:
            st.prev_kv, st.prev_gate = self.t[name + ".prev_kv"][z], self.t[name + ".prev_gate"][z]
        return st

    def store_state(self, name: str, state: CompressorState, p_end: int) -> None:
        z, r = self.seq.slot, p_end % self.m
        if state.buf_kv.shape[0] != r or state.entries != p_end // self.m:
            raise RuntimeError(f"compressor state of {state.buf_kv.shape[0]} rows / {state.entries} entries does not "
                               f"match position {p_end} (ratio {self.m})")
        self.t[name + ".buf_kv"][z, :r] = state.buf_kv
        self.t[name + ".buf_gate"][z, :r] = state.buf_gate
        if state.prev_kv is not None:
            self.t[name + ".prev_kv"][z] = state.prev_kv
            self.t[name + ".prev_gate"][z] = state.prev_gate

    def _rows(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries first .. last-1 -> (block ids, rows) in the pools."""
        e = torch.arange(first, last)
        table = torch.tensor(self.seq.block_ids, dtype=torch.int64)
        tok = e * self.m
        return table[tok // self.bs], (tok % self.bs) // self.m

    def nbytes(self) -> int:
        """What this sequence holds of the layer: its slot's rows and its blocks' rows."""
        z = self.seq.slot
        slot = sum(t[z].numel() * t.element_size() for n, t in self.t.items() if n not in ("compressed", "index_keys"))
        return slot + len(self.seq.block_ids) * sum(self.t[n][0].numel() * self.t[n].element_size()
                                                    for n in ("compressed", "index_keys") if n in self.t)

    def append_entries(self, name: str, new: torch.Tensor, p0: int) -> torch.Tensor:
        first = p0 // self.m
        pool = self.t[name]
        if new.shape[0]:
            blocks, rows = self._rows(first, first + new.shape[0])
            pool[blocks.to(pool.device), rows.to(pool.device)] = new
        blocks, rows = self._rows(0, first + new.shape[0])
        return pool[blocks.to(pool.device), rows.to(pool.device)]


class PagedSequence:
    """A sequence's slot and block table (the engine's list, read at each step), as SequenceStreams' `layers`."""

    def __init__(self, pools: V4Pools, slot: int, block_ids: list[int]):
        self.slot, self.block_ids = slot, block_ids
        self.layers = [PagedLayerStreams(pools, i, self) for i in range(len(pools.kinds))]
