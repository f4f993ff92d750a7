"""DeepSeek-V4's KV streams as paged pools: what the engine allocates up front, with the layout per stream.

Legend: Z slots (max_num_seqs), N_s blocks of stream s (attention_v4/pool_layout.py: window, csa, hca), bs
block_size, W' = sliding_window - 1, E_s entries per block, D head_dim, DI index_head_dim, m a layer's ratio,
C compressor width (CSA 2D, HCA D). Per layer:
    window         [N_window, bs, D]   token p in row p % bs of window block table[p // bs]
    compressed     [N_k, E_k, D]       k = the layer's kind (csa / hca): entry e in row e % E_k of table[e // E_k]
    index_keys     [N_csa, E_csa, DI]  CSA: the indexer's keys, entry for entry beside `compressed`
    compressor     buf_kv / buf_gate [Z, m-1, C]: the open window's rows (token p at row p % m);
                   CSA: prev_kv / prev_gate [Z, m, D]: the last closed window's overlap rows
    index_compressor                   the same at DI (CSA)
    *.snap_kv / *.snap_gate [N_state, m, D or DI]   prefix caching, CSA: a boundary's prev rows (pool_layout.py)
With kv_cache_dtype "fp8" the window, compressed and index_keys pools are uint8 [N_s, E_s, W] of packed entries
(attention_v4/fp8.py: quantised on write, dequantised on read); the compressor states stay in the model dtype.
A sequence holds a slot (the compressor states: what it keeps whatever its length) and, per stream, the blocks of
its table (kvstore/spec.py StreamTables, filled by the block manager, read here at each step). Every
count (entries, buffered rows, whether prev is set) follows from the position p0 a chunk starts at, so the pools
hold tensors only and a chunk continues the sequence's open windows. PagedLayerStreams has the interface of
streams.LayerStreams, the dense reference it is tested against.
"""
from __future__ import annotations

import torch

from wideep.kvstore.spec import KVSpec

from .compressor import CompressorState
from .config import V4AttentionConfig
from .fp8 import v4_codecs


def _layout(cfg: V4AttentionConfig, kind: str, geo: KVSpec) -> tuple[dict, dict]:
    """-> (per-slot shapes, per-block shapes) of one layer's pools: name -> (stream, shape without the leading
    Z / N_s); slot tensors have stream "slot"."""
    D, DI, m = cfg.head_dim, cfg.index_head_dim, cfg.ratio(kind)
    slot, block = {}, {}
    if geo.window:
        block["window"] = ("window", (geo.rows("window"), D))
    if m:
        block["compressed"] = (kind, (geo.rows(kind), D))
        C = 2 * D if kind == "csa" else D
        slot |= {"compressor.buf_kv": (m - 1, C), "compressor.buf_gate": (m - 1, C)}
    if kind == "csa" and "state" in geo.streams:
        block |= {"compressor.snap_kv": ("state", (m, D)), "compressor.snap_gate": ("state", (m, D)),
                  "index_compressor.snap_kv": ("state", (m, DI)), "index_compressor.snap_gate": ("state", (m, DI))}
    if kind == "csa":
        block["index_keys"] = (kind, (geo.rows(kind), DI))
        slot |= {"compressor.prev_kv": (m, D), "compressor.prev_gate": (m, D),
                 "index_compressor.buf_kv": (m - 1, 2 * DI), "index_compressor.buf_gate": (m - 1, 2 * DI),
                 "index_compressor.prev_kv": (m, DI), "index_compressor.prev_gate": (m, DI)}
    return slot, block


def _stored(shape: tuple[int, int], codec) -> tuple[int, int]:
    """A block tensor's (rows, values per row) -> as the pool stores it: packed entries of codec.entry_bytes."""
    return shape if codec is None else (shape[0], codec.entry_bytes)


class V4Pools:
    """Every layer's pools: num_blocks[stream] blocks per stream (geometry.streams), num_slots slots."""

    def __init__(self, cfg: V4AttentionConfig, kinds: tuple[str, ...], geometry: KVSpec,
                 num_blocks: dict[str, int], num_slots: int, device, dtype, kv_cache_dtype: str = "auto"):
        missing = [s for s in geometry.streams if num_blocks.get(s, 0) < 1]
        if missing or num_slots < 1:
            raise ValueError(f"DeepSeek-V4 pools need >= 1 block of every stream and >= 1 slot, got {num_blocks} "
                             f"(streams {list(geometry.streams)}), {num_slots} slots")
        self.cfg, self.kinds, self.geometry = cfg, kinds, geometry
        self.num_blocks, self.num_slots, self.device, self.dtype = dict(num_blocks), num_slots, device, dtype
        self.codecs = v4_codecs(cfg, kv_cache_dtype, dtype)   # block tensor name -> packed entry (fp8), or none
        self.layers: list[dict[str, torch.Tensor]] = []
        self.stream_of: list[dict[str, str]] = []   # per layer: block tensor name -> its stream
        for kind in kinds:
            slot, block = _layout(cfg, kind, geometry)
            t = {n: torch.zeros(num_slots, *s, device=device, dtype=dtype) for n, s in slot.items()}
            t |= {n: torch.zeros(num_blocks[st], *_stored(s, self.codecs.get(n)), device=device,
                                 dtype=dtype if n not in self.codecs else torch.uint8) for n, (st, s) in block.items()}
            self.layers.append(t)
            self.stream_of.append({n: st for n, (st, _) in block.items()})

    @staticmethod
    def bytes_per_slot(cfg: V4AttentionConfig, kinds, geometry: KVSpec, elt: int) -> int:
        return sum(a * b for k in kinds for a, b in _layout(cfg, k, geometry)[0].values()) * elt

    @staticmethod
    def bytes_per_block(cfg: V4AttentionConfig, kinds, geometry: KVSpec, elt: int,
                        codecs: dict | None = None) -> dict[str, int]:
        """stream -> the bytes one block of it takes over all layers; codecs: attention_v4/fp8.py v4_codecs."""
        codecs, out = codecs or {}, dict.fromkeys(geometry.streams, 0)
        for k in kinds:
            for n, (st, s) in _layout(cfg, k, geometry)[1].items():
                a, b = _stored(s, codecs.get(n))
                out[st] += a * b * (elt if n not in codecs else 1)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())


class PagedLayerStreams:
    """One sequence's view of one layer's pools: its slot and its tables (`seq.tables`)."""

    def __init__(self, pools: V4Pools, layer: int, seq: "PagedSequence"):
        self.t, self.seq, self.stream_of = pools.layers[layer], seq, pools.stream_of[layer]
        self.cfg, self.kind, self.geo = pools.cfg, pools.kinds[layer], pools.geometry
        self.m, self.codecs, self.dtype = self.cfg.ratio(self.kind), pools.codecs, pools.dtype
        self._empty = torch.zeros(0, self.cfg.head_dim, device=pools.device, dtype=pools.dtype)
        self.floor = 0   # window rows before this position are not read (the MTP drafter's deferred rows)

    def read_from(self, position: int) -> None:
        """Window rows before `position` are not read from now on (0: all are); the MTP drafter floors a deferred
        chunk's window at the rows the sequence still holds."""
        self.floor = position

    def _window_index(self, lo: int, hi: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens lo .. hi-1 -> (window blocks, rows) in the pool."""
        bs, table = self.geo.block_size, self.seq.tables.window
        try:
            blocks = [table[j] for j in range(lo // bs, -(-hi // bs))]
        except KeyError as e:
            raise RuntimeError(f"window block {e.args[0]} of tokens {lo} .. {hi - 1} is not in the sequence's "
                               f"table {sorted(table)}") from None
        p = torch.arange(lo, hi)
        ids = torch.tensor(blocks, dtype=torch.int64)[p // bs - lo // bs]
        return ids.to(device), (p % bs).to(device)

    def window_rows(self, p0: int) -> torch.Tensor:
        pool = self.t.get("window")
        lo = max(self.floor, p0 - self.geo.window)
        if pool is None or lo >= p0:
            return self._empty
        return self._read("window", pool[self._window_index(lo, p0, pool.device)])

    def write_window(self, kv: torch.Tensor, p0: int) -> torch.Tensor:
        """Writes the chunk's last W' rows: the only ones a later query of this chunk's sequence reads; with prefix
        caching every row (a later sequence's hit may read any of them). -> the chunk's rows as window_rows gives
        them back (fp8: quantised once, read by the chunk's own queries as a later chunk's do)."""
        pool = self.t.get("window")
        if pool is None:
            return kv
        end = p0 + kv.shape[0]
        lo = p0 if self.geo.boundary else max(p0, end - self.geo.window)
        stored = self._write("window", kv)
        pool[self._window_index(lo, end, pool.device)] = stored[lo - p0:]
        return self._read("window", stored)

    def load_state(self, name: str, p0: int) -> CompressorState:
        m, z = self.m, self.seq.tables.slot
        r, entries = p0 % m, p0 // m
        st = CompressorState(self.t[name + ".buf_kv"][z, :r], self.t[name + ".buf_gate"][z, :r], entries=entries)
        if name + ".prev_kv" in self.t and entries:
            st.prev_kv, st.prev_gate = self.t[name + ".prev_kv"][z], self.t[name + ".prev_gate"][z]
        if name + ".snap_kv" in self.t and self.seq.tables.snapshots:   # boundaries this step caches
            st.capture = {p // m - 1: row for p, row in self.seq.tables.snapshots}
        st.keep = self.seq.verifying
        return st

    def store_state(self, name: str, state: CompressorState, p_end: int) -> None:
        z, r = self.seq.tables.slot, p_end % self.m
        if state.buf_kv.shape[0] != r or state.entries != p_end // self.m:
            raise RuntimeError(f"compressor state of {state.buf_kv.shape[0]} rows / {state.entries} entries does not "
                               f"match position {p_end} (ratio {self.m})")
        self.t[name + ".buf_kv"][z, :r] = state.buf_kv
        self.t[name + ".buf_gate"][z, :r] = state.buf_gate
        if state.prev_kv is not None:
            self.t[name + ".prev_kv"][z] = state.prev_kv
            self.t[name + ".prev_gate"][z] = state.prev_gate
        for e, (kv, gate) in state.captured.items():   # the window that closed at a boundary: its overlap rows
            row = state.capture[e]
            self.t[name + ".snap_kv"][row], self.t[name + ".snap_gate"][row] = kv, gate
        if state.rewind is not None:
            self.seq.rewinds.append((self, name, state.rewind))

    def restore_state(self, row: int) -> None:
        """A prefix hit: the slot's CSA overlap rows from state row `row` (its boundary closed every window, so no
        compressor has open rows)."""
        z = self.seq.tables.slot
        for name in ("compressor", "index_compressor"):
            if name + ".snap_kv" in self.t:
                self.t[name + ".prev_kv"][z] = self.t[name + ".snap_kv"][row]
                self.t[name + ".prev_gate"][z] = self.t[name + ".snap_gate"][row]

    def _entry_index(self, stream: str, first: int, last: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries first .. last-1 of a compressed stream -> (blocks, rows) in its pool."""
        E, table = self.geo.rows(stream), self.seq.tables.full[stream]
        if -(-last // E) > len(table):
            raise RuntimeError(f"{stream} entries up to {last - 1} need {-(-last // E)} blocks, the sequence's "
                               f"table has {len(table)}")
        e = torch.arange(first, last)
        return torch.tensor(table, dtype=torch.int64)[e // E].to(device), (e % E).to(device)

    def append_entries(self, name: str, new: torch.Tensor, p0: int) -> torch.Tensor:
        first, pool, stream = p0 // self.m, self.t[name], self.stream_of[name]
        if new.shape[0]:
            pool[self._entry_index(stream, first, first + new.shape[0], pool.device)] = self._write(name, new)
        return self._read(name, pool[self._entry_index(stream, 0, first + new.shape[0], pool.device)])

    def _write(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        codec = self.codecs.get(name)
        return rows if codec is None else codec.quantize(rows)

    def _read(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        codec = self.codecs.get(name)
        return rows if codec is None else codec.dequantize(rows, self.dtype)

    def nbytes(self) -> int:
        """What this sequence holds of the layer: its slot's rows and its blocks (live window blocks included)."""
        z = self.seq.tables.slot
        held = sum(t[z].numel() * t.element_size() for n, t in self.t.items() if n not in self.stream_of)
        for n, st in self.stream_of.items():
            held += len(self.seq.tables.table(st)) * self.t[n][0].numel() * self.t[n].element_size()
        return held


class PagedSequence:
    """A sequence's views of every layer's pools, as SequenceStreams' `layers`; `tables` (its slot and block tables,
    kvstore/spec.py StreamTables) are the block manager's, read at each step.

    Speculative decoding: while `verifying` (a chunk of its last token and drafts), every compressor state stored
    leaves its Rewind here; rewind(p) then stores each one's state at position p, the tokens before p being the
    ones kept. Every other stream is addressed by position (window rows, entries), so the rejected drafts' rows there
    lie past p and are written again before any query reads them."""

    def __init__(self, pools: V4Pools, tables):
        self.tables = tables
        self.verifying = False
        self.rewinds: list[tuple[PagedLayerStreams, str, object]] = []
        self.layers = [PagedLayerStreams(pools, i, self) for i in range(len(pools.kinds))]

    def rewind(self, p: int | None) -> None:
        """Keep the tokens before position p of the chunk just verified (None: all of them) and stop verifying.
        A chunk cut in two (DBO) left two rewinds per compressor: the one whose rows reach p rebuilds it."""
        done = set()
        for view, name, rw in reversed(self.rewinds) if p is not None else ():
            key = (id(view), name)
            if key not in done and rw.start <= p <= rw.end:
                view.store_state(name, rw.state_at(p), p)
                done.add(key)
        self.rewinds, self.verifying = [], False
