"""The MTP drafter on a rank: after each step, the checkpoint's MTP layer (the MLA family's, engine/model/mtp.py; or
DeepSeek-V4's MTP block) runs over the positions whose next token is now known, and then proposes the drafts of the
next step. This file is the protocol every family shares (which rows run, when, and the stash); the passes
themselves are the family's (mla_passes.py, v4_passes.py), given by the model family (engine/model/family.py
ModelFamily.drafter).

Pass 1 keeps the layer's KV complete: row i is position i with the token at i + 1 and the target's hidden state at
i — every prefill row, a decode's row, and a verification's rows up to its last accepted draft. The last row of each
sequence that sampled this step predicts its first draft. Passes 2..k feed the layer's output and the previous
draft back in, one row per drafting sequence, at the positions after it (in the lookahead blocks the scheduler grew,
k - 1 past the step's tokens). Drafts are the layer's argmax (deterministic: verification treats them as one-hot).

Every rank runs the same number of passes, with zero rows when it has none: the layer's MoE dispatch is
collective. The step sync agrees on it (StepPlan.draft_passes, the most any rank asked for): k when a
sequence may draft next step, 1 when one must run its first-pass rows without drafting, 0 otherwise.
A sequence that will not draft next step (backing off, too many running) defers its first-pass rows to a
Stash, a few views of the step's hidden states, and runs them in the pass before it drafts again (or
when STASH_ROWS have gathered): a backed-off sequence costs no pass, its KV is complete when it
drafts. Retired sequences and logits-processed ones have no rows at all (engine/spec_decode/speculator.py).
"""
from __future__ import annotations

import dataclasses

import torch

from wideep.attention_mla.meta import int64_tensor

from .speculator import can_draft


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
    """passes: the family's (MLAPasses, V4Passes): dummy(plan) runs a step's passes with zero rows; run(seqs, hidden,
    passes, plan) runs them over the rows _collect chose; `count` / `rows` count the forwards and rows they ran;
    `defers` / `keep_last` say how backing-off sequences' rows wait (below)."""

    def __init__(self, passes, k: int):
        self.model_passes, self.k = passes, k
        self.defers = passes.defers          # backing-off sequences' rows wait in a Stash, and run once they would
        #                                      pass STASH_ROWS ...
        self.keep_last = passes.keep_last    # ... unless a stash keeps only its last this many rows (DeepSeek-V4: the
        #                                      MTP block's window), when they never have to run early

    @property
    def passes(self) -> int:
        """Forwards run (k per drafting step)."""
        return self.model_passes.count

    @property
    def rows(self) -> int:
        """Rows those forwards ran."""
        return self.model_passes.rows

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
        self.model_passes.dummy(dataclasses.replace(plan, split=False))

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
        if passes:
            self.model_passes.run(seqs, hidden, passes, plan)
