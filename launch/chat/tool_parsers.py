"""Tool calls in DeepSeek's output text -> OpenAI tool_calls, streaming or not.

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v32  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke>...</｜DSML｜function_calls>
    deepseek_v4   the same DSML in a <｜DSML｜tool_calls> ... </｜DSML｜tool_calls> block

ToolCallStream reads the answer text as it comes and never lets markup out as content: text that could still
become a block's begin marker (and the whitespace before it, DSML's "\\n\\n") is held back until it cannot;
inside a block, calls are read one at a time, each sent once it is whole and parses. When the output ends, a
block that is cut off or malformed comes back as text from the first call that does not parse (all of the
block when no call parsed); a block cut off after a whole call keeps its calls. Text after a block's end
marker is content again.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .dsv32_encoding import DSML
from .reasoning import held_back

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = {"deepseek_v3": (CALLS_BEGIN, CALLS_END), "deepseek_v31": (CALLS_BEGIN, CALLS_END),
           "deepseek_v32": (f"<{DSML}function_calls>", f"</{DSML}function_calls>"),
           "deepseek_v4": (f"<{DSML}tool_calls>", f"</{DSML}tool_calls>")}
PARSERS = tuple(MARKERS)
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
    return MARKERS[parser][0]


def markup_tokens(parser: str) -> list[str]:
    """The strings of the parser's markup that a tokenizer may hold as (special) tokens."""
    if parser in ("deepseek_v32", "deepseek_v4"):
        return [DSML]
    return [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]


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
_PATTERNS = {"deepseek_v3": _V3, "deepseek_v31": _V31, "deepseek_v32": _INVOKE, "deepseek_v4": _INVOKE}


def _call(parser: str, m) -> ToolCall | None:
    """One call's regex match -> the call, or None when it is malformed (bad JSON, no name)."""
    if parser in ("deepseek_v3", "deepseek_v31"):
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


class ToolCallStream:
    """feed(answer text, final) -> (content text, the calls completed by it). max_calls: the calls kept (1 for
    parallel_tool_calls false, as vLLM keeps the first); later ones are dropped."""

    def __init__(self, parser: str, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.begin, self.end = MARKERS[parser]
        self.buf = ""            # held answer text, or the open block after its begin marker
        self.in_block = False
        self.block_calls = 0     # calls sent from the open block
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buf += text
        out, new = [], []
        while True:
            if not self.in_block:
                i = self.buf.find(self.begin)
                if i >= 0:       # the whitespace before a block is its separator, no answer
                    out.append(self.buf[:i].rstrip())
                    self.buf, self.in_block, self.block_calls = self.buf[i + len(self.begin):], True, 0
                    continue
                if final:
                    out.append(self.buf)
                    self.buf = ""
                    break
                keep = held_back(self.buf, self.begin)
                head = self.buf[:len(self.buf) - keep]
                body = head.rstrip()
                out.append(body)
                self.buf = self.buf[len(body):]
                break
            calls, pos = _leading_calls(self.parser, self.buf)
            new += self._keep(calls[self.block_calls:])
            self.block_calls = len(calls)
            tail = self.buf[pos:].lstrip()
            if tail.startswith(self.end):
                self.buf, self.in_block = tail[len(self.end):].replace(EOS, "", 1), False
                continue
            if final:
                rest = tail.replace(EOS, "").strip()
                if not calls:
                    out.append(self.begin + self.buf)
                elif not self.end.startswith(rest):   # not just cut off after a whole call: the rest is text
                    out.append(self.buf[pos:])
                self.buf = ""
            break
        return "".join(out), new

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        room = len(calls) if self.max_calls is None else max(0, self.max_calls - len(self.calls))
        kept = calls[:room]
        self.calls += kept
        return kept


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The whole output -> (content, calls); no calls, or none that parse: (text, [])."""
    stream = ToolCallStream(parser)
    content, calls = stream.feed(text, final=True)
    return (content, calls) if calls else (text, [])
