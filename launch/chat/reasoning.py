"""Reasoning split for DeepSeek's <think> ... </think>: the text before </think> is the reasoning,
the rest the answer. It reads text with the special tokens kept (the engine's text drops them).

    deepseek_r1  the output is reasoning until </think> (R1's generation prompt already opened <think>;
                 a leading <think> in the output is dropped); no </think> yet: all reasoning
    deepseek_v3  as deepseek_r1 when the request asks for thinking (chat_template_kwargs thinking /
                 enable_thinking true), otherwise no reasoning: V3.1/V3.2 answer directly in chat mode

Without --reasoning-parser, a prompt whose generation prompt ends inside <think> (R1-style templates)
is split as deepseek_r1.
"""
from __future__ import annotations

THINK, END_THINK = "<think>", "</think>"
PARSERS = ("deepseek_r1", "deepseek_v3")


def wants_thinking(kwargs: dict) -> bool:
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


def starts_in_reasoning(parser: str | None, prompt: str, template_kwargs: dict) -> bool:
    """Does the output begin inside a reasoning block? (Then the parsers need the special tokens.)"""
    opened = prompt.rfind(THINK) > prompt.rfind(END_THINK)
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":
        return wants_thinking(template_kwargs)
    return opened


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Feed the output text (special tokens kept) chunk by chunk; each feed returns the new
    (reasoning, content) text. A </think> split across chunks is held back until it is whole."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._start = True  # a leading <think> is markup, not reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        self._buf += text
        if self._start:
            stripped = self._buf.lstrip()
            if THINK.startswith(stripped) and not final:
                return "", ""  # could still become <think>
            if stripped.startswith(THINK):
                self._buf = stripped[len(THINK):]
            self._start = False
        end = self._buf.find(END_THINK)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(END_THINK):]
            self.in_reasoning, self._buf = False, ""
            return reasoning, content
        keep = 0 if final else held_back(self._buf, END_THINK)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out, ""


def split(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """The whole output -> (reasoning or None, content)."""
    if not in_reasoning:
        return None, text
    reasoning, content = ReasoningSplitter(True).feed(text, final=True)
    return reasoning, content
