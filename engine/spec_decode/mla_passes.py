"""The MLA family's MTP passes (engine/spec_decode/drafter.py runs the protocol): the checkpoint's MTP layer
(engine/model/mtp.py MTPLayer) over the paged latent cache, its entries in layer L (kv_pools[L], + index_pools[L]
with DSA).

Legend: M rows of the first pass, D sequences drafting, k drafts per step.
Pass 1 keeps the layer's latent cache complete: row i is position i with the token at i + 1 and the target's hidden
state at i — every prefill row, a decode's row, and a verification's rows up to its last accepted draft (the rejected
drafts' rows are dropped; their slots are rewritten later). The last row of each sequence that sampled this step
predicts its first draft; the other rows only write their latents (a single layer's cache entry depends on its input
alone: no queries, attention or MoE for them, MTPLayer.first_pass). Passes 2..k feed the layer's output and the
previous draft back in, one row per drafting sequence, at the positions after it: their latents sit in the lookahead
slots the scheduler grew (k - 1 past the step's tokens) and are rewritten by the next step's pass 1 when those
positions become real. Drafts are the layer's argmax (deterministic: verification treats them as one-hot).
"""
from __future__ import annotations

import torch

from wideep.attention_mla.meta import AttnMeta, attn_meta, int64_tensor


class MLAPasses:
    defers = True      # a backing-off sequence's rows wait in its stash (drafter.py), run once they would pass STASH_ROWS
    keep_last = None

    def __init__(self, layer, kv):
        """layer: the MTPLayer; kv: the LatentCache (engine/model/mla_cache.py) whose layer layer.index it writes."""
        self.layer, self.kv = layer, kv
        self.device = layer.head.weight.device
        self.count = self.rows = 0   # forwards run (k per step); rows they ran

    def _meta(self, pos: list[int], qlens: list[int], tables: list[list[int]]) -> AttnMeta:
        """Rows at `pos`: sequence j has qlens[j] consecutive rows ending at its ctx_len; slots from its table."""
        bs, slots, ctx, r = self.kv.block_size, [], [], 0
        for q, t in zip(qlens, tables):
            for p in pos[r:r + q]:
                slots.append(t[p // bs] * bs + p % bs)
            ctx.append(pos[r + q - 1] + 1 if q else 0)
            r += q
        return attn_meta(pos, slots, ctx, qlens, tables, bs, self.device)

    def _forward(self, ids: list[int], prev: torch.Tensor, pos, qlens, tables, plan) -> torch.Tensor:
        self.count += 1
        self.rows += len(ids)
        return self.layer(int64_tensor(ids, self.device), prev, self._meta(pos, qlens, tables), self.kv.pools, plan,
                          self.kv.index_pools)

    def dummy(self, plan) -> None:
        """The step's plan.draft_passes passes with zero rows (collective: their MoE all-to-alls)."""
        empty = torch.empty(0, self.layer.eh_proj.in_features // 2, dtype=self.layer.eh_proj.weight.dtype,
                            device=self.device)
        for _ in range(plan.draft_passes):
            self._forward([], empty, [], [], [], plan)

    def run(self, seqs: list[tuple], hidden: torch.Tensor, passes: int, plan) -> None:
        """The first pass over every (sequence, sampled token, first row in hidden, tokens after its rows, stash,
        drafts next step) of `seqs`, then the draft passes; drafts land in s.spec.mtp_drafts."""
        bs = self.kv.block_size
        ids, pos, slots, pieces, live = [], [], [], [], []
        rows = 0
        for s, tok, r0, nxt, stash, nxt_ok in seqs:
            m, p0 = len(nxt), s.num_computed
            if stash is not None:   # the deferred rows first: positions stash.start .. c - 1
                ids.extend(stash.ids)
                pieces.extend(stash.parts)
                p0, m = stash.start, m + stash.rows
            ids.extend(nxt)
            pieces.append(hidden[r0:r0 + len(nxt)])
            t = s.block_ids
            pos.extend(range(p0, p0 + m))
            slots.extend(t[p // bs] * bs + p % bs for p in range(p0, p0 + m))
            rows += m
            if tok is not None and nxt_ok:   # sampled this step and not backing off next step: it drafts next
                live.append((s, p0 + m - 1, rows - 1))   # (seq, last row's position, its row)
        prev = torch.cat(pieces) if pieces else hidden[:0]
        # only the drafting sequences' last rows need the layer's output: the others stop at their latents
        qs = [q for _, q, _ in live]
        meta = attn_meta(qs, [slots[i] for _, _, i in live], [q + 1 for q in qs], [1] * len(live),
                         [s.block_ids for s, _, _ in live], bs, self.device)
        later = None
        if passes > 1 and live:   # each drafting row's later positions, where its lookahead slots exist
            npos, nslots, nlens = [], [], []
            for s, q, _ in live:
                t, ok = s.block_ids, True
                for p in range(q + 1, q + passes):
                    ok = ok and p // bs < len(t)
                    npos.append(p if ok else 0)
                    nslots.append(t[p // bs] * bs + p % bs if ok else -1)
                    nlens.append(p + 1 if ok else 0)
            later = (passes, npos, nslots, nlens)
        last, drafts, done = self.layer.first_pass(
            int64_tensor(ids, self.device), prev, int64_tensor(pos, self.device), int64_tensor(slots, self.device),
            max(pos, default=0), int64_tensor([i for _, _, i in live], self.device), meta, self.kv.pools, plan,
            self.kv.index_pools, later)
        self.count += done
        self.rows += len(ids) + len(live) * (done - 1)
        for (s, _, _), ds in zip(live, drafts):
            s.spec.mtp_drafts.extend(ds)
        if done == passes:
            return
        live = [(s, q, j) for j, (s, q, _) in enumerate(live)]
        for j in range(1, passes):
            # the next position, where its lookahead slot exists
            live = [(s, q + 1, i) for (s, q, _), i in zip(live, range(len(live)))
                    if (q + 1) // bs < len(s.block_ids)]
            keep = int64_tensor([i for _, _, i in live], self.device)
            self.count += 1
            self.rows += len(live)
            last, toks = self.layer.draft_pass(
                int64_tensor([s.spec.mtp_drafts[-1] for s, _, _ in live], self.device), last.index_select(0, keep),
                self._meta([q for _, q, _ in live], [1] * len(live), [s.block_ids for s, _, _ in live]),
                self.kv.pools, plan, self.kv.index_pools)
            for (s, _, _), t in zip(live, toks):
                s.spec.mtp_drafts.append(t)
