"""/v1/chat/completions over real HTTP with the official `openai` client: non-stream and stream agree,
the stream's chunk shapes are OpenAI's, R1-style reasoning goes to reasoning_content, and bad chat
input is a 400 naming the problem while the server keeps serving."""
from __future__ import annotations

import json

import pytest

from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.test_server import ServerProc, request

openai = pytest.importorskip("openai")
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=4, chat_template_style="r1")
    s = ServerProc([d, "--port", "0", "--model-name", "tiny", "--max-model-len", "256", "--kv-cache-blocks", "64",
                    "--dispatch-backend", "torch", "--reasoning-parser", "deepseek_r1",
                    "--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice"])
    yield s
    assert s.stop() == [0], s.output


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.base}/v1", api_key="none", max_retries=0)


def test_chat_stream_equals_non_stream(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0.0, logprobs=True,
                                       top_logprobs=2)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant" and r.usage.completion_tokens == 8
    assert len(r.choices[0].logprobs.content) == 8
    extra = m.model_extra or {}
    assert "reasoning_content" in extra  # the R1 prompt opened <think>: no </think> yet, all reasoning
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks[:-1])
    assert streamed == extra["reasoning_content"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == (m.content or "")
    lp = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0.0, stream=True,
                                             logprobs=True, top_logprobs=2))
    entries = [e for c in lp if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert [e.token for e in entries] == [e.token for e in r.choices[0].logprobs.content[:4]]


def test_chat_n_and_stop_strings(client):
    """n=2: two choices, indexed, streamed under their index; a stop string taken from the greedy
    output cuts it there (finish "stop", stop_reason the string), streamed or not."""
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, n=2, temperature=1.0,
                                                 seed=5, stream=True))
    for i, c in enumerate(sorted(r.choices, key=lambda c: c.index)):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        text = "".join((m.delta.model_extra or {}).get("reasoning_content") or "" for m in mine)
        assert text == c.message.model_extra["reasoning_content"]
    greedy = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0.0)
    text = greedy.choices[0].message.model_extra["reasoning_content"]
    stop = text[4:6]
    if len(text) < 8 or not stop.strip():
        pytest.skip("the greedy output is too short for a stop string")
    pos = text.find(stop)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0.0, stop=["\x00", stop])
    c = r.choices[0]
    assert c.message.model_extra["reasoning_content"] == text[:pos]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    shown = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                    for ch in client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12,
                                                             temperature=0.0, stop=stop, stream=True) if ch.choices)
    assert shown == text[:pos]


def test_tools_render_and_round_trip(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=4, temperature=0.0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "'messages'"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "'messages[0].role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "'messages[0].content[0]'"),
    ({"messages": [{"role": "user"}]}, "'messages[0].content'"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "parameters"),
    ({"messages": MSGS, "tools": "x"}, "'tools'"),
    ({"messages": MSGS, "tool_choice": "required"}, "'tool_choice' \"required\" needs 'tools'"),
    ({"messages": MSGS, "n": 0}, "'n'"),
    ({"messages": MSGS, "n": 10 ** 6}, "n must be in [1, 128]"),
    ({"messages": MSGS, "stop": [5]}, "'stop' must be a string or a list of strings"),
    ({"messages": MSGS, "stop": ["x"] * 1000}, "at most 128"),
    ({"messages": MSGS, "echo": True}, "'echo' is not supported on chat"),
    ({"messages": MSGS, "chat_template_kwargs": 5}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "developer", "content": "y"}]}, "unknown role"),
    ({"messages": {"role": "user", "content": "x"}}, "'messages'"),
    ({"messages": ["hi"]}, "'messages[0]'"),
    ({"messages": [{"role": "user", "content": 5}]}, "'messages[0].content'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"x": 1}]}]},
     "'messages[1].tool_calls[0]'"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "'messages[0].tool_calls'"),
    ({"messages": MSGS, "tools": [{"type": "retrieval"}]}, "'tools[0]'"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": ""}}]}, "'tools[0].function.name'"),
    ({"messages": MSGS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "which is not in 'tools'"),
    ({"messages": MSGS, "tool_choice": {"type": "function"}}, "'tool_choice' must be"),
    ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "'response_format.json_schema.schema' is required"),
    ({"messages": MSGS, "tool_choice": "sometimes"}, "'tool_choice'"),
    ({"messages": MSGS, "top_logprobs": 2}, "'top_logprobs'"),
    ({"messages": MSGS, "logprobs": 3}, "'logprobs'"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "'max_completion_tokens'"),
    ({"messages": MSGS, "continue_final_message": True}, "'continue_final_message'"),
    ({"messages": MSGS, "temperature": -1}, "temperature"),
    ({"messages": MSGS, "model": "other"}, "does not exist"),
    ({"messages": MSGS, "reasoning_effort": "extreme"}, "'reasoning_effort' must be one of"),
    ({"messages": MSGS, "parallel_tool_calls": "no"}, "'parallel_tool_calls'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 5}]},
     "'messages[1].reasoning_content' must be a string"),
    ({"messages": [{"role": "user", "content": "x", "task": ["title"]}]}, "'messages[0].task' must be a string"),
])
def test_bad_chat_is_400_and_server_serves(server, body, needle):
    status, raw = request(server.base, "POST", "/v1/chat/completions", dict({"model": "tiny", "max_tokens": 2}, **body))
    assert status in (400, 404), raw
    assert needle in json.loads(raw)["error"]["message"]
    status, raw = request(server.base, "POST", "/v1/chat/completions",
                          {"model": "tiny", "messages": MSGS, "max_tokens": 2})
    assert status == 200, raw


def test_random_messages_never_500(server):
    """Shapes a client might send by mistake: every answer is 200 or a 400 with a message."""
    import random
    rng = random.Random(0)
    values = [None, 0, 1.5, True, "", "x", [], {}, [{"type": "text", "text": "a"}], [{"type": "text"}], {"a": 1},
              [1, 2], "\u0000", "<｜User｜>", "{{ 7 * 7 }}"]
    keys = ["role", "content", "tool_calls", "name", "tool_call_id", "reasoning_content"]
    for _ in range(40):
        msgs = [{k: rng.choice(values + ["user", "assistant", "tool", "system"]) for k in rng.sample(keys, 3)}
                for _ in range(rng.randrange(1, 4))]
        body = {"model": "tiny", "messages": msgs, "max_tokens": 2}
        if rng.random() < 0.3:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": rng.choice(values)}}]
        status, raw = request(server.base, "POST", "/v1/chat/completions", body)
        assert status in (200, 400), (status, raw, body)
        if status == 400:
            assert json.loads(raw)["error"]["message"]
    status, raw = request(server.base, "POST", "/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 2})
    assert status == 200, raw
