"""StepPlan: what every rank agreed on for one step, passed down to whatever acts on it.

The engine's step sync (one small fixed-size all-reduce) produces it; the runner, the model's
operations and the dispatchers read it. Dispatchers hold no per-step state: a mode chosen from the
plan cannot outlive its step, and since every rank builds its plan from the same all-reduced numbers,
every rank's dispatchers run in the same mode.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    max_tokens: int = 0          # the largest token count of any rank this step (0: nobody has work)
    split: bool = False          # dual-batch overlap: run the step as two microbatches
    low_latency: bool = False    # dispatch in the padded fixed-size mode, capacity = max_tokens
    draft_passes: int = 0        # speculative decoding's MTP drafter: its forwards this step (MoE all-to-alls
    #                              each), the largest any rank asked for

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.draft_passes < 0:
            raise ValueError(f"draft_passes must be >= 0, got {self.draft_passes}")
        if self.low_latency and self.max_tokens == 0:
            raise ValueError("a low-latency plan needs max_tokens >= 1 (its padded capacity)")

    @classmethod
    def make(cls, max_tokens: int, split: bool = False, low_latency_max_tokens: int = 0,
             draft_passes: int = 0) -> "StepPlan":
        """The plan for a step whose largest rank has max_tokens tokens; steps of at most
        low_latency_max_tokens tokens per rank (the dispatcher's limit; 0 = never) use low-latency."""
        return cls(max_tokens, split, 0 < max_tokens <= low_latency_max_tokens, draft_passes)
