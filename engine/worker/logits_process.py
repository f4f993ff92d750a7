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

from attention_mla.meta import int64_tensor


class TokenCounts:
    """One pool row per penalised sequence: out_counts [S, V] int32 (times each token was sampled),
    in_prompt [S, V] bool. A slot is filled from the sequence's tokens when it first samples (a
    resumed or preempted sequence included) and then grows by one scatter-add per step. Slots of
    finished sequences are reclaimed when the pool is full, before it grows."""

    def __init__(self, vocab: int, device):
        self.vocab, self.device = vocab, device
        self.out_counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
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
        dev = self.device
        self.out_counts[slot] = torch.bincount(int64_tensor(s.output_token_ids, dev), minlength=self.vocab)
        self.in_prompt[slot] = False
        self.in_prompt[slot, int64_tensor(s.prompt_token_ids, dev)] = True
        return slot

    def _grow(self) -> None:
        S = self.out_counts.shape[0]
        n = max(8, 2 * S)
        counts = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(n, self.vocab, dtype=torch.bool, device=self.device)
        counts[:S], prompt[:S] = self.out_counts, self.in_prompt
        self.out_counts, self.in_prompt = counts, prompt
        self.free.extend(range(n - 1, S - 1, -1))

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """slots [P], tokens [P]: this step's samples."""
        self.out_counts.index_put_((slots, tokens), torch.ones_like(slots, dtype=torch.int32), accumulate=True)


@dataclass
class LogitsPlan:
    """What one step's rows need, as device tensors built from host lists.
    mask_rows/mask_ids [M]: (row, token) pairs set to -inf (min_tokens); bias_rows/ids/vals [N];
    pen_rows [P] batch rows, pen_slots [P] pool rows, rep/freq/pres [P]; every_pen: P == B;
    grammar: the constrained rows' bitmask (structured/rows.py), applied first and in place
    (constrain): as in vLLM, logprobs are then those of the constrained distribution."""
    mask_rows: torch.Tensor | None = None
    mask_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    pen_rows: torch.Tensor | None = None
    pen_slots: torch.Tensor | None = None
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
            if self.grammar_rows is None:
                from structured.rows import GrammarRows
                self.grammar_rows = GrammarRows(self._grammars())
            plan.grammar = self.grammar_rows.plan(seqs, guided)
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
            plan.pen_slots = int64_tensor(self.counts.slots(pen_seqs), dev)
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
            rows = apply_penalties(out if plan.every_pen else out[plan.pen_rows],
                                   self.counts.out_counts[plan.pen_slots], self.counts.in_prompt[plan.pen_slots],
                                   plan.rep, plan.freq, plan.pres)
            if plan.every_pen:     # a new tensor already: no scatter back
                return rows
            if out is logits:
                out = logits.clone()
            out[plan.pen_rows] = rows
        return out

    def constrain(self, logits: torch.Tensor, plan: LogitsPlan) -> None:
        """logits [B, V] in place: the constrained rows masked to their grammar (before all else)."""
        self.grammar_rows.apply(logits, plan.grammar)

    def record(self, plan: LogitsPlan | None, tokens: torch.Tensor) -> None:
        """tokens [B]: this step's samples; the penalised rows' counts take theirs."""
        if plan is not None and plan.pen_rows is not None:
            self.counts.add(plan.pen_slots, tokens if plan.every_pen else tokens[plan.pen_rows])
        if plan is not None and plan.grammar is not None:
            self.grammar_rows.accept(plan.grammar, tokens)


def apply_penalties(logits: torch.Tensor, out_counts: torch.Tensor, in_prompt: torch.Tensor,
                    rep: torch.Tensor | None, freq: torch.Tensor | None, pres: torch.Tensor | None) -> torch.Tensor:
    """logits [P, V], out_counts [P, V] int, in_prompt [P, V] bool, rep/freq/pres [P, 1] (None: off
    in every row) -> a new [P, V]. Repetition (over prompt and output) divides positive logits and
    multiplies negative ones; frequency subtracts freq * count, presence pres * (count > 0), over
    the output only."""
    seen = out_counts > 0
    if rep is not None:
        logits = torch.where(seen | in_prompt, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if freq is not None:
        logits = logits - freq * out_counts
    if pres is not None:
        logits = logits - pres * seen
    return logits if rep is not None or freq is not None or pres is not None else logits.clone()
