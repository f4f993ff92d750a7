"""Per-request logits processing before sampling, as vLLM defines it: min_tokens, logit_bias, then
the repetition, frequency and presence penalties (vLLM's order). min_p runs later, after temperature
(sampler.filter_logits). Nothing here syncs with the device: the host knows every parameter and
every sequence's length; the token counts live on the device and are updated there.

Legend: B rows sampling this step, P of them penalised, S pool slots, V vocab.
Rows without any processing pay nothing: each part gathers only the rows that need it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from wideep.attention_mla.meta import int64_tensor


class TokenCounts:
    """One pool row per penalised sequence, kept in the form the penalties apply in, so a step reads
    them as they are and updates only the entries of the tokens it sampled:
    out_counts [S, V] int32 (times each token was sampled), rep_scale [S, V] fp32 (the sequence's
    repetition penalty where the token is in its prompt or output, 1 elsewhere), sub [S, V] fp32
    (frequency_penalty * count + presence_penalty * (count > 0)). A slot is filled from the
    sequence's tokens when it first samples (a resumed or preempted sequence included) and then takes
    one scatter per tensor per step. Slots of finished sequences are reclaimed when the pool is full,
    before it grows. (12 bytes per slot and vocab entry: at V = 129k, 1.6 MB a sequence.)"""

    def __init__(self, vocab: int, device):
        self.vocab, self.device = vocab, device
        self.out_counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.rep_scale = torch.ones(0, vocab, dtype=torch.float32, device=device)
        self.sub = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.slot_of: dict = {}          # Sequence -> slot
        self.free: list[int] = []

    def slots(self, seqs: list) -> list[int]:
        out = []
        for s in seqs:
            slot = self.slot_of.get(s)
            if slot is None:
                slot = self._new_slot(s)
            out.append(slot)
        return out

    def _new_slot(self, s) -> int:
        if not self.free:
            for seq in [q for q in self.slot_of if q.finished]:
                self.free.append(self.slot_of.pop(seq))
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.slot_of[s] = slot
        dev, p = self.device, s.params
        counts = torch.bincount(int64_tensor(s.output_token_ids, dev), minlength=self.vocab)
        seen = counts > 0
        self.out_counts[slot] = counts
        self.sub[slot] = p.frequency_penalty * counts + p.presence_penalty * seen
        self.rep_scale[slot] = 1.0
        self.rep_scale[slot, int64_tensor(s.prompt_token_ids, dev)] = p.repetition_penalty
        self.rep_scale[slot, seen] = p.repetition_penalty
        return slot

    def _grow(self) -> None:
        S = self.out_counts.shape[0]
        n = max(8, 2 * S)
        grown = []
        for old, fill in ((self.out_counts, 0), (self.rep_scale, 1.0), (self.sub, 0.0)):
            t = torch.full((n, self.vocab), fill, dtype=old.dtype, device=self.device)
            t[:S] = old
            grown.append(t)
        self.out_counts, self.rep_scale, self.sub = grown
        self.free.extend(range(n - 1, S - 1, -1))

    def add(self, slots: torch.Tensor, tokens: torch.Tensor, rep: torch.Tensor | None,
            freq: torch.Tensor | None, pres: torch.Tensor | None) -> None:
        """slots [P] (distinct), tokens [P]: this step's samples; rep/freq/pres [P, 1]: the rows'
        penalties (None: neutral in every row, their table needs no update)."""
        at = (slots, tokens)
        self.out_counts.index_put_(at, torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        if freq is not None or pres is not None:
            count = self.out_counts[at]                               # [P], >= 1 now
            value = freq[:, 0] * count if freq is not None else torch.zeros_like(count, dtype=torch.float32)
            self.sub.index_put_(at, value + pres[:, 0] if pres is not None else value)
        if rep is not None:
            self.rep_scale.index_put_(at, rep[:, 0])

    def rows(self, table: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
        """table's rows of the slots: a view when they are consecutive (the usual case: a batch's
        sequences take their slots in order)."""
        return table[slots] if isinstance(slots, slice) else table.index_select(0, slots)


@dataclass
class LogitsPlan:
    """What one step's rows need, as device tensors built from host lists.
    mask_rows/mask_ids [M]: (row, token) pairs set to -inf (min_tokens); bias_rows/ids/vals [N];
    pen_rows [P] batch rows, pen_slots [P] pool rows (a slice when consecutive), rep/freq/pres [P, 1];
    every_pen: P == B; grammar: the constrained rows' bitmask (structured/rows.py), applied first and
    in place (constrain): as in vLLM, logprobs are then those of the constrained distribution."""
    mask_rows: torch.Tensor | None = None
    mask_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    pen_rows: torch.Tensor | None = None
    pen_slots: torch.Tensor | None = None
    pen_slot_rows: torch.Tensor | slice | None = None
    rep: torch.Tensor | None = None
    freq: torch.Tensor | None = None
    pres: torch.Tensor | None = None
    every_pen: bool = False
    grammar: object = None

    @property
    def grammar_only(self) -> bool:
        """Nothing but the grammar's mask: the sampler needs no copy of the logits."""
        return self.mask_rows is None and self.bias_rows is None and self.pen_rows is None


class LogitsProcessor:
    """plan(seqs) -> LogitsPlan | None (None: no row needs anything); constrain(logits, plan) in place
    first when plan.grammar (structured outputs); apply(logits, plan) -> processed copy; record(plan,
    tokens) after sampling. One per rank, beside the runner."""

    def __init__(self, vocab: int, device, grammars=None):
        self.vocab, self.device = vocab, device
        self.counts = TokenCounts(vocab, device)
        self._last_seqs: list = []
        self._static: tuple[LogitsPlan | None, list[int], list[int]] = (None, [], [])
        self._grammars = grammars         # -> the rank's structured.compiler.GrammarCompiler (called once)
        self.grammar_rows = None          # structured.rows.GrammarRows, built for the first constrained row

    def plan(self, seqs: list) -> LogitsPlan | None:
        """seqs: the sampling rows, in batch order. A decode run samples the same rows step after step:
        then the bias and penalty tensors of the last step are reused, only min_tokens is re-checked."""
        if seqs != self._last_seqs:        # identity comparison (Sequence has eq=False)
            self._last_seqs, self._static = list(seqs), self._static_plan(seqs)
        static, min_rows, guided = self._static
        mask_rows, mask_ids = [], []
        for b in min_rows:
            s = seqs[b]
            p = s.params
            if len(s.output_token_ids) < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(s.eos_token_ids))
                mask_rows.extend([b] * len(ids))
                mask_ids.extend(ids)
        if not mask_rows and not guided:
            return static
        plan = LogitsPlan(**vars(static)) if static is not None else LogitsPlan()
        if mask_rows:
            plan.mask_rows, plan.mask_ids = int64_tensor(mask_rows, self.device), int64_tensor(mask_ids, self.device)
        if guided:   # structured outputs: the grammars' next tokens, every step
            plan.grammar = self.grammar_rows_().plan(seqs, guided)
        return plan

    def _static_plan(self, seqs: list) -> tuple[LogitsPlan | None, list[int], list[int]]:
        """-> (the plan's parts that stay while the rows stay: bias and penalties; None when no row
        has any, rows with min_tokens, rows with structured outputs)."""
        min_rows, guided, bias_rows, bias_ids, bias_vals = [], [], [], [], []
        pen_rows, pen_seqs, rep, freq, pres = [], [], [], [], []
        for b, s in enumerate(seqs):
            p = s.params
            if not p.processed:
                continue
            if p.min_tokens > 0:
                min_rows.append(b)
            if p.structured_outputs is not None:
                guided.append(b)
            if p.logit_bias is not None:
                bias_rows.extend([b] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias.keys())
                bias_vals.extend(p.logit_bias.values())
            if p.penalised:
                pen_rows.append(b)
                pen_seqs.append(s)
                rep.append(p.repetition_penalty)
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
        if not (bias_rows or pen_rows):
            return None, min_rows, guided
        dev, plan = self.device, LogitsPlan()
        if bias_rows:
            plan.bias_rows, plan.bias_ids = int64_tensor(bias_rows, dev), int64_tensor(bias_ids, dev)
            plan.bias_vals = torch.tensor(bias_vals, dtype=torch.float32, device=dev)
        if pen_rows:
            plan.pen_rows = int64_tensor(pen_rows, dev)
            slots = self.counts.slots(pen_seqs)
            plan.pen_slots = int64_tensor(slots, dev)
            consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
            plan.pen_slot_rows = slice(slots[0], slots[0] + len(slots)) if consecutive else plan.pen_slots
            # a penalty no row uses is skipped (None), not applied at its neutral value
            plan.rep, plan.freq, plan.pres = (
                torch.tensor(v, dtype=torch.float32, device=dev)[:, None] if any(x != off for x in v) else None
                for v, off in ((rep, 1.0), (freq, 0.0), (pres, 0.0)))
            plan.every_pen = len(pen_rows) == len(seqs)
        return plan, min_rows, guided

    def apply(self, logits: torch.Tensor, plan: LogitsPlan) -> torch.Tensor:
        """logits [B, V] fp32 (left as is) -> processed [B, V]."""
        out = logits
        if plan.mask_rows is not None or plan.bias_rows is not None:
            out = logits.clone()
            if plan.mask_rows is not None:
                out[plan.mask_rows, plan.mask_ids] = float("-inf")
            if plan.bias_rows is not None:
                out.index_put_((plan.bias_rows, plan.bias_ids), plan.bias_vals, accumulate=True)
        if plan.pen_rows is not None:
            c, slots = self.counts, plan.pen_slot_rows
            rows = apply_penalties(out if plan.every_pen else out.index_select(0, plan.pen_rows),
                                   c.rows(c.rep_scale, slots) if plan.rep is not None else None,
                                   c.rows(c.sub, slots) if plan.freq is not None or plan.pres is not None else None)
            if plan.every_pen:     # a new tensor already: no scatter back
                return rows
            if out is logits:
                out = logits.clone()
            out[plan.pen_rows] = rows
        return out

    def grammar_rows_(self):
        """structured.rows.GrammarRows, built when first needed."""
        if self.grammar_rows is None:
            from wideep.structured.rows import GrammarRows
            self.grammar_rows = GrammarRows(self._grammars())
        return self.grammar_rows

    def constrain(self, logits: torch.Tensor, plan: LogitsPlan) -> None:
        """logits [B, V] in place: the constrained rows masked to their grammar (before all else)."""
        self.grammar_rows.apply(logits, plan.grammar)

    def record(self, plan: LogitsPlan | None, tokens: torch.Tensor) -> None:
        """tokens [B]: this step's samples; the penalised rows' tables take theirs."""
        if plan is not None and plan.pen_rows is not None:
            self.counts.add(plan.pen_slots, tokens if plan.every_pen else tokens.index_select(0, plan.pen_rows),
                            plan.rep, plan.freq, plan.pres)
        if plan is not None and plan.grammar is not None:
            self.grammar_rows.accept(plan.grammar, tokens)


def apply_penalties(logits: torch.Tensor, rep_scale: torch.Tensor | None, sub: torch.Tensor | None) -> torch.Tensor:
    """logits [P, V]; rep_scale [P, V] (the repetition penalty over the tokens of prompt and output, 1
    elsewhere; None: off in every row); sub [P, V] (frequency * count + presence * (count > 0), over
    the output; None: off) -> a new [P, V]. Repetition divides positive logits and multiplies
    negative ones: split at 0 (max(x, 0) / r + min(x, 0) * r: no comparison or select over [P, V],
    and a logit of -inf stays -inf); then the frequency and presence penalties subtract."""
    out = logits
    if rep_scale is not None:
        out = logits.clamp_min(0).div_(rep_scale).add_(logits.clamp_max(0).mul_(rep_scale))
    if sub is not None:
        out = out - sub
    return out if out is not logits else logits.clone()
