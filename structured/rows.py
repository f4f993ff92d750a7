"""The rank's side of structured outputs, one step at a time: each constrained sequence's matcher,
the bitmask of the constrained rows, and the sampled tokens fed back.

Legend: B rows sampling this step, R of them constrained (R <= B), W bitmask words per row.
A sequence's matcher is made the first time it samples, from its compiled grammar, and replays the
output tokens it already has: a request re-admitted after a rank loss, or a decode-pool sequence
whose first token came from the prefill pool, starts where its output is. Preemption keeps the
output tokens and the matcher (the recompute samples nothing until it has caught up), so nothing is
rewound. Unconstrained rows are never touched, and a step without constrained rows never gets here.

A spec with after_token (the end of the reasoning) leaves the output free until that token is sampled: the
sequence's row is not masked, its tokens are not fed to the matcher, and the grammar starts right after it
(EOS may end the output before then, as without a grammar).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import allocate, mask_
from .compiler import GrammarCompiler


class SequenceGrammar:
    """Sequence.grammar: finish is None while the output may go on, "stop" once the grammar ended
    (engine/sched/sequence.py finishes the sequence with it), "abort" if a token was refused. waiting: the
    token the grammar starts after (after_token) has not been sampled yet."""
    __slots__ = ("matcher", "finish", "after_token", "waiting")

    def __init__(self, matcher, after_token: int | None = None):
        self.matcher, self.finish = matcher, None
        self.after_token, self.waiting = after_token, after_token is not None

    def accept(self, token: int) -> None:
        if self.waiting:
            self.waiting = token != self.after_token
        elif not self.matcher.accept(token):
            self.finish = "abort"   # only a token the bitmask allowed is sampled: never expected
        elif self.matcher.terminated:
            self.finish = "stop"

    def _free(self, drafts: list[int]) -> int:
        """How many leading drafts fall before the grammar starts (the after_token included)."""
        if not self.waiting:
            return 0
        return drafts.index(self.after_token) + 1 if self.after_token in drafts else len(drafts)

    def valid_prefix(self, drafts: list[int]) -> int:
        """Speculative decoding: how many leading drafts the grammar allows (it stops before a token that
        would follow its end); the matcher is left as it was."""
        free = self._free(drafts)
        n = self.matcher.accept_prefix(drafts[free:])
        self.matcher.rollback(n)
        return free + n

    def fill_drafts(self, drafts: list[int], backend, bitmask: torch.Tensor) -> None:
        """bitmask [k+1, W] <- row j: the allowed tokens after the first j drafts (which the grammar allows:
        valid_prefix; every token while the grammar has not started); the matcher is left as it was."""
        m, free = self.matcher, self._free(drafts)
        for j in range(free, len(drafts) + 1):
            backend.fill([m], bitmask[j:j + 1])
            if j < len(drafts) and m.accept_prefix(drafts[j:j + 1]) != 1:
                raise RuntimeError(f"draft {j} ({drafts[j]}) is not allowed by the grammar it was checked against")
        m.rollback(len(drafts) - free)


@dataclass
class GrammarPlan:
    rows: list[int]              # [R] batch rows
    grammars: list               # [R] SequenceGrammar
    masked: list[int]            # [M] the rows among them whose grammar has started (M <= R)
    bitmask: torch.Tensor | None  # [M, W] int32, host; None when M == 0


def stop_ids(seq) -> list[int]:
    """The tokens that end seq, which the grammar allows only where it may end."""
    p = seq.params
    ids = [] if p.ignore_eos else list(seq.eos_token_ids)
    return ids + [t for t in p.stop_token_ids if t not in ids]


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler, self.backend = compiler, compiler.backend

    def grammar_of(self, seq) -> SequenceGrammar:
        g = seq.grammar
        if g is None:
            spec = seq.params.structured_outputs
            compiled = self.compiler.get(spec)   # ready unless the rank skipped admission
            g = seq.grammar = SequenceGrammar(self.backend.matcher(compiled, stop_ids(seq)), spec.after_token)
            for t in seq.output_token_ids:
                g.accept(t)
        return g

    def plan(self, seqs: list, rows: list[int]) -> GrammarPlan:
        """seqs: the step's sampling rows; rows: the constrained ones among them."""
        grammars = [self.grammar_of(seqs[b]) for b in rows]
        started = [i for i, g in enumerate(grammars) if not g.waiting]
        bitmask = None
        if started:
            bitmask = allocate(len(started), self.compiler.vocab_size)
            self.backend.fill([grammars[i].matcher for i in started], bitmask)
        return GrammarPlan(rows, grammars, [rows[i] for i in started], bitmask)

    def apply(self, logits: torch.Tensor, plan: GrammarPlan) -> None:
        """logits [B, V] in place: the started rows masked to their grammar's next tokens."""
        if plan.masked:
            mask_(logits, plan.bitmask, plan.masked)

    def mask_drafts(self, logits: torch.Tensor, seq) -> None:
        """A verification's rows logits [k+1, V] in place: row j masked to the grammar after seq's first j drafts."""
        g = self.grammar_of(seq)
        if g.waiting and g.after_token not in seq.draft_token_ids:
            return
        bitmask = allocate(logits.shape[0], self.compiler.vocab_size)
        g.fill_drafts(seq.draft_token_ids, self.backend, bitmask)
        mask_(logits, bitmask, list(range(logits.shape[0])))

    def accept(self, plan: GrammarPlan, tokens: torch.Tensor) -> None:
        """tokens [B]: this step's samples."""
        rows = plan.rows
        picked = tokens if len(rows) == tokens.shape[0] else tokens[torch.tensor(rows, device=tokens.device)]
        for g, t in zip(plan.grammars, picked.tolist()):   # SYNC: the matchers advance on the host
            g.accept(t)
