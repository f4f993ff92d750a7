"""Special tokens' text taken out of a text stream: where a tool parser needs the front to keep special tokens
(V3 / V3.1 markup that a tokenizer marks special), the reasoning and the answer still follow the request's
skip_special_tokens. A tail that could still become a special token's text is held back until it cannot."""
from __future__ import annotations

import re


class SpecialStripper:
    def __init__(self, specials: list[str]):
        specials = sorted({s for s in specials if s}, key=len, reverse=True)
        self._find = re.compile("|".join(map(re.escape, specials))).sub if specials else None
        self._prefixes = {s[:k] for s in specials for k in range(1, len(s))}
        self._longest = max(map(len, specials), default=0)
        self.buf = ""

    def feed(self, text: str, final: bool) -> str:
        if self._find is None:
            return text
        buf = self._find("", self.buf + text)
        keep = 0
        if not final:
            for k in range(min(self._longest - 1, len(buf)), 0, -1):
                if buf[-k:] in self._prefixes:
                    keep = k
                    break
        self.buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]
