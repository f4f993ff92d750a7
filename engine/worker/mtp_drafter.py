"""The MTP drafter on a rank: after each step, the checkpoint's MTP layer (engine/model/mtp.py) runs over the
positions whose next token is now known, and then proposes the drafts of the next step.

Legend: M rows of the first pass, D sequences drafting, k drafts per step.
Pass 1 keeps the layer's latent cache (kv_pools[L]) complete: row i is position i with the token at
i + 1 and the target's hidden state at i — every prefill row, a decode's row, and a verification's
rows up to its last accepted draft (the rejected drafts' rows are dropped; their slots are rewritten
later). The last row of each sequence that sampled this step predicts its first draft. Passes 2..k
feed the layer's output and the previous draft back in, one row per drafting sequence, at the
positions after it: their latents sit in the lookahead slots the scheduler grew (k - 1 past the
step's tokens) and are rewritten by the next step's pass 1 when those positions become real.

Every rank runs the same number of passes, with zero rows when it has none: the layer's MoE dispatch is
collective. The step sync agrees on it (StepPlan.draft_passes, the most any rank asked for): k when a
sequence may draft next step, 1 when they only keep their latents (backing off, too many running), 0
when none may draft again (logits processing; retired after failing again and again,
engine/spec_decode/speculator.py). Drafts are the layer's argmax (deterministic:
verification treats them as one-hot).
"""
from __future__ import annotations

import dataclasses

import torch

from attention_mla.meta import AttnMeta, int64_tensor

from ..spec_decode.speculator import SeqSpec, can_draft
from .runner import attn_meta


ROWS_AS_DECODES = 16   # a sequence's first-pass rows up to this many run as decode rows, more as one chunk


def _keeps(s) -> bool:
    """Whether the drafter keeps s's latents: it may draft (now or later)."""
    return (not s.params.processed or can_draft(s.params)) and (s.spec is None or not s.spec.retired)


class MTPDrafter:
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
        return self.layer(int64_tensor(ids, self.device), prev, self._meta(pos, qlens, tables), self.kv.pools, plan)

    def wanted(self, batch, speculator) -> int:
        """The passes this rank asks for this step: k if a sequence of its batch may draft next step, 1 if one
        only keeps its latents (backing off, or not drafting at this batch size), 0 if none has rows."""
        if batch is None or not batch.seqs:
            return 0
        want = 0
        for s in batch.seqs:
            if _keeps(s):
                if speculator.may_draft_next(s):
                    return self.k
                want = 1
        return want

    def dummy(self, plan) -> None:
        """A rank with nothing this step: the step's passes with zero rows (their MoE all-to-alls)."""
        plan = dataclasses.replace(plan, split=False)
        empty = torch.empty(0, self.layer.eh_proj.in_features // 2, dtype=self.layer.eh_proj.weight.dtype,
                            device=self.device)
        for _ in range(plan.draft_passes):
            self._forward([], empty, [], [], [], plan)

    @torch.inference_mode()
    def draft(self, batch, hidden: torch.Tensor, result, plan, speculator) -> None:
        """After the target's step (before the scheduler applies result): pass 1 and the draft passes; each
        sequence that sampled gets its drafts in s.spec.mtp_drafts."""
        passes, plan = plan.draft_passes, dataclasses.replace(plan, split=False)
        if not passes:
            return
        rows, ids, pos, qlens, tables, seqs = [], [], [], [], [], []
        start = 0
        for b, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            c, r0 = s.num_computed, start
            start += n
            if not _keeps(s):   # never drafts (again): no latents needed
                continue
            tok = result.tokens[b]
            if s.draft_token_ids:    # a verification: its token and the accepted drafts
                acc = result.accepted[b]
                nxt = list(acc.tokens) + [tok]
            else:
                N = s.num_tokens
                nxt = s.tokens(c + 1, min(c + n + 1, N)) + ([tok] if tok is not None and c + n == N else [])
            m = len(nxt)
            if not m:
                continue
            rows.extend(range(r0, r0 + m))
            ids.extend(nxt)
            pos.extend(range(c, c + m))
            if m <= ROWS_AS_DECODES:   # each its own decode row (the CPU's fused decode halves take them)
                qlens.extend([1] * m)
                tables.extend([s.block_ids] * m)
            else:
                qlens.append(m)
                tables.append(s.block_ids)
            seqs.append((s, tok, c + m - 1, len(rows) - 1))   # (seq, sampled token, last row's position, its row)
        prev = hidden.index_select(0, int64_tensor(rows, hidden.device)) if rows else hidden[:0]
        out = self._forward(ids, prev, pos, qlens, tables, plan)
        # sampled this step and not backing off next step: they draft next (the others' rows only keep latents)
        live = [(s, q, i) for s, tok, q, i in seqs if tok is not None and speculator.may_draft_next(s)]
        for s, _, _, _ in seqs:
            if s.spec is None:
                s.spec = SeqSpec()
            s.spec.mtp_drafts = []
        last = out.index_select(0, int64_tensor([i for _, _, i in live], out.device)) if live else out[:0]
        bs = self.kv.block_size
        for j in range(passes):
            if j:
                # the next position, where its lookahead slot exists
                live = [(s, q + 1, i) for (s, q, _), i in zip(live, range(len(live)))
                        if (q + 1) // bs < len(s.block_ids)]
                keep = int64_tensor([i for _, _, i in live], self.device)
                last = self._forward([s.spec.mtp_drafts[-1] for s, _, _ in live], last.index_select(0, keep),
                                     [q for _, q, _ in live], [1] * len(live), [s.block_ids for s, _, _ in live], plan)
            if live:
                for (s, _, _), t in zip(live, self.layer.logits(last).argmax(-1).tolist()):   # SYNC: drafts to the host
                    s.spec.mtp_drafts.append(t)
