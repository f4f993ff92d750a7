"""OpenAI /v1/chat/completions: request parsing and response shapes (no HTTP here: launch/server/chat_http.py).

The sampling fields are the completions endpoint's (launch/server/openai_api.parse_completion checks them, so
both endpoints accept and reject the same ones); chat adds messages, add_generation_prompt,
continue_final_message, chat_template_kwargs, max_completion_tokens (= max_tokens; unset: up to the
context), logprobs (bool) + top_logprobs, tools and tool_choice ("auto" | "none" | "required" | a named
function: the last two constrain the output to calls of the tools, launch/server/structured_api.py),
parallel_tool_calls (false: one call), reasoning_effort (passed to the template as chat_template_kwargs
reasoning_effort, as vLLM does; DeepSeek-V4's encoding reads it). response_format / structured_outputs are the
completions endpoint's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..chat.dsv4_text import EFFORTS
from .openai_api import BadRequest, _bool, _int, parse_completion
from .structured_api import forced_tool, tool_spec

ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_ONLY = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
             "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort")


@dataclass(frozen=True)
class ChatRequest:
    messages: list
    params: object                # SamplingParams
    stream: bool
    include_usage: bool
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list | None = None
    parse_tools: bool = False     # tool_choice "auto" with tools
    top_logprobs: int | None = None  # None: no logprobs
    forced_tool: str | None = None   # tool_choice "required" or a tool's name: the output is constrained to calls
    parallel_tool_calls: bool = True


def _content(i: int, m: dict):
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts, got {type(c).__name__}")
    texts = []
    for j, p in enumerate(c):
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            got = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise BadRequest(f"'messages[{i}].content[{j}]' must be {{\"type\": \"text\", \"text\": str}}; "
                             f"got {got!r} (only text parts are supported)")
        texts.append(p["text"])
    return "\n".join(texts)  # vLLM's "string" content format


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' is required: a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of {list(ROLES)}, got {role!r}")
        m = dict(m, content=_content(i, m))
        if m["content"] is None and not (role == "assistant" and m.get("tool_calls")):
            raise BadRequest(f"'messages[{i}].content' is required for role {role!r}")
        for key in ("reasoning_content", "reasoning", "task", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise BadRequest(f"'messages[{i}].{key}' must be a string, got {type(m[key]).__name__}")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"'messages[{i}].tool_calls' must be a list, on an assistant message")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments", ""), (str, dict)):
                    raise BadRequest(f"'messages[{i}].tool_calls[{j}]' must be "
                                     "{\"type\": \"function\", \"function\": {\"name\": str, \"arguments\": str}}")
        out.append(m)
    return out


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest(f"'tools' must be a list, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"'tools[{i}].function.name' must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadRequest(f"'tools[{i}].function.parameters' must be a JSON Schema object, "
                             f"got {type(fn['parameters']).__name__}")
    return tools or None


def parse_chat(body, served_model: str, aliases: tuple[str, ...] = (), *, auto_tools: bool = False,
               max_logprobs: int | None = None, defaults: dict | None = None, call_block: str | None = None
               ) -> ChatRequest:
    """body (decoded JSON) -> ChatRequest; BadRequest on bad input. auto_tools: the server runs with
    --enable-auto-tool-choice and a tool-call parser. defaults: the checkpoint's generation_config.json
    sampling values for the fields the body leaves out (engine.generation_defaults). call_block: the prompt
    encoding's DSML call block (a forced tool choice is constrained to it), None for a chat template."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    messages = _messages(body)
    tools = _tools(body)
    choice = body.get("tool_choice")
    forced = forced_tool(choice, tools)
    parse_tools = bool(tools) and choice in (None, "auto")
    if parse_tools and not auto_tools:
        raise BadRequest("'tool_choice' \"auto\" needs the server started with --enable-auto-tool-choice and "
                         "--tool-call-parser; send tool_choice \"none\" or no tools")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest(f"'chat_template_kwargs' must be an object, got {kwargs!r}")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {list(EFFORTS)}, got {effort!r}"[:300])
        kwargs = dict(kwargs, reasoning_effort=effort)
    parallel = _bool(body, "parallel_tool_calls", True)
    want_lp = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0)
    if top is not None and not want_lp:
        raise BadRequest("'top_logprobs' needs 'logprobs': true")
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    max_tokens = _int(body, "max_tokens", None, lo=1) if max_tokens is None else max_tokens
    # The shared sampling fields, checked by the completions parser (a placeholder prompt).
    if body.get("echo"):
        raise BadRequest("'echo' is not supported on chat")
    sampling = {k: v for k, v in body.items() if k not in CHAT_ONLY and k not in ("logprobs", "max_tokens")}
    parsed = parse_completion(dict(sampling, prompt=[0], logprobs=(top or 0) if want_lp else None), served_model,
                              aliases, defaults)
    params, stream, include_usage = parsed.params, parsed.stream, parsed.include_usage
    params.max_tokens = max_tokens
    if forced is not None:
        if params.structured_outputs is not None:
            raise BadRequest(f"'tool_choice' {choice!r} constrains the output itself: it cannot be combined "
                             f"with response_format / structured_outputs")
        try:
            params = dataclasses.replace(params, structured_outputs=tool_spec(tools, forced, call_block, parallel))
        except ValueError as e:   # SamplingParams' own checks (min_tokens with a constraint)
            raise BadRequest(str(e).replace("SamplingParams.", "")) from None
    cont = _bool(body, "continue_final_message", False)
    gen = _bool(body, "add_generation_prompt", not cont)
    if cont and (gen or messages[-1]["role"] != "assistant"):
        raise BadRequest("'continue_final_message' needs the last message from the assistant and "
                         "'add_generation_prompt': false")
    return ChatRequest(messages, params, stream, include_usage, gen, cont, kwargs, tools, parse_tools,
                       (top or 0) if want_lp else None, forced, parallel)
