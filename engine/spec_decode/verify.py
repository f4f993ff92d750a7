"""Verify drafts: the target's logits at a sequence's last token and at each of its k drafts decide how
many drafts it keeps, and the token after them (the target's own), so that the output is what plain
decoding would give — token for token at temperature 0, in distribution otherwise.

Legend: R verification rows (k_b + 1 per sequence), V vocab.
- Greedy: draft i is kept while it equals the argmax of row i; the token after the kept ones is the
  argmax of the first row whose draft was not kept (or of row k: the bonus token).
- Sampling: the drafts are deterministic (n-gram lookup, the MTP layer's argmax), i.e. a draft
  distribution q that is one-hot at d_i. Rejection sampling keeps d_i with probability
  min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i), where p_i is row i's distribution after temperature,
  top-k and top-p; at the first rejection the token is drawn from the residual max(p_i - q_i, 0),
  normalised: p_i without d_i. If every draft is kept, the bonus token is drawn from p_k. Each
  output token is then distributed exactly as p given the tokens before it (Leviathan et al., 2023).
Logprobs are of the raw distribution, as for plain sampling.
"""
from __future__ import annotations

import torch

from wideep.attention_mla.meta import int64_tensor

from ..sched.scheduler import Accepted, StepResult
from ..sampling.sampler import draw, filter_logits, logsumexp, sample_layout, topn_logprobs


def _sample_row(logits: torch.Tensor, drafts: list[int], p, gen) -> tuple[int, int]:
    """logits [k+1, V] of one sampling sequence -> (drafts kept, the token after them)."""
    k = len(drafts)
    f = sample_layout([p] * (k + 1), [gen] * (k + 1), logits.device).groups[0].filters   # the sampler's filters
    filtered = filter_logits(logits, *f) if f is not None else logits
    probs = filtered.softmax(-1)                                                      # [k+1, V]
    d = int64_tensor(drafts, logits.device)
    p_d = probs[:k].gather(1, d[:, None]).squeeze(1)                                  # [k]
    u = torch.rand(k, generator=gen, device=logits.device)
    kept = (u < p_d).tolist()                                                         # SYNC: acceptance decides the tokens
    a = kept.index(False) if False in kept else k
    row = filtered[a:a + 1]
    if a < k:   # the residual: p_a without the rejected draft
        row = row.clone()
        row[0, drafts[a]] = float("-inf")
    return a, int(draw(row, gen)[0])                                                  # SYNC: as above


def verify(logits: torch.Tensor, seqs: list, ks: list[int], batch_rows: list[int], result: StepResult) -> None:
    """logits [R, V] raw, sequence j's rows consecutive (ks[j] + 1 of them); writes each sequence's accepted
    drafts and next token into result at batch row batch_rows[j]."""
    B = len(result.tokens)
    if result.accepted is None:
        result.accepted = [None] * B
    greedy = [j for j, s in enumerate(seqs) if s.params.greedy]
    starts, r = [], 0
    for k in ks:
        starts.append(r)
        r += k + 1
    kept: list[int] = [0] * len(seqs)
    nxt: list[int] = [0] * len(seqs)
    if greedy:
        top = logits.argmax(-1).tolist()                                              # SYNC: the tokens go to the host
        for j in greedy:
            d, r0, k = seqs[j].draft_token_ids, starts[j], ks[j]
            a = 0
            while a < k and d[a] == top[r0 + a]:
                a += 1
            kept[j], nxt[j] = a, top[r0 + a]
    for j, s in enumerate(seqs):
        if not s.params.greedy:
            r0 = starts[j]
            kept[j], nxt[j] = _sample_row(logits[r0:r0 + ks[j] + 1], s.draft_token_ids, s.params, s.generator)
    # the output tokens' raw logprobs: row r0 + i predicts output i
    out_rows, out_toks = [], []
    for j, s in enumerate(seqs):
        a = kept[j]
        out_rows.extend(range(starts[j], starts[j] + a + 1))
        out_toks.extend(s.draft_token_ids[:a] + [nxt[j]])
    sel = logits.index_select(0, int64_tensor(out_rows, logits.device))               # [O, V]
    toks = int64_tensor(out_toks, logits.device)
    lse = logsumexp(sel)
    lps = (sel.gather(1, toks[:, None]).squeeze(1) - lse).tolist()                  # SYNC: logprobs to the host
    o = 0
    for j, s in enumerate(seqs):
        a, b, n = kept[j], batch_rows[j], s.params.logprobs
        tops = [None] * (a + 1)
        if n is not None:
            tops = topn_logprobs(sel[o:o + a + 1] - lse[o:o + a + 1, None], toks[o:o + a + 1], n)
        result.accepted[b] = Accepted(s.draft_token_ids[:a], lps[o:o + a], tops[:a])
        result.tokens[b], result.logprobs[b], result.top[b] = nxt[j], lps[o + a], tops[a]
        o += a + 1
