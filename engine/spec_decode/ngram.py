"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min.

Per sequence, an index from each n-gram to the end of its latest occurrence, grown by the tokens
appended since the last step (a few dict writes per new token), so a proposal costs at most
(max - min + 1) lookups whatever the context length — not a scan of the history each step.
"""
from __future__ import annotations


class NgramIndex:
    """tokens: a sequence's token ids (prompt + output), read as they grow. An n-gram is indexed by
    the position just after it (its end e); ends up to len - 1 are indexed before a lookup, so the
    sequence's own suffix (end = len) never matches itself."""

    __slots__ = ("lo", "hi", "maps", "indexed")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.maps: list[dict[tuple, int]] = [{} for _ in range(hi - lo + 1)]   # maps[n - lo]: n-gram -> latest end
        self.indexed = 0                                                      # ends < indexed are in the maps

    def _grow(self, tokens: list[int], upto: int) -> None:
        lo, maps = self.lo, self.maps
        for e in range(max(self.indexed, lo), upto):
            for i, m in enumerate(maps):
                n = lo + i
                if n > e:
                    break
                m[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """-> up to k drafts (the tokens after the longest suffix's latest earlier occurrence), or []."""
        L = len(tokens)
        if k <= 0 or L < self.lo + 1:
            return []
        self._grow(tokens, L)   # ends <= L - 1
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            e = self.maps[n - self.lo].get(tuple(tokens[L - n:]))
            if e is not None:
                return tokens[e:e + k]
        return []


def propose_reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The same proposal by scanning the history (for tests): the longest n in [lo, hi] whose suffix
    occurs earlier, its latest earlier occurrence, the k tokens after it."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                return tokens[e:e + k]
    return []
