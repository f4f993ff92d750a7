"""The MTP drafter on a rank: after each step, the checkpoint's MTP layer (engine/model/mtp.py) runs over the
positions whose next token is now known, and then proposes the drafts of the next step.

Legend: M rows of the first pass, D sequences drafting, k drafts per step.
Pass 1 keeps the layer's latent cache (kv_pools[L]) complete: row i is position i with the token at
i + 1 and the target's hidden state at i — every prefill row, a decode's row, and a verification's
rows up to its last accepted draft (the rejected drafts' rows are dropped; their slots are rewritten
later). The last row of each sequence that sampled this step predicts its first draft; the other rows
only write their latents (a single layer's cache entry depends on its input alone: no queries, attention
or MoE for them, MTPLayer.first_pass). Passes 2..k
feed the layer's output and the previous draft back in, one row per drafting sequence, at the
positions after it: their latents sit in the lookahead slots the scheduler grew (k - 1 past the
step's tokens) and are rewritten by the next step's pass 1 when those positions become real.

Every rank runs the same number of passes, with zero rows when it has none: the layer's MoE dispatch is
collective. The step sync agrees on it (StepPlan.draft_passes, the most any rank asked for): k when a
sequence may draft next step, 1 when one must run its first-pass rows without drafting, 0 otherwise.
A sequence that will not draft next step (backing off, too many running) defers its first-pass rows to a
Stash, a few views of the step's hidden states, and runs them in the pass before it drafts again (or
when STASH_ROWS have gathered): a backed-off sequence costs no pass, its latents are complete when it
drafts. Retired sequences and logits-processed ones have no rows at all (engine/spec_decode/speculator.py).
Drafts are the layer's argmax (deterministic: verification treats them as one-hot).
"""
from __future__ import annotations

import dataclasses

import torch

from wideep.attention_mla.meta import AttnMeta, int64_tensor

from ..spec_decode.speculator import can_draft
from .runner import attn_meta


STASH_ROWS = 64        # a backing-off sequence's deferred first-pass rows: past this many they run


class Stash:
    """A sequence's first-pass rows deferred while it backs off: positions start .. end - 1, the tokens after
    them and the target's hidden states there (views of each step's gather). They run, oldest first, in the
    first pass of the step before it drafts again, or when they reach STASH_ROWS; a stash that no longer ends
    where the sequence's next rows begin (preempted, recomputed) is dropped."""

    __slots__ = ("start", "end", "ids", "parts", "trimmed")

    def __init__(self, start: int):
        self.start = self.end = start
        self.ids: list[int] = []
        self.parts: list[torch.Tensor] = []
        self.trimmed = False   # rows before `start` were dropped (trim): their latents were never written

    @property
    def rows(self) -> int:
        return self.end - self.start

    def add(self, ids: list[int], hidden: torch.Tensor) -> None:
        self.ids.extend(ids)
        self.parts.append(hidden)
        self.end += len(ids)

    def trim(self, keep: int) -> None:
        """Keep the last `keep` rows only (a sliding-window layer never reads older ones again)."""
        if self.rows > keep:
            self.parts = [torch.cat(self.parts)[-keep:]]
            self.ids = self.ids[-keep:]
            self.start, self.trimmed = self.end - keep, True


def _keeps(s) -> bool:
    """Whether the drafter keeps s's latents: it may draft (now or later)."""
    return (not s.params.processed or can_draft(s.params)) and (s.spec is None or not s.spec.retired)


class MTPDrafter:
    defers = True      # backing-off sequences' rows wait in a Stash, and run once they would pass STASH_ROWS ...
    keep_last = None   # ... unless a stash keeps only its last this many rows (DeepSeek-V4: the MTP block's window)

    def __init__(self, layer, kv, k: int):
        self.layer, self.kv, self.k = layer, kv, k
        self.device = layer.head.weight.device
        self.passes = 0   # forwards run (k per step)

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
        self.passes += 1
        return self.layer(int64_tensor(ids, self.device), prev, self._meta(pos, qlens, tables), self.kv.pools, plan,
                          self.kv.index_pools)

    def wanted(self, batch, speculator) -> tuple[int, int]:
        """-> (the passes this rank asks for this step, the stashed rows its first pass adds to the step's tokens).
        Passes: k if a sequence of its batch may draft next step, 1 if one must run its first-pass rows though it
        will not draft (its stash is full, or it verified), else 0 (rows of sequences backing off wait in their
        stash: see draft). The rows go into the step sync's token count: the first pass dispatches the step's
        rows plus those, and every rank's dispatch is planned for the largest count."""
        if batch is None or not batch.seqs:
            return 0, 0
        want = extra = 0
        for s, n in zip(batch.seqs, batch.num_tokens):
            if not _keeps(s):
                continue
            nxt_ok = speculator.may_draft_next(s)   # (makes s.spec)
            st = s.spec.stash
            stashed = st.rows if st is not None and st.end == s.num_computed else 0
            if nxt_ok:
                want = self.k
            elif (s.draft_token_ids or not self.defers
                  or (self.keep_last is None and stashed + n > STASH_ROWS)):
                want = max(want, 1)
            else:
                continue   # its rows go to its stash
            extra += stashed
        return want, extra

    def dummy(self, plan) -> None:
        """A rank with nothing this step: the step's passes with zero rows (their MoE all-to-alls)."""
        plan = dataclasses.replace(plan, split=False)
        empty = torch.empty(0, self.layer.eh_proj.in_features // 2, dtype=self.layer.eh_proj.weight.dtype,
                            device=self.device)
        for _ in range(plan.draft_passes):
            self._forward([], empty, [], [], [], plan)

    def _collect(self, batch, hidden: torch.Tensor, result, passes: int, speculator) -> list[tuple]:
        """The first pass's sequences: (s, sampled token, first row in hidden, the tokens after its rows, its stash
        or None, drafts next step). Rows of sequences that will not draft next step go to their stash instead."""
        seqs, stashing = [], []
        start = 0
        for b, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            c, r0 = s.num_computed, start
            start += n
            if not _keeps(s):   # never drafts (again): no latents needed
                continue
            tok = result.tokens[b]
            if s.draft_token_ids:    # a verification: its token and the accepted drafts
                nxt = list(result.accepted[b].tokens) + [tok]
            else:
                N = s.num_tokens
                nxt = s.tokens(c + 1, min(c + n + 1, N)) + ([tok] if tok is not None and c + n == N else [])
            if not nxt:
                continue
            st, nxt_ok = speculator.state(s), speculator.may_draft_next(s)
            st.mtp_drafts = []
            stash = st.stash if st.stash is not None and st.stash.end == c else None
            if (self.defers and not nxt_ok and not s.draft_token_ids
                    and (self.keep_last is not None or (stash.rows if stash else 0) + len(nxt) <= STASH_ROWS)):
                if stash is None:
                    stash = Stash(c)
                stashing.append((stash, r0, nxt))
                st.stash = stash
                continue
            st.stash = None
            seqs.append((s, tok, r0, nxt, stash, nxt_ok))
        if stashing:   # one gather for every row this step defers
            g = hidden.index_select(0, int64_tensor([r for _, r0, nxt in stashing for r in range(r0, r0 + len(nxt))],
                                                    hidden.device))
            o = 0
            for stash, _, nxt in stashing:
                stash.add(nxt, g[o:o + len(nxt)])
                if self.keep_last is not None:
                    stash.trim(self.keep_last)
                o += len(nxt)
        if not passes and seqs:
            raise RuntimeError("MTP drafter: rows to run but the step agreed on no pass (wanted() and draft() "
                               "disagree)")
        return seqs

    @torch.inference_mode()
    def draft(self, batch, hidden: torch.Tensor, result, plan, speculator) -> None:
        """After the target's step (before the scheduler applies result): pass 1 and the draft passes; each
        sequence that sampled gets its drafts in s.spec.mtp_drafts."""
        passes, plan = plan.draft_passes, dataclasses.replace(plan, split=False)
        seqs = self._collect(batch, hidden, result, passes, speculator)
        if not passes:
            return
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
        self.passes += done
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
            self.passes += 1
            last, toks = self.layer.draft_pass(
                int64_tensor([s.spec.mtp_drafts[-1] for s, _, _ in live], self.device), last.index_select(0, keep),
                self._meta([q for _, q, _ in live], [1] * len(live), [s.block_ids for s, _, _ in live]),
                self.kv.pools, plan, self.kv.index_pools)
            for (s, _, _), t in zip(live, toks):
                s.spec.mtp_drafts.append(t)
