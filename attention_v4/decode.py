"""DeepSeek-V4 attention for a decode step, batched over its sequences (V4Attention.forward's fast path).

attention.py's reference walks the step one sequence at a time (its window, compressor state, indexer and attention
as torch ops per sequence); a decode step of B sequences then pays B times the Python and the small ops of every
layer, and runs each compressor's projections B times on one row. Here every chunk is one token, so every per-sequence
quantity is a row of a batch:
    window      the token's row written to its block, then rows p-W' .. p of every sequence gathered [B, W'+1, D]
    compressor  wkv / wgate on the B rows at once; tokens whose window stays open write row p % m of their slot's
                buffer; tokens that close it (p % m == m-1) form the entry from the buffer's m-1 rows and their own
                (CSA: with the previous window's overlap rows), normalised and rotated at position (p // m) * m, and
                write it to entry p // m of the stream's pool (with prefix caching, a boundary's overlap rows to its
                state row, as the reference captures them)
    indexer     CSA: the index keys of every sequence gathered [B, S_max, DI], scored per query, the top k kept
    attention   one softmax over [window | compressed entries (HCA: all visible; CSA: the picked) | sink] per head
The pools, the tables and the counts are the ones the reference reads and writes (attention_v4/paged.py), so a step
taken here and one taken there leave the same streams; the results are equal to float rounding (the projections see
B rows instead of one; tests/attention_v4/test_decode.py). Steps it does not take (any chunk of more than one token,
the dense reference streams, a speculative chunk being verified) run the reference.

Legend: B tokens (= sequences), N heads, D head_dim, W' = sliding_window - 1, bs block size, m a ratio, E entries per
block, S_b entries sequence b sees after the step, C a compressor's width.
"""
from __future__ import annotations

import torch

from .compressor import apply_rope_tail
from .paged import PagedLayerStreams


def batchable(meta, layer: int) -> bool:
    """Whether the step's chunks at `layer` can run here: one token each, on paged streams, none being verified."""
    if not meta.lens or any(n != 1 for n in meta.lens):
        return False
    return all(isinstance(s.layers[layer], PagedLayerStreams) and not s.layers[layer].seq.verifying
               for s in meta.streams)


class StepIndex:
    """Per step (shared by the layers: one table per stream serves every layer of its kind): the tokens' positions,
    slots and pool addresses."""

    def __init__(self, meta, view: PagedLayerStreams):
        geo, dev = view.geo, meta.positions.device
        self.positions = meta.positions.to(torch.int64)
        self.p = [int(f) for f in meta.first]
        tables = [s.layers[0].seq.tables for s in meta.streams]
        self.tables = tables
        self.slots = torch.tensor([t.slot for t in tables], dtype=torch.int64, device=dev)
        self.bs, self.Wr = geo.block_size, geo.window
        self.geo, self.device = geo, dev
        self._window = None
        self._entries: dict[str, tuple] = {}

    def window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (blocks [B, W'+1], rows [B, W'+1], position [B, W'+1] of each read row (p - W' .. p), the write
        address (block [B], row [B]) is column W')."""
        if self._window is None:
            bs, Wr = self.bs, self.Wr
            span = (Wr + bs - 1) // bs + 1   # logical blocks rows p - W' .. p can lie in
            tab = []   # per sequence: the pool blocks of logical blocks first .. first + span - 1 (-1: none)
            for p, t in zip(self.p, self.tables):
                if p // bs not in t.window:
                    raise RuntimeError(f"window block {p // bs} of token {p} is not in the sequence's table "
                                       f"{sorted(t.window)}")
                first = max(p - Wr, 0) // bs
                tab.append([t.window.get(j, -1) for j in range(first, first + span)])
            tab = torch.tensor(tab, dtype=torch.int64, device=self.device)
            pos = self.positions[:, None] + torch.arange(-Wr, 1, device=self.device)[None, :]     # [B, W'+1]
            first = (pos[:, :1].clamp(min=0) // bs)
            blocks = tab.gather(1, (pos.clamp(min=0) // bs - first).clamp(max=span - 1))
            blocks = blocks.masked_fill(pos < 0, -1)   # (rows before the sequence: never read)
            self._window = (blocks, pos % bs, pos, blocks >= 0)
        return self._window

    def entries(self, stream: str, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A compressed stream's entries every token sees after the step: (blocks [B, S_max], rows [B, S_max],
        seen [B, S_max]); S_b = (p + 1) // m."""
        got = self._entries.get(stream)
        if got is None:
            E = self.geo.rows(stream)
            counts = [(p + 1) // m for p in self.p]
            S, nb = max(counts), [-(-c // E) for c in counts]
            tab = []   # per sequence: its table's first blocks, as many as its entries fill (padded with block 0)
            for c, n, t in zip(counts, nb, self.tables):
                table = t.full[stream]
                if n > len(table):
                    raise RuntimeError(f"{stream} entries up to {c - 1} need {n} blocks, the sequence's table has "
                                       f"{len(table)}")
                tab.append(table[:n] + [0] * (max(nb) - n))
            e = torch.arange(S, device=self.device)
            seen = e[None, :] < torch.tensor(counts, device=self.device)[:, None]
            tab = torch.tensor(tab, dtype=torch.int64, device=self.device).view(len(counts), max(nb))
            blocks = tab.gather(1, (e // E)[None, :].expand(len(counts), S)) if S else tab[:, :0]
            got = (blocks, (e % E)[None, :].expand(len(counts), S), seen)
            self._entries[stream] = got
        return got


def step_index(meta, view: PagedLayerStreams) -> StepIndex:
    idx = meta.cache.get("v4_decode")
    if idx is None:
        idx = meta.cache["v4_decode"] = StepIndex(meta, view)
    return idx


def compress(comp, x: torch.Tensor, views: list, name: str, idx: StepIndex, rope) -> None:
    """The compressor `comp` (state `name`: "compressor" / "index_compressor") takes each sequence's token x [B, H]:
    open windows buffer it, closing ones write their entry to the stream's pool (see the module's legend)."""
    t, m, D = views[0].t, comp.ratio, comp.dim
    kv, gate = comp.wkv(x), comp.wgate(x)                                       # [B, C]
    r = idx.positions % m
    z = idx.slots
    closing = r == m - 1
    if not bool(closing.all()):
        o = (~closing).nonzero().squeeze(1)
        t[name + ".buf_kv"][z[o], r[o]] = kv[o]
        t[name + ".buf_gate"][z[o], r[o]] = gate[o]
    if not bool(closing.any()):
        return
    c = closing.nonzero().squeeze(1)
    zc, e = z[c], idx.positions[c] // m                                         # e: the entry each one closes
    rows_kv = torch.cat([t[name + ".buf_kv"][zc, :m - 1], kv[c, None]], dim=1)          # [Bc, m, C]
    rows_gate = torch.cat([t[name + ".buf_gate"][zc, :m - 1], gate[c, None]], dim=1) + comp.ape.to(gate.dtype)
    if comp.overlap:
        has = (e > 0)[:, None, None]
        prev_kv = torch.where(has, t[name + ".prev_kv"][zc], torch.zeros((), dtype=kv.dtype))
        prev_gate = torch.where(has, t[name + ".prev_gate"][zc], torch.full((), float("-inf"), dtype=gate.dtype))
        t[name + ".prev_kv"][zc] = rows_kv[:, :, :D]
        t[name + ".prev_gate"][zc] = rows_gate[:, :, :D]
        if name + ".snap_kv" in t:   # prefix caching: a boundary closing now keeps its overlap rows in a state row
            for i, b in enumerate(c.tolist()):
                for P, row in idx.tables[b].snapshots:
                    if P // m - 1 == idx.p[b] // m:
                        t[name + ".snap_kv"][row] = rows_kv[i, :, :D]
                        t[name + ".snap_gate"][row] = rows_gate[i, :, :D]
        rows_kv = torch.cat([prev_kv, rows_kv[..., D:]], dim=1)                  # [Bc, 2m, D]
        rows_gate = torch.cat([prev_gate, rows_gate[..., D:]], dim=1)
    weights = rows_gate.softmax(dim=1, dtype=torch.float32).to(rows_kv.dtype)
    entries = comp.norm((rows_kv * weights).sum(dim=1))                          # [Bc, D]
    cos, sin = rope.cos_sin(e * m, max_position=max(idx.p[b] for b in c.tolist()))
    entries = apply_rope_tail(entries, cos, sin, rope)
    pool_name = "compressed" if name == "compressor" else "index_keys"
    blocks, rows, _ = idx.entries(views[0].stream_of[pool_name], m)   # (entry e of a closing token: its last seen)
    t[pool_name][blocks[c, e], rows[c, e]] = views[0]._write(pool_name, entries)


def attend(attn, x: torch.Tensor, q_lat: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, meta, layer: int, cos,
           sin) -> torch.Tensor:
    """V4Attention's per-sequence part for a decode step: x [B, H], q_lat [B, Q], q [B, N, D], kv [B, D] (rotated)
    -> o [B, N, D] (still rotated); every sequence's streams of `layer` take its token."""
    cfg, B = attn.cfg, x.shape[0]
    views = [s.layers[layer] for s in meta.streams]
    v0, t = views[0], views[0].t
    idx = step_index(meta, v0)
    pool = t.get("window")
    if pool is None:   # no window stream (W' = 0): the token sees its own row
        keys, key_ok = kv[:, None].float(), torch.ones(B, 1, dtype=torch.bool, device=x.device)
    else:
        blocks, rows, pos, ok = idx.window()
        pool[blocks[:, -1], rows[:, -1]] = v0._write("window", kv)
        floors = torch.tensor([v.floor for v in views], device=x.device)
        key_ok = ok & (pos >= floors[:, None])
        keys = v0._read("window", pool[blocks.clamp(min=0), rows]).float()      # [B, W'+1, D]
        keys = keys.masked_fill_(~key_ok[..., None], 0)   # (rows not read: whatever they hold weighs nothing)
    scale = cfg.head_dim ** -0.5
    qf = q.float()
    parts = [torch.einsum("bnd,bkd->bnk", qf, keys).mul_(scale).masked_fill_(~key_ok[:, None], float("-inf"))]
    values = [keys]
    if attn.compressor is not None:
        m = attn.compressor.ratio
        compress(attn.compressor, x, views, "compressor", idx, attn.rope)
        blocks, rows, seen = idx.entries(attn.kind, m)
        entries = v0._read("compressed", t["compressed"][blocks, rows]).float()   # [B, S_max, D]
        entries = entries.masked_fill_(~seen[..., None], 0)
        if attn.indexer is not None:
            ix = attn.indexer
            compress(ix.compressor, x, views, "index_compressor", idx, attn.rope)
            top, valid = select(ix, x, q_lat, v0._read("index_keys", t["index_keys"][blocks, rows]), seen, cos, sin,
                                attn.rope)
            entries = entries.gather(1, top[..., None].expand(-1, -1, entries.shape[-1]))   # [B, k, D]
            seen = valid
        parts.append(torch.einsum("bnd,bkd->bnk", qf, entries).mul_(scale).masked_fill_(~seen[:, None],
                                                                                         float("-inf")))
        values.append(entries)
    parts.append(attn.attn_sink.float().view(1, -1, 1).expand(B, -1, 1))
    probs = torch.cat(parts, dim=-1).softmax(-1)                                # [B, N, K + 1]
    out, k0 = None, 0
    for v in values:
        o = torch.einsum("bnk,bkd->bnd", probs[..., k0:k0 + v.shape[1]], v)
        out = o if out is None else out.add_(o)
        k0 += v.shape[1]
    return out.to(q.dtype)


def select(ix, x: torch.Tensor, q_lat: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, cos, sin, rope):
    """The indexer's pick for each decode token: keys [B, S_max, DI] (seen [B, S_max]) -> (top [B, k'] entry ids,
    valid [B, k']), k' = min(index_topk, S_max) (indexer.py Indexer.select, per row)."""
    B, S = x.shape[0], keys.shape[1]
    keys = keys.masked_fill(~seen[..., None], 0)
    if S == 0:
        return torch.zeros(B, 0, dtype=torch.int64, device=x.device), seen
    qi = apply_rope_tail(ix.wq_b(q_lat).view(B, ix.heads, ix.head_dim), cos, sin, rope).float()
    w = ix.weights_proj(x).float() * (ix.heads ** -0.5 * ix.head_dim ** -0.5)    # [B, NI]
    scores = torch.einsum("bhd,bsd->bhs", qi, keys.float()).relu_()
    scores = torch.einsum("bhs,bh->bs", scores, w).masked_fill_(~seen, float("-inf"))
    top = scores.topk(min(ix.topk, S), dim=-1).indices
    return top, seen.gather(1, top)
