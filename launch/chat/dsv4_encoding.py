"""DeepSeek-V4's prompt encoding (V4 ships no Jinja template; DeepSeek's `encoding/encoding_dsv4.py` and its
published test prompts define the format), written here from that format:

    BOS [effort paragraph] system [+ "\\n\\n" + tools section]  <｜User｜>u<｜Assistant｜>(<think> | </think>)
    [reasoning</think>] answer ["\\n\\n" + DSML tool_calls block] <｜end▁of▁sentence｜>  <｜User｜><tool_result>r</tool_result>...

- No separators between turns. A user (or developer) turn is followed by `<｜Assistant｜>` and the opener: `<think>`
  in thinking mode, `</think>` in chat mode — only where an assistant turn (or a `latest_reminder`) follows, or
  at the end (the generation prompt).
- There is no tool turn: consecutive `tool` messages become one user turn of `<tool_result>` blocks in the order
  of the assistant's calls (by tool_call_id), joined by "\\n\\n"; a user message right after joins that turn.
- Thinking mode drops earlier turns' reasoning: assistant turns before the last user turn lose it (their user
  turns end with `</think>`) and earlier developer turns are left out. When any tools are present nothing is
  dropped: every user turn opens `<think>` and every assistant turn keeps its reasoning, so an agent must send
  `reasoning_content` back on tool turns.
- `reasoning_effort` (thinking mode only) puts the checkpoint profile's paragraph right after BOS
  (launch/chat/dsv4_text.py); "none" is chat mode.
- A user or developer message may carry `task` (a quick-instruction task): its turn ends in the task's token
  ("action": `<｜Assistant｜>` + opener + `<｜action｜>`) and the assistant turn after it has no reasoning part.
"""
from __future__ import annotations

import json

from . import dsv4_text as T
from .dsv32_encoding import EncodingError

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


def _json(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def _arguments(i: int, j: int, call: dict) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments")
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise EncodingError(f"'messages[{i}].tool_calls[{j}].function.arguments' is not JSON: {args!r}"[:300]) \
                from None
    if not isinstance(args, dict):
        raise EncodingError(f"'messages[{i}].tool_calls[{j}].function.arguments' must be a JSON object, "
                            f"got {type(args).__name__}")
    return args


def dsml_calls(i: int, calls: list[dict], block: str = "tool_calls") -> str:
    """An assistant's calls -> its DSML block (without the "\\n\\n" before it): one invoke per call, one
    parameter line per argument (strings raw with string="true", anything else JSON with string="false")."""
    invokes = []
    for j, call in enumerate(calls):
        lines = [f'<{T.DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                 f'{v if isinstance(v, str) else _json(v)}{T.PARAM_END}' for k, v in _arguments(i, j, call).items()]
        name = call.get("function", call).get("name")
        invokes.append(f'<{T.DSML}invoke name="{name}">\n' + "\n".join(lines) + f"\n{T.INVOKE_END}")
    return f"<{T.DSML}{block}>\n" + "\n".join(invokes) + f"\n</{T.DSML}{block}>"


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> V4's turns: tool results (and a user message right after them) folded into one user
    turn of blocks, results in the order of the last assistant's calls. Each turn keeps its index in
    `messages` as "at" (errors name the client's field)."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            order = {c.get("id"): k for k, c in enumerate(m["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        joins = bool(out) and out[-1]["role"] == "user" and "blocks" in out[-1] and out[-1].get("task") is None
        if role == "tool":
            block = ("result", order.get(m.get("tool_call_id"), 0), m.get("content") or "")
            if joins:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block], "at": i})
        elif role == "user":
            block = ("text", 0, m.get("content") or "")
            if joins:
                out[-1]["blocks"].append(block)
                if m.get("task") is not None:
                    out[-1]["task"] = m["task"]
            else:
                out.append(dict(m, blocks=[block], at=i))
        else:
            out.append(dict(m, at=i))
    for m in out:   # the results of one turn, in call order (stable: unknown ids keep theirs)
        blocks = m.get("blocks")
        if blocks and sum(b[0] == "result" for b in blocks) > 1:
            results = iter(sorted((b for b in blocks if b[0] == "result"), key=lambda b: b[1]))
            m["blocks"] = [next(results) if b[0] == "result" else b for b in blocks]
    return out


def _user_text(m: dict) -> str:
    if "blocks" not in m:
        return m.get("content") or ""
    return "\n\n".join(f"{T.RESULT_BEGIN}{text}{T.RESULT_END}" if kind == "result" else text
                       for kind, _, text in m["blocks"])


def _drop_earlier(turns: list[dict], last_user: int) -> list[dict]:
    """Thinking mode without tools: before the last user turn, assistant turns lose their reasoning and
    developer turns are left out."""
    out = []
    for i, m in enumerate(turns):
        if i >= last_user or m["role"] in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")})
    return out


def _last_user(turns: list[dict]) -> int:
    return max((i for i, m in enumerate(turns) if m["role"] in ("user", "developer")), default=-1)


def _turn(i: int, turns: list[dict], thinking: bool, keep: bool, last_user: int, open_end: bool) -> str:
    m = turns[i]
    role = m["role"]
    tools = "\n\n" + T.tools_section([_json(t.get("function", t)) for t in m["tools"]]) if m.get("tools") else ""
    if role == "system":
        text = (m.get("content") or "") + tools
    elif role == "developer":
        text = T.USER + (m.get("content") or "") + tools
    elif role == "user":
        text = T.USER + _user_text(m)
    elif role == "latest_reminder":
        text = T.REMINDER + (m.get("content") or "")
    elif role == "assistant":
        after_task = i > 0 and turns[i - 1].get("task") is not None
        reasoning = ""
        if thinking and not after_task and (keep or i > last_user):
            reasoning = (m.get("reasoning_content") or m.get("reasoning") or "") + T.END_THINK
        calls = "\n\n" + dsml_calls(m["at"], m["tool_calls"]) if m.get("tool_calls") else ""
        text = reasoning + (m.get("content") or "") + calls + ("" if open_end and i == len(turns) - 1 else T.EOS)
    else:
        raise EncodingError(f"'messages[{m['at']}].role' {role!r} is not one of {list(ROLES)}")
    if i + 1 < len(turns) and turns[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return text
    opener = T.THINK if thinking and (keep or i >= last_user) else T.END_THINK
    task = m.get("task")
    if task is not None:
        if task not in T.TASKS:
            raise EncodingError(f"'messages[{m['at']}].task' must be one of {sorted(T.TASKS)}, got {task!r}")
        return text + (T.ASSISTANT + (T.THINK if thinking else T.END_THINK) if task == "action" else "") \
            + T.TASKS[task]
    if role in ("user", "developer"):
        text += T.ASSISTANT + opener
    return text


def encode_messages(messages: list[dict], *, tools: list | None = None, thinking: bool = False,
                    reasoning_effort: str | None = None, effort_profile: str = "preview",
                    continue_final_message: bool = False, bos: str = T.BOS, **_ignored) -> str:
    """messages (OpenAI shape; assistant reasoning as `reasoning_content` or `reasoning`) -> the prompt text.
    tools (the request's) go to a leading system or developer message, or a system message of their own, as
    vLLM does. The prompt always ends with the generation prompt after a user turn (add_generation_prompt
    changes nothing); continue_final_message leaves a final assistant turn open (no end-of-sentence)."""
    if reasoning_effort == "none":
        thinking, reasoning_effort = False, None
    if reasoning_effort not in (None, *T.EFFORTS):
        raise EncodingError(f"'reasoning_effort' must be one of {list(T.EFFORTS)}, got {reasoning_effort!r}")
    if effort_profile not in T.PROFILES:
        raise EncodingError(f"reasoning-effort profile must be one of {list(T.PROFILES)}, got {effort_profile!r}")
    messages = [dict(m) for m in messages]
    if tools:
        if messages and messages[0].get("role") in ("system", "developer"):
            messages[0]["tools"] = tools
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
    for i, m in enumerate(messages):
        if m.get("task") is not None and m.get("role") not in ("user", "developer"):
            raise EncodingError(f"'messages[{i}].task' is only allowed on a user or developer message")
    turns = _merge_tool_results(messages)
    keep = any(m.get("tools") for m in turns)   # with tools, every turn keeps its reasoning
    if thinking and not keep:
        turns = _drop_earlier(turns, _last_user(turns))
    last_user = _last_user(turns)
    open_end = continue_final_message and bool(turns) and turns[-1]["role"] == "assistant"
    text = bos + (T.effort_paragraph(effort_profile, reasoning_effort) if thinking else "")
    return text + "".join(_turn(i, turns, thinking, keep, last_user, open_end) for i in range(len(turns)))
