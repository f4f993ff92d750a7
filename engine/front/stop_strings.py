"""Stop strings, matched on the front on the detokenized output text (a stop string may span
several tokens, and one token may hold it with text on either side).

Pure helpers over strings; engine/front/outputs.py calls them once per new token of a request that
has stop strings, so a match is found at the token that completes it.
"""
from __future__ import annotations


def find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in text that ends at or after `start` (the text before `start` was
    searched already). -> (its position, the string) or None. Ties at one position: the longer."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(0, start - len(s) + 1))
        if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(s) > len(best[1]))):
            best = (pos, s)
    return best


def hold_back(stops: list[str]) -> int:
    """Characters of not-yet-final text to withhold from a client: a tail shorter than the longest
    stop string could still become one (vLLM's stop buffer), and a client must never see it."""
    return max((len(s) for s in stops), default=1) - 1
