"""Tool calls in DeepSeek's output text (special tokens kept) -> OpenAI tool_calls.

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v32  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke>...</｜DSML｜function_calls>

A parser returns the text before the calls and the calls. Calls are read one at a time, so a stream
sends each as soon as it is complete; a call that does not parse (bad JSON, no name, cut off) and
everything after it is returned as text, never raised (no call parsed: the whole block is text).
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


def _call(parser: str, m) -> ToolCall | None:
    """One call's regex match -> the call, or None when it is malformed (bad JSON, no name)."""
    if parser != "deepseek_v32":
        args = _json_object(m.group("args").strip())
        name = m.group("name").strip()
        return ToolCall(name, args) if args is not None and name else None
    args, pos = {}, 0
    body = m.group("body")
    for p in _PARAM.finditer(body):
        if body[pos:p.start()].strip() or p.group("key") in args:
            return None
        value = p.group("value")
        if p.group("str") == "false":
            try:
                value = json.loads(value)
            except ValueError:
                return None
        args[p.group("key")] = value
        pos = p.end()
    if body[pos:].strip() or not m.group("name"):
        return None
    return ToolCall(m.group("name"), json.dumps(args, ensure_ascii=False))


_PATTERNS = {"deepseek_v3": _V3, "deepseek_v31": _V31, "deepseek_v32": _INVOKE}


def _leading_calls(parser: str, block: str) -> tuple[list[ToolCall], int]:
    """The complete, well-formed calls at the start of block (the text after the begin marker), and
    where the text after them starts. A call that is cut off or malformed ends the run."""
    pattern, calls, pos = _PATTERNS[parser], [], 0
    while (m := pattern.search(block, pos)) is not None and not block[pos:m.start()].strip():
        call = _call(parser, m)
        if call is None:
            break
        calls.append(call)
        pos = m.end()
    return calls, pos


def parse_partial(parser: str, block: str, final: bool) -> tuple[str, list[ToolCall]]:
    """block: the output from the begin marker on, as far as it has come. -> (text, calls): the calls
    complete so far (streaming sends each once it is whole and parses) and, when final, the text
    that is no call — "" when the block ends with its end marker, the block from the first call
    that is cut off or malformed otherwise (all of it when no call parsed: returned as text)."""
    begin = start_marker(parser)
    end = DSML_END if parser == "deepseek_v32" else CALLS_END
    calls, pos = _leading_calls(parser, block[len(begin):])
    if not final:
        return "", calls
    rest = block[len(begin) + pos:]
    tail = rest.lstrip()
    if calls and tail.startswith(end) and not tail[len(end):].replace(EOS, "").strip():
        return "", calls
    if calls and end.startswith(tail.replace(EOS, "").strip()):   # cut off after a whole call (max_tokens)
        return "", calls
    return (rest if calls else block), calls


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The whole output -> (content, calls); no calls, or none that parse: (text, [])."""
    i = text.find(start_marker(parser))
    if i < 0:
        return text, []
    rest, calls = parse_partial(parser, text[i:], final=True)
    if not calls:
        return text, []
    content = text[:i]
    if parser == "deepseek_v32" and content.endswith("\n\n"):   # DSML's separator before the block
        content = content[:-2]
    return content + rest, calls
