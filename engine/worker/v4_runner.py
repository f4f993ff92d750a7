"""DeepSeek-V4 in the engine: its KV streams as pools (attention_v4/paged.py) and the runner that hands each
sequence's view of them to the model.

The pools are allocated up front: a slot per sequence (max_num_seqs of them: the window ring, the compressor
states — what a sequence holds whatever its length) and, per token block of the block manager, the rows of the
compressed entries and indexer keys its tokens close. Admission counts exactly those bytes: kv_cache_memory
pays the slots first, the rest is blocks. A sequence takes a slot when it first runs and gives it back whenever
its blocks are freed (preempted: it recomputes every stream from its tokens; finished; aborted).
Prefix caching, the KV tiers, disaggregation and fp8 caches are refused with V4 (engine/worker/core.py). A DBO
step may cut a sequence's chunk in two, one part per microbatch: the second part's meta starts past the first's
(attention_v4/streams.py V4Meta), and the streams advance once both have run.
"""
from __future__ import annotations

import torch

from attention_mla.meta import int64_tensor
from attention_v4.paged import PagedSequence, V4Pools
from attention_v4.streams import SequenceStreams, V4Meta

from ..sched.scheduler import ScheduledBatch
from .runner import ModelRunner


class V4StreamCache:
    """This rank's V4 pools and the sequences' views, by request id. Has what the engine reads of a KV cache
    (block_size, num_blocks, pools (the MLA path's: none), bytes_per_token, kv_cache_dtype)."""

    pools: list = []
    index_pools = None
    fp8 = None
    kv_cache_dtype = "auto"

    def __init__(self, model, memory: int | None, block_size: int, max_num_seqs: int, max_model_len: int,
                 num_blocks: int | None = None):
        v4, elt = model.cfg.v4, torch.empty(0, dtype=model.dtype).element_size()
        self.model, self.block_size = model, block_size
        self.per_block = V4Pools.bytes_per_block(v4.attention, v4.layer_kinds, block_size, elt)
        self.per_seq = V4Pools.bytes_per_slot(v4.attention, v4.layer_kinds, block_size, elt)
        if num_blocks is None:
            reserved = max_num_seqs * self.per_seq
            if memory < reserved:
                raise ValueError(f"kv_cache_memory ({memory} bytes) is less than the DeepSeek-V4 streams every "
                                 f"sequence holds whatever its length ({self.per_seq} bytes) times max_num_seqs "
                                 f"({max_num_seqs}) = {reserved}")
            want = max_num_seqs * -(-max_model_len // block_size)
            num_blocks = max(1, min(want, (memory - reserved) // max(self.per_block, 1)))
        self.num_blocks = num_blocks
        self.kv = V4Pools(v4.attention, v4.layer_kinds, num_blocks, block_size, max_num_seqs, model.device,
                          model.dtype)
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.streams: dict[str, SequenceStreams] = {}
        self._slot: dict[str, PagedSequence] = {}

    def bytes_per_token(self) -> float:
        """Block bytes per token, all layers (a sequence's slot is `per_seq` more)."""
        return self.per_block / self.block_size

    def for_seq(self, seq) -> SequenceStreams:
        """The streams of a sequence about to run from token seq.num_computed (0: new, or recomputing)."""
        st = self.streams.get(seq.request_id)
        if st is None or (seq.num_computed == 0 and st.num_tokens):   # new, or recomputing from the start
            if seq.num_computed:
                raise RuntimeError(f"request {seq.request_id!r} resumes at token {seq.num_computed} but its "
                                   f"DeepSeek-V4 streams are gone")
            self.drop(seq)
            if not self._free_slots:
                raise RuntimeError(f"no free DeepSeek-V4 stream slot for request {seq.request_id!r}: more than "
                                   f"{self.kv.num_slots} (max_num_seqs) sequences are running")
            paged = self._slot[seq.request_id] = PagedSequence(self.kv, self._free_slots.pop(), seq.block_ids)
            st = self.streams[seq.request_id] = SequenceStreams(paged.layers)
        if st.num_tokens != seq.num_computed:
            raise RuntimeError(f"request {seq.request_id!r}: its streams hold {st.num_tokens} tokens, the scheduler "
                               f"says {seq.num_computed} are computed")
        self._slot[seq.request_id].block_ids = seq.block_ids   # grown by the scheduler for this step's tokens
        return st

    def drop(self, seq) -> None:
        self.streams.pop(seq.request_id, None)
        paged = self._slot.pop(seq.request_id, None)
        if paged is not None:
            self._free_slots.append(paged.slot)

    def nbytes(self) -> int:
        """What the running sequences hold of the pools."""
        return sum(s.nbytes() for s in self.streams.values())

    def all_pools(self):
        raise ValueError("DeepSeek-V4's streams have no KV tiers yet")


class V4Runner(ModelRunner):
    """ModelRunner whose step metadata is a V4Meta (each sequence's streams) instead of block tables."""

    def build_meta(self, batch: ScheduledBatch, parts: list[tuple[int, int, int]] | None = None
                   ) -> tuple[torch.Tensor, V4Meta]:
        if parts is None:
            parts = [(b, 0, n) for b, n in enumerate(batch.num_tokens)]
        ids, lens, streams, offsets = [], [], [], []
        for b, lo, hi in parts:
            s = batch.seqs[b]
            streams.append(self.kv.for_seq(s))
            ids.extend(s.tokens(s.num_computed + lo, s.num_computed + hi))
            lens.append(hi - lo)
            offsets.append(lo)
        return int64_tensor(ids, self.device), V4Meta.build(lens, streams, self.device, offsets)

    def _forward_split(self, batch: ScheduledBatch, plan) -> torch.Tensor:
        hidden = super()._forward_split(batch, plan)
        for s, n in zip(batch.seqs, batch.num_tokens):   # both microbatches' parts are in the streams now
            self.kv.streams[s.request_id].num_tokens += n
        return hidden
