"""Tool calls written as JSON under tool_choice "required" / a named tool, for chat templates whose own call
format is not constrained (launch/server/structured_api.py: the output is a JSON array of {"name",
"parameters"}, or a named tool's parameters object). The DeepSeek encodings' DSML calls are constrained in the
model's own format instead and read by launch/chat/tool_parsers.py.

JsonToolCalls has ToolCallStream's interface: the answer is held until the output ends, then returned as
calls; text that is not a complete call (the output was cut by max_tokens) comes back as content.
"""
from __future__ import annotations

import json

from .tool_parsers import ToolCall


def parse_calls(text: str, forced: str) -> list[ToolCall]:
    """The constrained output -> its calls; [] when it is not complete."""
    try:
        v = json.loads(text)
    except ValueError:
        return []
    if forced != "required":
        return [ToolCall(forced, json.dumps(v, ensure_ascii=False))] if isinstance(v, dict) else []
    if not isinstance(v, list):
        return []
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in v
            if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c]


class JsonToolCalls:
    def __init__(self, forced: str):
        self.forced, self.parts = forced, []
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.parts.append(text)
        if not final:
            return "", []
        whole = "".join(self.parts)
        self.calls = parse_calls(whole, self.forced)
        return ("", self.calls) if self.calls else (whole, [])
