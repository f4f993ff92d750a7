"""Split one step's batch into two microbatches balanced by tokens (pure; torch-free host logic).

Legend: B sequences in the step, n_b tokens of sequence b this step (1 for a decode).
A part (b, lo, hi) is tokens lo .. hi-1 of sequence b's tokens this step.

- decode-only steps split by request: the first ceil(B/2) sequences, then the rest;
- steps with prefill split by tokens: the first ceil(N/2) tokens in order, then the rest, so a long
  prompt may be cut in two (as DeepSeek and SGLang do). Its second part attends to the first
  part's latents, which microbatch 0 writes to the cache before microbatch 1's attention of the
  same layer runs (the overlap schedule keeps microbatch 0 one stage ahead).

Example: n = [5, 1, 2] (prefill) -> N = 8, parts ([(0, 0, 4)], [(0, 4, 5), (1, 0, 1), (2, 0, 2)]).
"""
from __future__ import annotations

from dataclasses import dataclass

Part = tuple[int, int, int]  # (sequence index, lo, hi)


@dataclass(frozen=True)
class SplitConfig:
    decode_token_threshold: int = 2     # below this many tokens a decode step is not split
    prefill_token_threshold: int = 2    # below this many tokens a step with prefill is not split

    def __post_init__(self):
        if self.decode_token_threshold < 2 or self.prefill_token_threshold < 2:
            raise ValueError(f"DBO thresholds must be >= 2 (two non-empty microbatches), got "
                             f"decode {self.decode_token_threshold}, prefill {self.prefill_token_threshold}")


def can_split(num_tokens: list[int], cfg: SplitConfig) -> bool:
    """Whether this rank's step may be split (all ranks must agree; the step sync takes the AND)."""
    total = sum(num_tokens)
    if all(n == 1 for n in num_tokens):
        return total >= cfg.decode_token_threshold
    return total >= cfg.prefill_token_threshold


def split(num_tokens: list[int]) -> tuple[list[Part], list[Part]]:
    """num_tokens [B] -> (parts of microbatch 0, parts of microbatch 1); both non-empty when
    sum(num_tokens) >= 2. Token counts differ by at most 1 for prefill, requests by at most 1 for decode."""
    if not num_tokens:
        return [], []
    if all(n == 1 for n in num_tokens):
        half = -(-len(num_tokens) // 2)
        return ([(b, 0, 1) for b in range(half)], [(b, 0, 1) for b in range(half, len(num_tokens))])
    target = -(-sum(num_tokens) // 2)
    first: list[Part] = []
    second: list[Part] = []
    taken = 0
    for b, n in enumerate(num_tokens):
        if taken >= target:
            second.append((b, 0, n))
            continue
        cut = min(n, target - taken)
        first.append((b, 0, cut))
        if cut < n:
            second.append((b, cut, n))
        taken += cut
    return first, second
