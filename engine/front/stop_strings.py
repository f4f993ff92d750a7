"""Stop strings, matched on the front on the detokenized output text (a stop string may span
several tokens, and one token may hold it with text on either side).

Pure helpers over strings; engine/front/outputs.py keeps a StopMatcher per request that has stop
strings and calls it once per new token, so a match is found at the token that completes it.
find_stop is the reference: one str.find per stop string.
"""
from __future__ import annotations

import re


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


class StopMatcher:
    """find_stop for one request's stop strings (non-empty), as one regular-expression search over
    the text's tail: the strings are alternatives, longest first, so at one position the longer
    wins, and the search finds the earliest position. It relies on find_stop's premise: text[:start]
    holds no stop string (a shorter one could otherwise be found ending before start)."""

    def __init__(self, stops: list[str]):
        self.longest = max(len(s) for s in stops)
        self.hold = hold_back(stops)
        self._search = re.compile("|".join(re.escape(s) for s in sorted(stops, key=len, reverse=True))).search

    def find(self, text: str, start: int) -> tuple[int, str] | None:
        m = self._search(text, max(0, start - self.longest + 1))
        return None if m is None else (m.start(), m.group())
