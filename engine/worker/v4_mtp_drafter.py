"""DeepSeek-V4's MTP drafter: MTP block 0 (engine/model/v4_model.py V4MTPBlock, a sliding-window decoder layer with
its own hyper-connection head) drafts k tokens per step, as engine/worker/mtp_drafter.py's MTPDrafter does for the
MLA models, whose step protocol it keeps (wanted / dummy / draft; every rank runs the same number of passes).

Legend: L decoder layers, n hc_mult, H hidden, W sliding window.
The block's KV is layer L of the V4 pools (V4StreamCache(mtp_layers=1)): window rows addressed by position, in the
same window blocks as the decoder layers'. Pass 1 runs the block over every position whose next token is now
known, as one chunk per sequence at its positions (row i: the token at i + 1 and the target's residual streams at
i, which the model's forward appends to its rows: DeepseekV4Model.with_streams); its window rows are what later
passes and steps attend to. Passes 2..k feed the block's own output streams and the previous draft back in, one
row per drafting sequence at the next position, in the lookahead window blocks the scheduler grew (k - 1 past the
step's tokens); the next step's pass 1 writes those positions again when they become real. The window is addressed
by position, so a rejected draft's rows need no rewind; a block of another kind (CSA/HCA: a compressor state) is
refused at load.

Unlike the MLA drafter, rows are never deferred to a stash while a sequence backs off: the window keeps only the
last W positions, so deferred rows would be gone by the time they ran. A backing-off sequence therefore costs its
rank a pass of one layer per step (the target runs L); one that keeps failing retires and costs nothing more.
"""
from __future__ import annotations

import dataclasses

import torch

from attention_mla.meta import int64_tensor
from attention_v4.streams import V4Meta

from .mtp_drafter import MTPDrafter


class V4MTPDrafter(MTPDrafter):
    defers = False

    def __init__(self, model, kv, k: int):
        self.model, self.kv, self.k = model, kv, k
        self.device = model.device
        self.passes = 0
        model.with_streams = True

    def _run(self, ids: list[int], streams: torch.Tensor, lens: list[int], seqs: list, first: list[int],
             plan) -> torch.Tensor:
        """The block over chunks lens[j] of seqs[j] starting at positions first[j] -> output streams [T, n, H]."""
        self.passes += 1
        st = [self.kv.streams[s.request_id] for s in seqs]
        meta = V4Meta.build(lens, st, self.device, [p - x.num_tokens for p, x in zip(first, st)])
        return self.model.mtp_forward(0, int64_tensor(ids, self.device), streams, meta, plan)

    def dummy(self, plan) -> None:
        plan = dataclasses.replace(plan, split=False)
        cfg = self.model.cfg
        empty = torch.empty(0, cfg.v4.hc_mult, cfg.hidden_size, dtype=self.model.dtype, device=self.device)
        for _ in range(plan.draft_passes):
            self._run([], empty, [], [], [], plan)

    @torch.inference_mode()
    def draft(self, batch, hidden: torch.Tensor, result, plan, speculator) -> None:
        passes, plan = plan.draft_passes, dataclasses.replace(plan, split=False)
        seqs = self._collect(batch, hidden, result, passes, speculator)
        if not passes:
            return
        ids, pieces, lens, firsts, live, rows = [], [], [], [], [], 0
        for s, tok, r0, nxt, _, nxt_ok in seqs:   # (never a stash: defers is False)
            ids.extend(nxt)
            pieces.append(hidden[r0:r0 + len(nxt)])
            lens.append(len(nxt))
            firsts.append(s.num_computed)
            rows += len(nxt)
            if tok is not None and nxt_ok:   # sampled this step and drafts next step
                live.append((s, s.num_computed + len(nxt) - 1, rows - 1))   # (seq, last row's position, its row)
        prev = self.model.streams_of(torch.cat(pieces) if pieces else hidden[:0])
        out = self._run(ids, prev, lens, [s for s, *_ in seqs], firsts, plan)
        bs = self.kv.block_size
        for j in range(passes):
            if j:   # the next position, where its lookahead window block exists
                keep = [i for i, (s, q, _) in enumerate(live) if (q + 1) // bs in s.stream_tables.window]
                live = [(live[i][0], live[i][1] + 1, n) for n, i in enumerate(keep)]
                out = self._run([s.spec.mtp_drafts[-1] for s, _, _ in live],
                                out.index_select(0, int64_tensor(keep, self.device)), [1] * len(live),
                                [s for s, _, _ in live], [q for _, q, _ in live], plan)
            else:
                out = out.index_select(0, int64_tensor([r for _, _, r in live], self.device))
                live = [(s, q, n) for n, (s, q, _) in enumerate(live)]
            if live:
                for (s, _, _), t in zip(live, self.model.mtp_logits(0, out).argmax(-1).tolist()):   # SYNC: drafts
                    s.spec.mtp_drafts.append(t)
