"""DeepSeek-V3.2's prompt encoding (it ships no Jinja template; the format is the one its
encoding_dsv32.py documents), written here from that format:

    BOS  system [+ "\n\n" + tools block]  <｜User｜>u<｜Assistant｜>  (<think> | </think>)  answer<｜end▁of▁sentence｜> ...

Modes: "thinking" (the last user turn opens <think>; earlier assistant turns lose their reasoning) or
"chat" (every user turn is followed by </think>). Assistant tool calls are DSML markup; tool results
follow as <function_results><result>...</result></function_results>. tools given with the request go
into the system message (one is prepended when the conversation has none), as vLLM does.
"""
from __future__ import annotations

import json

DSML = "｜DSML｜"
EOS, USER, ASSISTANT, THINK, END_THINK = "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
CALLS_BEGIN, CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"

_TOOLS_PREAMBLE = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{CALLS_BEGIN}" block like the following as part of your reply to the user:
{CALLS_BEGIN}
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
{CALLS_END}
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
{CALLS_BEGIN}
...
{CALLS_END}
<function_results>
...
</function_results>
{THINK}...thinking about results{END_THINK}
Here are the functions available in JSONSchema format:
<functions>
"""


class EncodingError(ValueError):
    pass


def _json(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return content or ""


def render_tools(tools: list[dict]) -> str:
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return f"{_TOOLS_PREAMBLE}{schemas}\n</functions>\n"


def _dsml_call(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise EncodingError(f"tool call {fn.get('name')!r}: arguments are not JSON: {args!r}") from None
    if not isinstance(args, dict):
        raise EncodingError(f"tool call {fn.get('name')!r}: arguments must be a JSON object")
    params = "\n".join(f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                       f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items())
    return f'<{DSML}invoke name="{fn.get("name")}">\n{params}\n</{DSML}invoke>'


def _last_user(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _render(i: int, messages: list[dict], thinking: bool, last_user: int) -> str:
    m = messages[i]
    role, content = m.get("role"), _text(m.get("content"))
    tools_block = "\n\n" + render_tools(m["tools"]) if m.get("tools") else ""
    opener = THINK if thinking and i == last_user else END_THINK
    if role == "system":
        return content + tools_block
    if role == "developer":
        return f"{USER}{tools_block}\n\n# The user's message is: {content}{ASSISTANT}{opener}"
    if role == "user":
        return f"{USER}{content}{ASSISTANT}{opener}"
    if role == "tool":
        j = i - 1
        while j >= 0 and messages[j].get("role") == "tool":
            j -= 1
        calls = messages[j].get("tool_calls") if j >= 0 and messages[j].get("role") == "assistant" else None
        order = i - j
        if not calls or len(calls) < order:
            raise EncodingError(f"messages[{i}]: a tool result without a matching assistant tool call")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{content}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + (THINK if thinking and i >= last_user else END_THINK)
        return out
    if role == "assistant":
        calls = m.get("tool_calls") or []
        calls_text = ("\n\n" + CALLS_BEGIN + "\n" + "\n".join(_dsml_call(c) for c in calls) + "\n" + CALLS_END
                      if calls else "")
        reasoning = ""
        if thinking and i > last_user:
            reasoning = (m.get("reasoning") or m.get("reasoning_content") or "") + END_THINK
        return f"{reasoning}{content}{calls_text}{EOS}"
    raise EncodingError(f"messages[{i}]: unknown role {role!r}")


def encode_messages(messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, bos: str = "<｜begin▁of▁sentence｜>",
                    thinking: bool = False, **_ignored) -> str:
    """messages (OpenAI shape) -> the prompt text. The encoding always ends a user turn with the
    assistant's opener, so add_generation_prompt changes nothing; continue_final_message leaves the
    final assistant turn open (no end-of-sentence)."""
    messages = [dict(m) for m in messages]
    if tools:
        if messages and messages[0].get("role") == "system":
            messages[0]["tools"] = tools
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
    last_user = _last_user(messages)
    if thinking:  # earlier turns' reasoning is dropped, as the model was trained
        for i, m in enumerate(messages):
            if m.get("role") == "assistant" and i < last_user:
                m.pop("reasoning", None)
                m.pop("reasoning_content", None)
    text = bos + "".join(_render(i, messages, thinking, last_user) for i in range(len(messages)))
    if continue_final_message and messages and messages[-1].get("role") == "assistant":
        text = text[:-len(EOS)]
    return text
