"""The MLA family's KV cache as the engine uses it: the paged latent pools (attention_mla/kv_cache.py), one per
layer (the MTP drafter's layer last), plus DSA's indexer-key pools in the same slots; the step's metadata built
from the sequences' block tables; and the rows disaggregation moves.

Legend: T tokens this step, B sequences, L cached layers, D latent (C + R), Dk indexer key.
What the engine reads of any family's cache (the KVCache interface, engine/model/family.py):
    step_inputs(batch, parts) -> (input_ids [T], AttnMeta)     the model's inputs for a step or a microbatch
    after_sampling(batch, result) / after_split(batch)         nothing here (the slots of rejected drafts are
                                                               rewritten by later steps)
    chunk(seq, lo, hi) / gather / staging / scatter            tokens lo .. hi-1 of a sequence, layer by layer:
                                                               [latents [hi-lo, D]] (+ [indexer keys [hi-lo, Dk]])
    receiving(seq, n) / adopt(seq)                             nothing to prepare: the block table is the state
    describe(), block_bytes(), bytes_per_token(), drop(seq)
    spec                                                       the KV streams (kvstore/spec.py KVSpec): one, "latent"
                                                               (a chain: bs rows per block, a row per token; DSA's
                                                               indexer keys share its rows), its table seq.block_ids
    stream_pools()                                             stream -> its per-layer tensors [N, ...] (the KV tiers)
"""
from __future__ import annotations

import torch

from wideep.attention_mla.fp8_cache import latent_layout
from wideep.attention_mla.kv_cache import LatentKVPool
from wideep.attention_mla.meta import AttnMeta, attn_meta, int64_tensor
from wideep.kvstore.spec import FULL, KVSpec, StreamSpec


class LatentCache(LatentKVPool):
    def __init__(self, *args, model: str = "the model", **kwargs):
        """LatentKVPool's arguments; model: its name, for messages."""
        super().__init__(*args, **kwargs)
        self.spec = KVSpec(self.block_size, (StreamSpec("latent", FULL, rows=self.block_size),),
                           boundary=self.block_size, model=model)

    @classmethod
    def sized(cls, cfg, mcfg, dtype: torch.dtype, device, num_layers: int, max_model_len: int,
              model: str = "the model") -> "LatentCache":
        """For EngineConfig `cfg`: kv_cache_blocks, or as many blocks as max_num_seqs full-length sequences need,
        capped by kv_cache_memory. num_layers: the decoder layers (+ 1 for the MTP drafter's)."""
        index_dim = mcfg.dsa.index_head_dim if mcfg.dsa is not None else 0   # DSA: indexer keys beside the latents
        fp8 = latent_layout(cfg.kv_cache_dtype, mcfg.mla.kv_lora_rank, mcfg.mla.qk_rope_head_dim, dtype)
        blocks = cfg.kv_cache_blocks
        if blocks is None:
            per_block = cls.bytes_per_block(num_layers, cfg.block_size, mcfg.mla.latent_dim, dtype, index_dim, fp8)
            want = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
            blocks = max(1, min(want, cfg.kv_cache_memory // per_block))
        return cls(num_layers, blocks, cfg.block_size, mcfg.mla.latent_dim, dtype, device, index_dim=index_dim,
                   fp8=fp8, model=model)

    # -- a step's inputs ------------------------------------------------------------------------------
    def step_inputs(self, batch, parts: list[tuple[int, int, int]] | None = None
                    ) -> tuple[torch.Tensor, AttnMeta]:
        """-> input_ids [T], AttnMeta for the batch, or for `parts` of it ((b, lo, hi): tokens lo..hi-1
        of sequence b's tokens this step)."""
        bs, slot_list, seqs = self.block_size, self.slot_list, batch.seqs
        if parts is None and batch.num_tokens.count(1) == len(batch.num_tokens):
            return self._decode_inputs(seqs)
        if parts is None:
            parts = [(b, 0, n) for b, n in enumerate(batch.num_tokens)]
        ids, pos, slots, ctx_lens, qlens, tables = [], [], [], [], [], []
        for b, lo, hi in parts:
            s = seqs[b]
            start = s.num_computed + lo
            end = start + hi - lo
            if s.draft_token_ids:   # a verification: its token and each draft a decode row of its own
                toks = s.tokens(s.num_computed, s.num_computed + 1) + s.draft_token_ids
                for j in range(lo, hi):
                    p = s.num_computed + j
                    ids.append(toks[j])
                    pos.append(p)
                    slots.append(s.block_ids[p // bs] * bs + p % bs)
                    ctx_lens.append(p + 1)
                    qlens.append(1)
                    tables.append(s.block_ids)
                continue
            ids.extend(s.tokens(start, end))
            pos.extend(range(start, end))
            slots.extend(slot_list(s.block_ids, start, end))
            ctx_lens.append(end)
            qlens.append(hi - lo)
            tables.append(s.block_ids)
        return self._inputs(ids, pos, slots, ctx_lens, qlens, tables)

    def _decode_inputs(self, seqs) -> tuple[torch.Tensor, AttnMeta]:
        """step_inputs when every sequence runs one token (a decode step, the common case): one short loop, no
        per-sequence ranges or slot lists (slot_list's formula, inlined)."""
        bs = self.block_size
        ids, pos, slots, tables = [], [], [], []
        for s in seqs:
            p, P = s.num_computed, len(s.prompt_token_ids)
            ids.append(s.output_token_ids[p - P] if p >= P else s.prompt_token_ids[p])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            tables.append(s.block_ids)
        return self._inputs(ids, pos, slots, [p + 1 for p in pos], [1] * len(seqs), tables)

    def _inputs(self, ids, pos, slots, ctx_lens, qlens, tables) -> tuple[torch.Tensor, AttnMeta]:
        return int64_tensor(ids, self.device), attn_meta(pos, slots, ctx_lens, qlens, tables, self.block_size,
                                                         self.device)

    def after_sampling(self, batch, result) -> None:
        """Nothing: a rejected draft's slot is rewritten when its position is computed again."""

    def after_split(self, batch) -> None:
        """Nothing: the block tables are the cache's whole state."""

    # -- what disaggregation moves --------------------------------------------------------------------
    @property
    def transfer_layers(self) -> int:
        return len(self.pools)

    def chunk(self, seq, lo: int, hi: int, last: bool = False) -> torch.Tensor:
        """Tokens lo .. hi-1 of `seq`: their slots [hi - lo]."""
        return self.slots(seq.block_ids, lo, hi)

    def gather(self, slots: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """The chunk's rows of `layer`: the latents, then DSA's indexer keys ([T, D] copies: the blocks stay
        writable)."""
        return [pool.index_select(0, slots) for pool in self.layer_pools(layer)]

    def staging(self, slots: torch.Tensor, layer: int) -> list[torch.Tensor]:
        return [torch.empty(slots.shape[0], p.shape[1], dtype=p.dtype, device=p.device)
                for p in self.layer_pools(layer)]

    def scatter(self, slots: torch.Tensor, layer: int, rows: list[torch.Tensor]) -> None:
        for pool, r in zip(self.layer_pools(layer), rows, strict=True):
            pool.index_copy_(0, slots, r)

    def receiving(self, seq, num_tokens: int) -> None:
        """Nothing to prepare: received rows land in the sequence's blocks."""

    def adopt(self, seq) -> None:
        """Nothing: the sequence's blocks hold its first num_computed tokens."""

    def drop(self, seq) -> None:
        """Nothing: the blocks are the block manager's."""

    def describe(self) -> dict:
        """What two caches must agree on to move rows between them (disaggregation), and how much prompt they
        hold."""
        return {"blocks": self.num_blocks, "block_size": self.block_size,
                "dtype": f"{self.pools[0].dtype} ({self.kv_cache_dtype})",
                "layout": f"latent {self.latent_dim} + indexer key {self.index_dim} in {len(self.pools)} layers"}

    def stream_pools(self) -> dict[str, list[torch.Tensor]]:
        """stream -> every layer's block tensors of it, [N, ...] each (what the KV tiers move): the latents, and DSA's
        indexer keys."""
        return {"latent": [p.view(self.num_blocks, -1) for p in self.all_pools()]}

    def block_bytes(self) -> dict[str, int]:
        """stream -> the bytes one of its blocks takes over all layers: one stream, the latents (with DSA's indexer
        keys, which share its slots)."""
        return {"latent": sum(p[:self.block_size].nbytes for p in self.all_pools())}
