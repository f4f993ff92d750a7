"""Per-step attention metadata: an argument of every forward, never a global.

Legend: T tokens in the step (all sequences flattened), B sequences, M max blocks per sequence.
Sequence b contributes query_lens[b] consecutive tokens; after this step's writes it has
ctx_lens[b] tokens in the cache, so its tokens sit at positions ctx_lens[b]-query_lens[b] ... ctx_lens[b]-1.
A cache slot is block_id * block_size + offset in the layer's pool.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import chain

import torch


def int64_tensor(values: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Host ints as an int64 tensor [len(values)], through array('q') (one C loop): several times
    faster than torch.tensor on a list, which the per-step metadata of big batches pays for."""
    t = torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


@dataclass
class AttnMeta:
    positions: torch.Tensor     # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each token's latent is written
    block_table: torch.Tensor   # [B, M] int64 block ids (padding entries point at block 0)
    query_lens: list[int]       # [B] host ints
    ctx_lens: list[int]         # [B] host ints
    block_size: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def query_starts(self) -> list[int]:
        """[B] each sequence's first row in the step (computed once: every layer asks)."""
        if "starts" not in self._cache:
            starts, s = [], 0
            for q in self.query_lens:
                starts.append(s)
                s += q
            self._cache["starts"] = starts
        return self._cache["starts"]

    def attention_split(self, mode: str, paged: bool, chunk: int = 1) -> tuple[list[int], list[int], list[int]]:
        """Which sequences each attention form serves this step -> (paged, absorbed, naive), computed
        once per step (every layer asks; the per-sequence work is not repeated per layer). mode
        "absorbed" / "naive" forces that form for every query; otherwise ("auto") a sequence of at most
        `chunk` query tokens (1: a decode) is absorbed and a longer one naive. With `paged`, the absorbed
        sequences of at most `chunk` query tokens go to the paged decode kernel instead, one kernel row a
        query token (token_tables). Sequences without a query this step are in none."""
        key = ("split", mode, paged, chunk)
        if key not in self._cache:
            qlens = self.query_lens
            if mode == "naive":
                absorbed = []
            elif mode == "absorbed":
                absorbed = [b for b, q in enumerate(qlens) if q]
            else:
                absorbed = [b for b, q in enumerate(qlens) if 0 < q <= chunk]
            on_pages = [b for b in absorbed if qlens[b] <= chunk] if paged else []
            if on_pages:
                absorbed = [b for b in absorbed if qlens[b] > chunk]
            if len(on_pages) + len(absorbed) == len(qlens):
                naive = []
            else:
                done = set(absorbed) | set(on_pages)
                naive = [b for b, q in enumerate(qlens) if q and b not in done]
            self._cache[key] = (on_pages, absorbed, naive)
        return self._cache[key]

    def seq_tables(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For the paged kernels: (block_table rows of `seqs` [len(seqs), M], ctx_lens [len(seqs)] int32
        on the table's device, max ctx_len as a host int)."""
        key = ("tables", tuple(seqs))
        if key not in self._cache:
            lens = [self.ctx_lens[b] for b in seqs]
            table = self.block_table if list(seqs) == list(range(self.block_table.shape[0])) else self.block_table[seqs]
            self._cache[key] = (table.contiguous(), int64_tensor(lens, table.device).int(), max(lens, default=0))
        return self._cache[key]

    def token_tables(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For the paged kernels, one kernel row a query token of `seqs` (in query_rows order): (its sequence's
        block_table row [T', M], the keys it sees [T'] int32: its position + 1, the cache written before it
        attends, max of those as a host int). seq_tables when every one of `seqs` has one query."""
        qlens = self.query_lens
        if all(qlens[b] == 1 for b in seqs):
            return self.seq_tables(seqs)
        key = ("token_tables", tuple(seqs))
        if key not in self._cache:
            ctx, bt = self.ctx_lens, self.block_table
            lens = [ctx[b] - qlens[b] + j + 1 for b in seqs for j in range(qlens[b])]
            table = bt[int64_tensor([b for b in seqs for _ in range(qlens[b])], bt.device)]   # each token's row
            self._cache[key] = (table, int64_tensor(lens, bt.device).int(), max(lens, default=0))
        return self._cache[key]

    def paged_decode_tables(self, mode: str, chunk: int = 1):
        """When every token of the step is a query on the paged kernels (attention_split(mode, True, chunk); chunk
        1: each the only query of its sequence) and the slots are int64 and contiguous -> token_tables of those
        sequences, else None. Computed once per step (a fused decode asks for every layer)."""
        key = ("paged_decode", mode, chunk)
        if key not in self._cache:
            T, slots = self.slot_mapping.shape[0], self.slot_mapping
            ok = T > 0 and slots.dtype == torch.int64 and slots.is_contiguous()
            paged = self.attention_split(mode, True, chunk)[0] if ok else []
            ok = ok and sum(self.query_lens[b] for b in paged) == T
            self._cache[key] = self.token_tables(paged) if ok else None
        return self._cache[key]

    def context_slots(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of the whole context of the given sequences, padded: ([len(seqs), Lmax] int64,
        lens [len(seqs)] int64). Padding slots point at slot 0 (always finite memory)."""
        key = ("ctx", tuple(seqs))
        if key not in self._cache:
            lens = [self.ctx_lens[b] for b in seqs]
            lmax = max(lens) if lens else 0
            pos = torch.arange(lmax, device=self.block_table.device)
            bt = self.block_table[seqs]                                          # [S, M]
            nblk = -(-lmax // self.block_size)
            blocks = bt[:, :nblk].repeat_interleave(self.block_size, dim=1)[:, :lmax]  # [S, Lmax]
            slots = blocks * self.block_size + (pos % self.block_size)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=slots.device)
            slots = torch.where(pos[None, :] < lens_t[:, None], slots, torch.zeros_like(slots))
            self._cache[key] = (slots, lens_t)
        return self._cache[key]

    def query_rows(self, seqs: list[int], device: torch.device) -> torch.Tensor:
        """The step's rows of every query token of `seqs`, in order: [T'] int64 on `device`."""
        starts, qlens = self.query_starts, self.query_lens
        return int64_tensor([r for b in seqs for r in range(starts[b], starts[b] + qlens[b])], device)

    def query_context_slots(self, seqs: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token of `seqs`, in order: (its row in the step [T'] on `device`, its sequence's
        context slots [T', Lmax] as context_slots gives them, repeated per token where a sequence has
        several queries)."""
        rows = self.query_rows(seqs, device)
        slots, _ = self.context_slots(seqs)
        if len(rows) != len(seqs):
            qlens = torch.tensor([self.query_lens[b] for b in seqs], device=slots.device)
            slots = slots[torch.repeat_interleave(torch.arange(len(seqs), device=slots.device), qlens)]
        return rows, slots


def attn_meta(pos: list[int], slots: list[int], ctx_lens: list[int], qlens: list[int], tables: list[list[int]],
              block_size: int, device) -> AttnMeta:
    """Host lists -> AttnMeta (tables padded to the longest with block 0)."""
    lens = list(map(len, tables))
    width = max(lens, default=1)
    if lens and min(lens) == width:   # every table as long (a decode run, mostly): one C-level flatten
        table = list(chain.from_iterable(tables))
    else:
        table = [b for t in tables for b in (t if len(t) == width else t + [0] * (width - len(t)))]
    return AttnMeta(positions=int64_tensor(pos, device), slot_mapping=int64_tensor(slots, device),
                    block_table=int64_tensor(table, device).view(len(tables), width),
                    query_lens=qlens, ctx_lens=ctx_lens, block_size=block_size)
