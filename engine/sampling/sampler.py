"""Token sampling from logits: greedy, temperature, min-p, top-k, top-p, per-request seeds; logprobs.

Legend: B rows (sequences sampling this step), G rows of one group, V vocab.
Rows are sampled in groups that share a generator: every unseeded request draws from the engine's
one generator, so they form one group and are filtered and drawn with a few batched tensor ops
whatever B is; a seeded request has its own generator, hence its own group of one (its draws depend
only on its seed and its own logits, never on what else is in the batch). Greedy rows never draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from wideep.attention_mla.meta import int64_tensor

from ..sampling_params import SamplingParams


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


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B], torch's logsumexp without its slow path on the CPU: the exponentials of values far below a
    row's peak (a peaked row: e^-88 and less are denormal or zero) take MKL's rare-case loop there, ~20x slower (4
    rows of 4096 logits spread by ~100: 0.5 ms against 27 us). Clamped 87 below the peak every exponential is a
    normal float, and those terms (at most V e^-87) cannot change a float32 sum that holds the peak's 1."""
    if x.device.type != "cpu" or not x.shape[-1]:
        return x.logsumexp(-1)
    peak = x.amax(-1, keepdim=True)
    if not bool(torch.isfinite(peak).all()):   # a row all -inf, or an inf / nan: torch's rules
        return x.logsumexp(-1)
    return (x - peak).clamp_(min=-87.0).exp_().sum(-1).log_().add_(peak.squeeze(-1))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [G, V] fp32, temperature [G] (> 0), top_k [G] int (<= 0 or >= V: off), top_p [G] (1: off),
    min_p [G] (0: off; None: no row) -> [G, V] logits / temperature with the filtered-out tokens at
    -inf. vLLM's order: temperature, min_p, top-k, top-p."""
    V = logits.shape[1]
    out = logits / temperature[:, None]
    if min_p is not None:
        # p / p_max < min_p  <=>  logit - max_logit < log(min_p); log(0) = -inf drops nothing
        floor = out.amax(-1, keepdim=True) + min_p[:, None].log()
        out = out.masked_fill(out < floor, float("-inf"))
    k_on = (top_k > 0) & (top_k < V)
    if bool(k_on.any()):  # SYNC: (host params) skip the sort when no row filters
        kmax = int(torch.where(k_on, top_k, 1).max())
        kth = out.topk(kmax, dim=-1).values.gather(1, (torch.where(k_on, top_k, 1) - 1)[:, None])    # [G, 1]
        out = out.masked_fill(k_on[:, None] & (out < kth), float("-inf"))
    p_on = top_p < 1.0
    if bool(p_on.any()):  # SYNC: (host params) as above
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & p_on[:, None]
        out = out.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return out


def draw(filtered: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """filtered [G, V] logits (-inf: excluded) -> [G] token ids, one uniform draw per row from
    `generator`: the first token whose cumulative probability reaches u (inverse CDF; u in (0, 1] and
    scaled by the row's total mass, so a token of probability 0 is never drawn)."""
    return _draw(filtered, generator)[0]


def _draw(filtered: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """draw(), and the rows' logsumexp from the same exponentials (an unfiltered group needs no
    second pass over [G, V] for its logprobs): softmax p, and logsumexp = peak - log(p at the peak).
    torch's softmax kernel, not exp(x - peak): on CPU, exp over rows that are mostly -inf (a grammar's
    mask, top-k) runs ~2x slower than over finite values; softmax takes the same time on both."""
    peak = filtered.amax(-1, keepdim=True)
    probs = filtered.softmax(-1)
    lse = peak - probs.amax(-1, keepdim=True).log()
    cdf = probs.cumsum_(-1)                                                   # CDF (total ~ 1)
    total = cdf[:, -1:]
    u = 1.0 - torch.rand(filtered.shape[0], 1, generator=generator, device=filtered.device)
    # first index whose CDF reaches u * total: a cumulative sum of non-negative terms never
    # decreases, so a binary search finds it (the same index as counting the entries below)
    tokens = torch.searchsorted(cdf, u * total).squeeze(1)
    return tokens, lse.squeeze(1)


@dataclass
class RowGroup:
    """Rows that draw from one generator: rows [G] (None: every row of the batch), their filter
    parameters as tensors (None: no row filters, the raw distribution)."""
    generator: torch.Generator | None
    rows: torch.Tensor | None
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None


@dataclass
class SampleLayout:
    """How a batch's rows sample: `greedy` rows take the argmax, the others draw in `groups`. It
    depends only on the rows' params and generators, so a decode run (the same rows step after step)
    builds it once: the runner keeps it while the rows stay (sample_layout)."""
    greedy: int
    groups: list[RowGroup]


def sample_layout(params: list[SamplingParams], generators: list[torch.Generator | None], device) -> SampleLayout:
    greedy, by_gen = 0, {}
    for b, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            greedy += 1
        else:
            rows = by_gen.get(id(gen))
            if rows is None:
                rows = by_gen[id(gen)] = (gen, [])
            rows[1].append(b)
    B, groups = len(params), []
    for gen, rows in by_gen.values():
        ps = [params[b] for b in rows]
        filters = None
        if any(p.temperature != 1.0 or p.top_p < 1.0 or p.top_k > 0 or p.min_p > 0 for p in ps):
            min_p = (torch.tensor([p.min_p for p in ps], device=device) if any(p.min_p > 0 for p in ps)
                     else None)
            filters = (torch.tensor([p.temperature for p in ps], device=device),
                       int64_tensor([p.top_k for p in ps], device),
                       torch.tensor([p.top_p for p in ps], device=device), min_p)
        groups.append(RowGroup(gen, None if len(rows) == B else int64_tensor(rows, device), filters))
    return SampleLayout(greedy, groups)


def sample(logits: torch.Tensor, params: list[SamplingParams] | None,
           generators: list[torch.Generator | None] | None, raw: torch.Tensor | None = None,
           layout: SampleLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (token ids [B] int64, logsumexp [B]): row b's raw logprobs are
    logits[b] - logsumexp[b] (never materialised for the whole batch). raw [B, V]: the model's
    logits when `logits` were processed (penalties, bias: logits_process.py); the logsumexp is then
    raw's, since logprobs are of the raw distribution. layout: sample_layout(params, generators), when
    the caller kept it from an earlier step of the same rows (params and generators are then unused)."""
    B = logits.shape[0]
    if layout is None:
        layout = sample_layout(params, generators, logits.device)
    out = logits.argmax(-1) if layout.greedy else torch.empty(B, dtype=torch.int64, device=logits.device)
    lse = None
    for g in layout.groups:
        every = g.rows is None                            # the whole batch: no gather, no scatter
        group = logits if every else logits.index_select(0, g.rows)
        if g.filters is not None:
            group = filter_logits(group, *g.filters)
        elif every and raw is None:   # the raw logits of every row: their logsumexp comes with the draw
            out, lse = _draw(group, g.generator)
            continue
        if every:
            out = draw(group, g.generator)
        else:
            out[g.rows] = draw(group, g.generator)
    if lse is None:
        lse = logsumexp(logits if raw is None else raw)
    return out, lse
