"""Tool calls in DeepSeek's output text (special tokens kept) -> OpenAI tool_calls.

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v32  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke>...</｜DSML｜function_calls>

A parser returns the text before the calls and the calls; a block that does not parse (bad JSON, a
missing end marker) is returned as text, never raised.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .dsv32_encoding import CALLS_BEGIN as DSML_BEGIN, CALLS_END as DSML_END, DSML

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PARSERS = ("deepseek_v3", "deepseek_v31", "deepseek_v32")
EOS = "<｜end▁of▁sentence｜>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def openai(self, index: int | None = None) -> dict:
        d = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def start_marker(parser: str) -> str:
    return DSML_BEGIN if parser == "deepseek_v32" else CALLS_BEGIN


def _json_object(text: str) -> str | None:
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else None


_V3 = re.compile(re.escape(CALL_BEGIN) + r"(?P<type>[^\n]*?)" + re.escape(SEP) + r"(?P<name>[^\n]*?)\n```(?:json)?\n"
                 r"(?P<args>.*?)\n```" + re.escape(CALL_END), re.S)
_V31 = re.compile(re.escape(CALL_BEGIN) + r"(?P<name>.*?)" + re.escape(SEP) + r"(?P<args>.*?)" + re.escape(CALL_END),
                  re.S)
_INVOKE = re.compile(rf'<{DSML}invoke name="(?P<name>[^"]*)">\n?(?P<body>.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="(?P<key>[^"]*)" string="(?P<str>true|false)">(?P<value>.*?)'
                    rf'</{DSML}parameter>', re.S)


def _calls_v3(block: str, pattern) -> list[ToolCall] | None:
    calls, pos = [], 0
    for m in pattern.finditer(block):
        if block[pos:m.start()].strip():
            return None
        args = _json_object(m.group("args").strip())
        if args is None or not m.group("name").strip():
            return None
        calls.append(ToolCall(m.group("name").strip(), args))
        pos = m.end()
    return calls if calls and not block[pos:].strip() else None


def _calls_v32(block: str) -> list[ToolCall] | None:
    calls, pos = [], 0
    for m in _INVOKE.finditer(block):
        if block[pos:m.start()].strip():
            return None
        args, body_pos = {}, 0
        body = m.group("body")
        for p in _PARAM.finditer(body):
            if body[body_pos:p.start()].strip() or p.group("key") in args:
                return None
            value = p.group("value")
            if p.group("str") == "false":
                try:
                    value = json.loads(value)
                except ValueError:
                    return None
            args[p.group("key")] = value
            body_pos = p.end()
        if body[body_pos:].strip() or not m.group("name"):
            return None
        calls.append(ToolCall(m.group("name"), json.dumps(args, ensure_ascii=False)))
        pos = m.end()
    return calls if calls and not block[pos:].strip() else None


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """-> (content before the calls, calls); no calls, or calls that do not parse: (text, [])."""
    begin = start_marker(parser)
    end = DSML_END if parser == "deepseek_v32" else CALLS_END
    i = text.find(begin)
    if i < 0:
        return text, []
    j = text.find(end, i)
    if j < 0 or text[j + len(end):].replace(EOS, "").strip():
        return text, []
    block = text[i + len(begin):j]
    if parser == "deepseek_v32":
        calls = _calls_v32(block)
    else:
        calls = _calls_v3(block, _V3 if parser == "deepseek_v3" else _V31)
    if not calls:
        return text, []
    content = text[:i]
    return (content[:-2] if parser == "deepseek_v32" and content.endswith("\n\n") else content), calls
