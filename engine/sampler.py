"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds; logprobs.

Legend: B rows (sequences sampling this step), V vocab.
"""
from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def topn_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int) -> list[dict[int, float]]:
    """logprobs [B, V], token_ids [B] -> per row {token: logprob, top-n tokens: logprob}."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rows = [{int(t): float(v)} for t, v in zip(token_ids.tolist(), chosen.tolist())]  # SYNC: results to host
    if n > 0:
        vals, idx = logprobs.topk(n, dim=-1)
        for row, vs, ids in zip(rows, vals.tolist(), idx.tolist()):  # SYNC: results to host
            for t, v in zip(ids, vs):
                row.setdefault(t, v)
    return rows


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (token ids [B] int64, raw logprobs [B, V])."""
    logprobs = logits.log_softmax(-1)
    out = logits.argmax(-1)
    for b, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        row = logits[b] / p.temperature
        if 0 < p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = row.softmax(-1)
        out[b] = torch.multinomial(probs, 1, generator=gen)[0]
    return out, logprobs
