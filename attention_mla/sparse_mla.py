"""MLA with DeepSeek Sparse Attention (DeepSeek-V3.2) over the paged latent + indexer-key caches.

Legend: T tokens, N heads, C kv_lora_rank, R rope dim, Dk indexer head dim, L context, k index_topk.
Each step writes every token's latent [C+R] and indexer key [Dk] into the same slot of their pools;
then each query attends to the top-k context tokens its indexer picks (indexer.py), in MLA's two forms:
- absorbed (decode): gather the selected latent rows only ([k, C+R] per query, not [L, C+R]) and
  attend over them in the latent space (MLA.attend_absorbed);
- naive (prefill): expand the whole context once and attend through the selection mask
  (MLA.attend_naive) — exact, and shared by all of a chunk's queries.
A query that sees at most k tokens selects them all: its attention is plain causal MLA, and the
indexer's queries and scores are not computed (a context within index_topk costs only the key write).
backend "triton" runs one-query (decode) sequences in kernels that read the caches in place: the
indexer's scores through the block table (triton_indexer.py), then the paged MLA decode kernel
(triton_decode.py) over the selected slots only.
"""
from __future__ import annotations

import torch
from torch import nn

from wideep.layers import NATIVE, Kernels

from .config import DSAConfig, MLAConfig
from .indexer import Indexer, select_topk, selection_mask
from .meta import AttnMeta
from .mla import MLA
from .rope import RotaryEmbedding


class SparseMLA(MLA):
    """MLA plus `indexer` (checkpoint names `self_attn.indexer.*`). mode as MLA's: "auto" attends
    one-query sequences absorbed and the others naive; "naive"/"absorbed" force one form (tests).
    kv_cache_dtype "fp8" / "fp4" quantises the latent cache only: the indexer keys stay in the model dtype."""

    def __init__(self, cfg: MLAConfig, dsa: DSAConfig, rope: RotaryEmbedding, device=None, dtype=None,
                 linear=nn.Linear, backend: str = "torch", mode: str = "auto", kv_cache_dtype: str = "auto",
                 kernels: Kernels = NATIVE):
        super().__init__(cfg, rope, device=device, dtype=dtype, linear=linear, backend=backend, mode=mode,
                         kv_cache_dtype=kv_cache_dtype, kernels=kernels)
        if cfg.q_lora_rank != dsa.q_lora_rank:
            raise ValueError(f"DSA's indexer reads the q-LoRA latent: q_lora_rank {cfg.q_lora_rank} != "
                             f"{dsa.q_lora_rank}")
        self.dsa = dsa
        self.indexer = Indexer(dsa, cfg.hidden_size, rope, device=device, dtype=dtype)

    def write_entries(self, kv_pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, index_pool: torch.Tensor | None = None) -> None:
        """MLA.write_entries plus the rows' indexer keys into index_pool [S, Dk] (the same slots)."""
        self._check_index_pool(kv_pool, index_pool)
        super().write_entries(kv_pool, slots, x, cos, sin)
        index_pool.index_copy_(0, slots, self.indexer.keys(x, cos, sin).to(index_pool.dtype))

    def _check_index_pool(self, kv_pool: torch.Tensor, index_pool: torch.Tensor | None) -> None:
        Dk = self.dsa.index_head_dim
        if index_pool is None or index_pool.shape != (kv_pool.shape[0], Dk):
            raise ValueError(f"DSA attention needs this layer's indexer-key pool [{kv_pool.shape[0]}, {Dk}] beside "
                             f"its latent pool (LatentKVPool(..., index_dim={Dk}).index_pools), got "
                             f"{None if index_pool is None else tuple(index_pool.shape)}")

    def attend_sparse_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, q_idx: torch.Tensor | None,
                               w: torch.Tensor | None, kv_pool: torch.Tensor, index_pool: torch.Tensor,
                               ctx_slots: torch.Tensor, key_limit: torch.Tensor) -> torch.Tensor:
        """Any tokens, each over its own context. q_nope [T, N, dn], q_pe [T, N, R], q_idx [T, NI, Dk] and
        w [T, NI] (the indexer's; None when no context exceeds k), ctx_slots [T, Lmax] (each token's
        context slots, padded), key_limit [T] -> [T, N, dv], reading k latent rows per token."""
        if ctx_slots.shape[1] <= self.dsa.index_topk:
            chosen, n = ctx_slots, key_limit
        else:
            scores = self.indexer.scores(q_idx, w, index_pool[ctx_slots])            # [T, Lmax]
            idx, n = select_topk(scores, key_limit, self.dsa.index_topk)
            chosen = ctx_slots.gather(1, idx)                                         # [T, k]
        return self.attend_absorbed(q_nope, q_pe, self.cache_rows(kv_pool, chosen), n)

    def attend_sparse_naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, q_idx: torch.Tensor | None,
                            w: torch.Tensor | None, kv_pool: torch.Tensor, index_pool: torch.Tensor,
                            slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One sequence's Tq queries at `positions` [Tq] over its context slots [L] -> [Tq, N, dv]."""
        mask = None
        if slots.shape[0] > self.dsa.index_topk:
            scores = self.indexer.scores(q_idx, w, index_pool[slots][None])           # [Tq, L]
            idx, n = select_topk(scores, positions + 1, self.dsa.index_topk)
            mask = selection_mask(idx, n, slots.shape[0])                             # [Tq, L]
        return self.attend_naive(q_nope, q_pe, self.cache_rows(kv_pool, slots), mask)

    def attend_paged_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, q_idx: torch.Tensor | None,
                            w: torch.Tensor | None, kv_pool: torch.Tensor, index_pool: torch.Tensor, meta: AttnMeta,
                            seqs: list[int]) -> torch.Tensor:
        """Decode sequences `seqs` (one query each, in that order) in the Triton kernels -> [B, N, dv]: the
        indexer's scores read the keys through the block table (triton_indexer.py), the top-k runs in torch,
        and the paged MLA decode kernel reads only the selected latents, given to it as one-slot blocks."""
        from .triton_indexer import index_scores_paged
        table, lens, max_len = meta.seq_tables(seqs)
        bs = meta.block_size
        if max_len > self.dsa.index_topk:
            scores = index_scores_paged(q_idx.to(index_pool.dtype), w, index_pool, table, lens, bs,
                                        self.indexer.scale, max_len)                  # [B, max_len]
            idx, n = select_topk(scores, lens, self.dsa.index_topk)
            table = (table.gather(1, idx // bs) * bs + idx % bs).to(torch.int32)   # [B, k] slots
            lens, max_len, bs = n.to(torch.int32), idx.shape[1], 1
        return self.attend_paged_triton(q_nope, q_pe, kv_pool, table, lens, bs, max_len)

    def forward(self, x: torch.Tensor, meta: AttnMeta, kv_pool: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, index_pool: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], kv_pool [S, C+R] and index_pool [S, Dk] (this layer's), cos/sin [T, R/2] -> [T, H].
        backend "triton": one-query sequences run attend_paged_sparse."""
        cfg = self.cfg
        self._check_index_pool(kv_pool, index_pool)
        T = x.shape[0]
        if T == 0:
            return self.o_proj(x.new_zeros(0, cfg.num_heads * cfg.v_head_dim))
        q_lat = self.q_latent(x)
        self.check_pool(kv_pool)
        q_nope, q_pe, latent = self.project(x, cos, sin, q_lat)
        self.write_cache(kv_pool, meta.slot_mapping, latent)
        index_pool.index_copy_(0, meta.slot_mapping, self.indexer.keys(x, cos, sin).to(index_pool.dtype))
        # the indexer's queries are needed only where some context exceeds index_topk
        q_idx, w = (self.indexer.queries(x, q_lat, cos, sin) if max(meta.ctx_lens) > self.dsa.index_topk
                    else (None, None))

        def take(rows):  # this step's per-token tensors at `rows`
            return [q_nope[rows], q_pe[rows]] + [None if t is None else t[rows] for t in (q_idx, w)]

        out = x.new_empty(T, cfg.num_heads, cfg.v_head_dim)
        paged, absorbed, naive = meta.attention_split(self.mode, self.backend == "triton")
        if len(paged) == T:   # every token decodes: no gather, no scatter
            out = self.attend_paged_sparse(*take(slice(None)), kv_pool, index_pool, meta, paged)
        elif paged:
            rows = meta.query_rows(paged, x.device)
            out[rows] = self.attend_paged_sparse(*take(rows), kv_pool, index_pool, meta, paged)
        if absorbed:
            rows, slots = meta.query_context_slots(absorbed, x.device)               # [T'], [T', Lmax]
            out[rows] = self.attend_sparse_absorbed(*take(rows), kv_pool, index_pool, slots, meta.positions[rows] + 1)
        for b in naive:
            s, q = meta.query_starts[b], meta.query_lens[b]
            slots, _ = meta.context_slots([b])
            out[s:s + q] = self.attend_sparse_naive(*take(slice(s, s + q)), kv_pool, index_pool, slots[0],
                                                    meta.positions[s:s + q])
        return self.o_proj(out.reshape(T, -1))
