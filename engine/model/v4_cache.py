"""DeepSeek-V4's KV cache as the engine uses it: its KV streams as paged pools (attention_v4/paged.py), one per
stream, each sequence's view of them, the step's V4Meta, and the pieces disaggregation moves (the KVCache interface,
engine/model/family.py; engine/model/mla_cache.py is the MLA family's).

The pools are allocated up front (attention_v4/pool_layout.py has the geometry, a KV spec): a slot per sequence
(max_num_seqs of them: the compressor states), a window pool (bs rows per block) sized for every slot's decode
window plus one step's tokens, and one pool per compressed stream (CSA: entries + indexer keys; HCA: entries;
max(1, bs // m) entries per block) sharing the rest of kv_cache_memory by their bytes per token. With
kv_cache_blocks N every pool holds the streams of N * bs tokens. The block manager (engine/sched/block_manager.py)
gives each sequence its slot and tables and counts every pool at admission; whenever it frees them (preempted:
the sequence recomputes every stream from its tokens; finished; aborted) the views here are dropped.
With prefix caching a `state` pool holds the CSA compressors' state at cached boundaries (one row per boundary,
pool_layout.py), sized like the compressed pools by its bytes per token; a sequence starting from a prefix hit gets
its streams here with the hit's tokens counted and its slot's state copied from the hit's state row.
kv_cache_dtype "fp8" packs the window, compressed and indexer-key pools (attention_v4/fp8.py); the bytes per block
count the packed entries (fp4 caches are refused with V4: engine/model/v4_family.py). The KV tiers move each stream's
blocks (stream_pools; kvstore/store.py). A DBO
step may cut a sequence's chunk in two, one part per microbatch: the second part's meta starts past the first's
(attention_v4/streams.py V4Meta), and the streams advance once both have run. Speculative decoding: a verification
is one chunk of the sequence's last token and its drafts; after it the streams keep the accepted ones (sampled).
"""
from __future__ import annotations

import torch

from wideep.attention_mla.meta import int64_tensor
from wideep.attention_v4.fp8 import check_v4_kv_cache_dtype, v4_codecs
from wideep.attention_v4.paged import PagedSequence, V4Pools
from wideep.attention_v4.pool_layout import v4_kv_spec
from wideep.attention_v4.streams import SequenceStreams, V4Meta
from wideep.attention_v4.transfer import gather, scatter, staging


class V4StreamCache:
    """This rank's V4 pools and the sequences' views, by request id. Has what the engine reads of a KV cache
    (spec, block_size, num_blocks (here per stream), pools (the MLA path's: none), bytes_per_token, kv_cache_dtype)."""

    pools: list = []
    index_pools = None
    fp8 = None   # the MLA path's latent layout: none here (V4's packed entries are the pools' `codecs`)

    def __init__(self, model, memory: int | None, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, num_blocks: int | dict[str, int] | None = None,
                 prefix_caching: bool = False, kv_cache_dtype: str = "auto", mtp_layers: int = 0):
        """num_blocks: None (size from memory), N (every pool holds N * block_size tokens' streams) or
        stream -> blocks. kv_cache_dtype: "auto" (the model dtype) | "fp8" (attention_v4/fp8.py). mtp_layers: the
        MTP blocks that draft (speculative method "mtp"): their streams are layers L, L + 1, ... of every pool."""
        v4, elt = model.cfg.v4, torch.empty(0, dtype=model.dtype).element_size()
        att, kinds = v4.attention, v4.layer_kinds + v4.mtp_layer_kinds[:mtp_layers]
        self.model, self.block_size = model, block_size
        self.kv_cache_dtype = check_v4_kv_cache_dtype(kv_cache_dtype)
        g = self.spec = v4_kv_spec(att, kinds, block_size, prefix_caching)
        self.per_block = V4Pools.bytes_per_block(att, kinds, g, elt, v4_codecs(att, kv_cache_dtype, model.dtype))
        self.per_slot = V4Pools.bytes_per_slot(att, kinds, g, elt)
        if isinstance(num_blocks, int):
            num_blocks = {s: -(-num_blocks * block_size // g.tokens_per_block(s)) for s in g.streams}
        elif num_blocks is None:
            num_blocks = self._from_memory(memory, max_num_seqs, max_model_len, max_num_batched_tokens)
        self.num_blocks = dict(num_blocks)
        self.kv = V4Pools(att, kinds, g, self.num_blocks, max_num_seqs, model.device, model.dtype, kv_cache_dtype)
        self.streams: dict[str, SequenceStreams] = {}

    def _from_memory(self, memory: int, Z: int, L: int, budget: int) -> dict[str, int]:
        """Slots and windows first (what every sequence holds whatever its length: at short contexts they
        dominate), then the compressed pools in proportion to their bytes per token, at most what Z sequences of L
        tokens fill."""
        g = self.spec
        out = {}
        if g.window:   # with prefix caching as many again: cached prefixes' window tails
            out["window"] = max(Z * g.decode_window() * (1 + (g.boundary > 0)) + -(-budget // g.block_size) + 1,
                                g.peak(L, budget, True)["window"])
        fixed = Z * self.per_slot + out.get("window", 0) * self.per_block.get("window", 0)
        if memory < fixed:
            raise ValueError(f"kv_cache_memory ({memory} bytes) is less than the DeepSeek-V4 streams every "
                             f"sequence holds whatever its length: max_num_seqs ({Z}) slots of {self.per_slot} bytes "
                             f"and {out.get('window', 0)} window blocks of {self.per_block.get('window', 0)} bytes "
                             f"= {fixed}")
        grown = [s for s in g.streams if s != "window"]   # the compressed pools (and boundary states)
        rate = sum(self.per_block[s] / g.tokens_per_block(s) for s in grown)   # bytes per token
        tokens = min(Z * L, int((memory - fixed) / rate)) if rate else 0
        least = max((g.tokens_per_block(s) for s in g.full), default=0)
        if tokens < least:
            raise ValueError(f"kv_cache_memory ({memory} bytes) leaves {memory - fixed} bytes past the slots and "
                             f"windows every sequence holds ({fixed}), less than one block of each compressed stream "
                             f"({round(least * rate)} bytes)")
        for s in g.full:
            out[s] = max(1, min(tokens // g.tokens_per_block(s), Z * g.entry_blocks(s, L)))
        if "state" in g.streams:
            out["state"] = max(1, min(tokens, Z * L) // g.boundary)
        return out

    @property
    def per_seq(self) -> int:
        """Bytes a decoding sequence holds whatever its length: its slot and its window blocks."""
        return self.per_slot + self.spec.decode_window() * self.per_block.get("window", 0)

    def bytes_per_token(self) -> float:
        """Compressed-stream bytes per token, all layers (a sequence's slot and window are `per_seq` more)."""
        g = self.spec
        return sum(self.per_block[s] / g.tokens_per_block(s) for s in g.full)

    def for_seq(self, seq) -> SequenceStreams:
        """The streams of a sequence about to run from token seq.num_computed (0: new, or recomputing)."""
        if seq.stream_tables is None:
            raise RuntimeError(f"request {seq.request_id!r} runs without DeepSeek-V4 stream tables (the block "
                               f"manager grows them before its step)")
        st = self.streams.get(seq.request_id)
        restore = seq.stream_tables.restore
        if restore is not None and st is None:   # a prefix hit: the cached blocks hold its first num_computed tokens
            st = self.streams[seq.request_id] = SequenceStreams(self.views(seq), num_tokens=seq.num_computed)
            if restore >= 0:
                for layer in st.layers:
                    layer.restore_state(restore)
        elif st is None or (seq.num_computed == 0 and st.num_tokens):   # new, or recomputing from the start
            if seq.num_computed:
                raise RuntimeError(f"request {seq.request_id!r} resumes at token {seq.num_computed} but its "
                                   f"DeepSeek-V4 streams are gone")
            st = self.streams[seq.request_id] = SequenceStreams(self.views(seq))
        if st.num_tokens != seq.num_computed:
            raise RuntimeError(f"request {seq.request_id!r}: its streams hold {st.num_tokens} tokens, the scheduler "
                               f"says {seq.num_computed} are computed")
        st.layers[0].seq.tables = seq.stream_tables
        return st

    def views(self, seq) -> list:
        """Every layer's view of a sequence's slot and blocks (attention_v4/paged.py), for moving its rows."""
        return PagedSequence(self.kv, seq.stream_tables).layers

    def adopt(self, seq) -> None:
        """A sequence whose streams were written from elsewhere (a disaggregated prefill): its first num_computed
        tokens are in its blocks and slot."""
        self.streams[seq.request_id] = SequenceStreams(self.views(seq), num_tokens=seq.num_computed)

    def drop(self, seq) -> None:
        self.streams.pop(seq.request_id, None)

    def nbytes(self) -> int:
        """What the running sequences hold of the pools."""
        return sum(s.nbytes() for s in self.streams.values())

    def stream_pools(self) -> dict[str, list[torch.Tensor]]:
        """stream -> every layer's block tensors of it, [N_s, ...] each (what the KV tiers move)."""
        out = {s: [] for s in self.spec.streams}
        for layer, streams in zip(self.kv.layers, self.kv.stream_of):
            for name, s in streams.items():
                out[s].append(layer[name])
        return out

    # -- a step's inputs ------------------------------------------------------------------------------
    def step_inputs(self, batch, parts: list[tuple[int, int, int]] | None = None) -> tuple[torch.Tensor, V4Meta]:
        """-> input_ids [T], the V4Meta of the batch (each sequence's streams), or of `parts` of it ((b, lo, hi):
        tokens lo..hi-1 of sequence b's tokens this step)."""
        if parts is None:
            parts = [(b, 0, n) for b, n in enumerate(batch.num_tokens)]
        ids, lens, streams, offsets = [], [], [], []
        for b, lo, hi in parts:
            s = batch.seqs[b]
            st = self.for_seq(s)
            streams.append(st)
            if s.draft_token_ids:   # a verification: its last token and its drafts, one chunk
                ids.extend((s.tokens(s.num_computed, s.num_computed + 1) + s.draft_token_ids)[lo:hi])
                st.layers[0].seq.verifying = True
            else:
                ids.extend(s.tokens(s.num_computed + lo, s.num_computed + hi))
            lens.append(hi - lo)
            offsets.append(lo)
        return int64_tensor(ids, self.model.device), V4Meta.build(lens, streams, self.model.device, offsets)

    def after_sampling(self, batch, result) -> None:
        """Each verification's streams keep its last token and the accepted drafts only: the compressors' states go
        back to the first rejected draft (attention_v4/paged.py PagedSequence.rewind) and the streams count the kept
        tokens, as the scheduler's num_computed will (the MTP drafter, next, reads them so)."""
        for b, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if s.draft_token_ids:
                keep = 1 + len(result.accepted[b].tokens)
                st = self.streams[s.request_id]
                st.layers[0].seq.rewind(s.num_computed + keep if keep < n else None)
                st.num_tokens = s.num_computed + keep

    def after_split(self, batch) -> None:
        """A step run as two microbatches: both parts of each sequence's chunk are in its streams now (the model's
        forward advances them on plain steps)."""
        for s, n in zip(batch.seqs, batch.num_tokens):
            self.streams[s.request_id].num_tokens += n

    # -- what disaggregation moves (attention_v4/transfer.py) -------------------------------------------------
    @property
    def transfer_layers(self) -> int:
        """The layers whose pieces a transfer moves: every layer of the pools."""
        return len(self.kv.layers)

    def chunk(self, seq, lo: int, hi: int, last: bool = False) -> tuple:
        """Tokens lo .. hi-1 of `seq` (`last`: the prompt's last chunk, which also moves the window and the
        compressor states): (the layers' views of its blocks, lo, hi, last)."""
        return self.views(seq), lo, hi, last

    def gather(self, chunk: tuple, layer: int) -> list[torch.Tensor]:
        views, lo, hi, last = chunk
        return gather(views[layer], lo, hi, last)

    def staging(self, chunk: tuple, layer: int) -> list[torch.Tensor]:
        views, lo, hi, last = chunk
        return staging(views[layer], lo, hi, last)

    def scatter(self, chunk: tuple, layer: int, rows: list[torch.Tensor]) -> None:
        views, lo, hi, last = chunk
        scatter(views[layer], rows, lo, hi, last)

    def receiving(self, seq, num_tokens: int) -> None:
        """A prompt of num_tokens about to be received into seq's blocks: the window's head, which no chunk writes
        (only the last W' rows travel), is marked unwritten."""
        seq.stream_tables.first_written = max(0, num_tokens - self.spec.window)

    def describe(self) -> dict:
        """What two caches must agree on to move pieces between them, and how much prompt they hold: the tokens the
        smallest compressed pool holds."""
        g = self.spec
        held = min(self.num_blocks[s] * g.tokens_per_block(s) for s in g.full) if g.full else 1 << 62
        return {"blocks": held // self.block_size, "block_size": self.block_size,
                "dtype": f"{self.model.dtype} ({self.kv_cache_dtype})",
                "layout": f"DeepSeek-V4 streams {list(g.streams)}, indexer key "
                          f"{self.model.cfg.v4.attention.index_head_dim}, {len(self.kv.layers)} layers"}

    def block_bytes(self) -> dict[str, int]:
        """stream -> the bytes one of its blocks takes over all layers."""
        return dict(self.per_block)
