"""DeepSeek-V4's MTP passes: MTP block 0 (engine/model/v4_model.py V4MTPBlock, a sliding-window decoder layer with
its own hyper-connection head) drafts k tokens per step under engine/spec_decode/drafter.py's protocol, as
mla_passes.py does for the MLA models (every rank runs the same number of passes).

Legend: L decoder layers, n hc_mult, H hidden, W sliding window.
The block's KV is layer L of the V4 pools (engine/model/v4_cache.py V4StreamCache(mtp_layers=1)): window rows addressed by position, in the
same window blocks as the decoder layers'. Pass 1 runs the block over every position whose next token is now
known, as one chunk per sequence at its positions (row i: the token at i + 1 and the target's residual streams at
i, which the model's forward appends to its rows: DeepseekV4Model.with_streams); its window rows are what later
passes and steps attend to. Passes 2..k feed the block's own output streams and the previous draft back in, one
row per drafting sequence at the next position, in the lookahead window blocks the scheduler grew (k - 1 past the
step's tokens); the next step's pass 1 writes those positions again when they become real. The window is addressed
by position, so a rejected draft's rows need no rewind; a block of another kind (CSA/HCA: a compressor state) is
refused at load.

A sequence backing off defers its rows to a Stash as with the MLA layer, but the stash keeps only its last W - 1
rows (Stash.trim) and never has to run early: the block's queries read W positions back, so the pass before the
sequence drafts again runs the kept rows (and the step's) as one chunk, with its window floored (the layer's view
reads no row below the chunk when the stash dropped older ones, nor below the window blocks the sequence still
holds). That chunk's last query sees exactly the W positions it would have seen had every row run at once; only
the outputs of its earlier rows, which no one reads, see fewer. A backed-off sequence costs no pass.
"""
from __future__ import annotations

import torch

from wideep.attention_mla.meta import int64_tensor
from wideep.attention_v4.streams import V4Meta


class V4Passes:
    defers = True

    def __init__(self, model, kv):
        """model: the DeepseekV4Model, built with_streams (its forward's rows carry the residual streams this block
        reads); kv: its V4StreamCache, with the block's layer L."""
        if not model.with_streams:
            raise ValueError("DeepSeek-V4's MTP passes read the residual streams: build the model with_streams")
        self.model, self.kv = model, kv
        self.device = model.device
        self.count = self.rows = 0   # forwards run; rows they ran
        # a query reads W positions back, its own included: W - 1 deferred rows before the step's first one (the
        # oldest of them still in a window block the sequence holds: the target's step read it)
        self.keep_last = model.cfg.v4.attention.sliding_window - 1
        self.layer_index = model.cfg.num_hidden_layers   # the block's layer in the pools

    def _run(self, ids: list[int], streams: torch.Tensor, lens: list[int], seqs: list, first: list[int],
             plan) -> torch.Tensor:
        """The block over chunks lens[j] of seqs[j] starting at positions first[j] -> output streams [T, n, H]."""
        self.count += 1
        self.rows += len(ids)
        st = [self.kv.streams[s.request_id] for s in seqs]
        meta = V4Meta.build(lens, st, self.device, [p - x.num_tokens for p, x in zip(first, st)])
        return self.model.mtp_forward(0, int64_tensor(ids, self.device), streams, meta, plan)

    def dummy(self, plan) -> None:
        """The step's plan.draft_passes passes with zero rows (collective: their MoE all-to-alls)."""
        cfg = self.model.cfg
        empty = torch.empty(0, cfg.v4.hc_mult, cfg.hidden_size, dtype=self.model.dtype, device=self.device)
        for _ in range(plan.draft_passes):
            self._run([], empty, [], [], [], plan)

    def run(self, seqs: list[tuple], hidden: torch.Tensor, passes: int, plan) -> None:
        """Pass 1 over `seqs`' rows (drafter.py _collect), one chunk per sequence, then the draft passes."""
        ids, pieces, lens, firsts, live, rows, floored = [], [], [], [], [], 0, []
        bs = self.kv.block_size
        for s, tok, r0, nxt, stash, nxt_ok in seqs:
            p0, m = s.num_computed, len(nxt)
            if stash is not None:   # the deferred rows first: positions stash.start .. c - 1
                ids.extend(stash.ids)
                pieces.extend(stash.parts)
                p0, m = stash.start, m + stash.rows
                view = self.kv.streams[s.request_id].layers[self.layer_index]
                view.read_from(max(p0 if stash.trimmed else 0, min(s.stream_tables.window, default=0) * bs))
                floored.append(view)
            ids.extend(nxt)
            pieces.append(hidden[r0:r0 + len(nxt)])
            lens.append(m)
            firsts.append(p0)
            rows += m
            if tok is not None and nxt_ok:   # sampled this step and drafts next step
                live.append((s, p0 + m - 1, rows - 1))   # (seq, last row's position, its row)
        prev = self.model.streams_of(torch.cat(pieces) if pieces else hidden[:0])
        try:
            out = self._run(ids, prev, lens, [s for s, *_ in seqs], firsts, plan)
        finally:
            for view in floored:
                view.read_from(0)
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
