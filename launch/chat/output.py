"""One chat choice's output as it grows: the front's deltas (text and token ids) in, (reasoning, content, tool
calls) deltas out. The reasoning split is by token id (launch/chat/reasoning.py), tool calls by the tool-call
parser's stream (launch/chat/tool_parsers.py; a forced tool choice in JSON: launch/chat/json_calls.py), and, where the front kept special tokens only for that parser,
their text is taken out of the reasoning and the answer (launch/chat/special_text.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .reasoning import ReasoningSplit
from .json_calls import JsonToolCalls
from .special_text import SpecialStripper
from .tool_parsers import ToolCallStream


@dataclass(frozen=True)
class OutputFormat:
    """What a request's output is read with. decode(ids): the front's text of ids (its skip_special_tokens);
    strip: special tokens' texts to take out (the front kept them for the tool parser, the request did not
    ask for them); max_calls: 1 with parallel_tool_calls false; forced_json: tool_choice "required" or a tool's
    name, constrained as JSON (the answer is that JSON)."""
    in_reasoning: bool
    tool_parser: str | None
    decode: Callable[[list[int]], str]
    think_id: int | None = None
    end_id: int | None = None
    strip: tuple[str, ...] = ()
    max_calls: int | None = None
    forced_json: str | None = None


class ChatOutput:
    def __init__(self, fmt: OutputFormat):
        self.fmt = fmt
        self.split = ReasoningSplit(fmt.in_reasoning, fmt.think_id, fmt.end_id, fmt.decode)
        self.tools = (JsonToolCalls(fmt.forced_json) if fmt.forced_json else
                      ToolCallStream(fmt.tool_parser, fmt.max_calls) if fmt.tool_parser else None)
        self.strip_r, self.strip_c = SpecialStripper(list(fmt.strip)), SpecialStripper(list(fmt.strip))
        self.calls: list = []     # the calls sent so far
        self.reasoning_seen = False

    @property
    def ended_reasoning(self) -> bool:
        return self.split.ended

    def feed(self, text: str, token_ids: list[int], final: bool) -> dict:
        """-> {"reasoning_content": str, "content": str, "tool_calls": [...]}, the new parts only."""
        r, c = self.split.feed(text, token_ids)
        r = self.strip_r.feed(r, final)
        self.reasoning_seen = self.reasoning_seen or bool(r)
        new = []
        if self.tools is not None:
            c, new = self.tools.feed(c, final)
        c = self.strip_c.feed(c, final)
        base = len(self.calls)
        self.calls += new
        return {"reasoning_content": r, "content": c,
                "tool_calls": [call.openai(base + i) for i, call in enumerate(new)]}
