"""Reasoning split for DeepSeek's <think> ... </think>, found by token id: the output's tokens before the first
`</think>` token are the reasoning, the ones after it the answer. A `</think>` the model spells out of ordinary
tokens is text, not the end of the reasoning. The texts are the front's detokenized output
(skip_special_tokens as the request asks; launch/chat/output.py strips special tokens itself where a tool
parser made the front keep them), cut at the token's place.

    deepseek_r1  the output is reasoning until </think> (R1's generation prompt already opened <think>;
                 a leading <think> token in the output is dropped); no </think>: all reasoning
    deepseek_v3  as deepseek_r1 when the request asks for thinking (chat_template_kwargs thinking /
                 enable_thinking true), otherwise no reasoning: V3.1/V3.2 answer directly in chat mode
    deepseek_v4  as deepseek_r1 when the prompt ends with <think> (V4's encoding opened the reasoning:
                 thinking mode, its default), otherwise no reasoning

Without --reasoning-parser, a prompt whose generation prompt ends inside <think> (R1-style templates)
is split as deepseek_r1.
"""
from __future__ import annotations

from typing import Callable

THINK, END_THINK = "<think>", "</think>"
PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v4")


def wants_thinking(kwargs: dict) -> bool:
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


def starts_in_reasoning(parser: str | None, prompt: str, template_kwargs: dict) -> bool:
    """Does the output begin inside a reasoning block?"""
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":
        return wants_thinking(template_kwargs)
    if parser == "deepseek_v4":
        return prompt.endswith(THINK)
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplit:
    """Feed the front's output deltas (text and token ids) in order; each feed returns the new (reasoning,
    content) text. decode(ids) -> their text as the front decodes it (the same skip_special_tokens), which
    places the `</think>` token in the text. think_id / end_id: the tokenizer's <think> / </think> (None: it
    has none, so nothing ends the reasoning). Text positions are absolute (from the output's start); only the
    text not returned yet is kept."""

    def __init__(self, in_reasoning: bool, think_id: int | None, end_id: int | None,
                 decode: Callable[[list[int]], str]):
        self.in_reasoning, self.think_id, self.end_id, self.decode = in_reasoning, think_id, end_id, decode
        self.ended = not in_reasoning     # no reasoning, or its end was seen
        self.ids: list[int] = []          # the output's tokens up to the end of the reasoning
        self.base, self.buf = 0, ""       # buf: the text from position base on, not returned yet
        self.cut: tuple[int, int] | None = None   # [a, b): the </think> token's text
        self.skip = None                  # [0, skip): a leading <think> token's text, dropped

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        if not self.in_reasoning or (self.cut is not None and self.base >= self.cut[1]):
            return "", text
        if self.cut is None:
            self.ids += token_ids
        self.buf += text
        if self.skip is None and self.ids:
            self.skip = len(self.decode([self.think_id])) if self.ids[0] == self.think_id else 0
        if self.cut is None and self.end_id is not None and self.end_id in token_ids:
            self._place_end()
        end = self.base + len(self.buf)
        a, b = self.cut if self.cut is not None else (end, end)
        lo = max(self.base, self.skip or 0)
        reasoning = self.buf[lo - self.base:a - self.base] if lo < a else ""
        content = self.buf[max(lo, b) - self.base:] if b < end else ""
        self.base, self.buf = end, ""
        return reasoning, content

    def _place_end(self) -> None:
        """Where the first </think> token's text is: after the text of the tokens before it."""
        k = self.ids.index(self.end_id)
        mark = self.decode([self.end_id])
        at = len(self.decode(self.ids[:k]))
        rel = at - self.base
        if mark and rel >= 0 and not self.buf.startswith(mark, rel):   # the front's text may differ from one decode
            found = self.buf.find(mark, max(0, rel - len(mark)))
            at = self.base + found if found >= 0 else at
        self.cut, self.ended = (at, at + len(mark)), True
        del self.ids[k:]


def split(text: str, token_ids: list[int], in_reasoning: bool, think_id: int | None, end_id: int | None,
          decode: Callable[[list[int]], str]) -> tuple[str | None, str | None]:
    """The whole output -> (reasoning or None, content; None when the reasoning never ended)."""
    if not in_reasoning:
        return None, text
    s = ReasoningSplit(True, think_id, end_id, decode)
    reasoning, content = s.feed(text, token_ids)
    return reasoning, content if s.ended else None
