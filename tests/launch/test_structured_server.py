"""Structured outputs over HTTP with the official `openai` client (the same Server class, a real
engine on random weights): response_format json_schema / json_object on chat and completions,
vLLM's structured_outputs field, tool_choice "required" and a named tool returned as tool_calls whose
arguments validate against the tools' schemas, streaming, and a bad schema as a 400 naming it."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
MSGS = [{"role": "user", "content": "weather in Paris?"}]
COMPACT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("sos")), arch="v3", seed=3, initializer_range=0.3,
                                max_position_embeddings=2048)


def serve(model_dir, fn):
    from aiohttp.test_utils import TestServer

    from wideep.engine.front.async_engine import AsyncEngine
    from wideep.engine.front.engine import Engine
    from wideep.launch.server.app import Server

    async def go():
        aengine = AsyncEngine(Engine(model_dir, progress=False, max_model_len=2048, kv_cache_blocks=256, block_size=16))
        srv = TestServer(Server(aengine, "tiny").app(), host="127.0.0.1")
        await srv.start_server()
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x",
                                          max_retries=0) as client:
                await fn(client)
        finally:
            await srv.close()
            await aengine.shutdown()
    asyncio.run(go())


def test_response_format_json_schema_chat_and_completions(model_dir):
    async def fn(client):
        rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
        for seed in range(6):
            r = await client.chat.completions.create(model="tiny", messages=MSGS, response_format=rf, seed=seed,
                                                     max_tokens=200)
            c = r.choices[0]
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
        r = await client.completions.create(model="tiny", prompt="weather:", max_tokens=200, seed=1,
                                            extra_body={"response_format": rf})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
        r = await client.completions.create(model="tiny", prompt="colour:", max_tokens=20, seed=2,
                                            extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
        assert r.choices[0].text in ("red", "blue") and r.choices[0].finish_reason == "stop"
        r = await client.completions.create(model="tiny", prompt="code:", max_tokens=20, temperature=0,
                                            extra_body={"guided_regex": "[0-9]{4}"})
        assert re.fullmatch("[0-9]{4}", r.choices[0].text)
        # logprobs of the constrained distribution: refused tokens among the top-N come back as -9999.0
        r = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, logprobs=True,
                                                 top_logprobs=4, extra_body={"structured_outputs": {"choice": ["ab", "cd"]}})
        first = r.choices[0].logprobs.content[0]
        assert sorted(e.logprob == -9999.0 for e in first.top_logprobs) == [False, False, True, True]
        r = await client.completions.create(model="tiny", prompt="x", max_tokens=4, logprobs=3,
                                            extra_body={"structured_outputs": {"choice": ["ab", "cd"]}})
        assert -9999.0 in r.choices[0].logprobs.top_logprobs[0].values()
        # streaming: the deltas add up to a valid document
        chunks = await client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=200,
                                                      stream=True, extra_body=COMPACT)
        text, finish = "", None
        async for ch in chunks:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        r = await client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=200,
                                                 extra_body=COMPACT)
        assert r.choices[0].message.content == text
    serve(model_dir, fn)


def test_tool_choice_required_and_named(model_dir):
    async def fn(client):
        seen = set()
        for seed in range(6):
            r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                                     seed=seed, max_tokens=300)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c.message
            assert c.message.tool_calls and not c.message.content
            for call in c.message.tool_calls:
                tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
                seen.add(call.function.name)
        assert seen   # at least one call parsed every time; which tools is the random model's choice
        named = {"type": "function", "function": {"name": "get_time"}}
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named,
                                                 seed=0, max_tokens=100)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        chunks = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named,
                                                      seed=0, max_tokens=100, stream=True)
        calls = [tc async for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls
                 for tc in ch.choices[0].delta.tool_calls]
        assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_time", call.function.arguments)]
    serve(model_dir, fn)


def test_tool_choice_in_v32s_own_call_block(tmp_path):
    """DeepSeek-V3.2's encoding (no template): a forced tool choice is its DSML function_calls block, arguments
    valid for the schema, read by the DSML parser (no --tool-call-parser); parallel_tool_calls false: one call."""
    d = make_tiny_checkpoint(str(tmp_path), arch="v32", seed=3, initializer_range=0.3, max_position_embeddings=2048)

    async def fn(client):
        named = {"type": "function", "function": {"name": "get_weather"}}
        for seed in range(3):
            r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named,
                                                     seed=seed, max_tokens=300)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
            (call,) = c.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, seed=7, max_tokens=300)
        assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    serve(d, fn)


@pytest.mark.parametrize("extra,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "structured_outputs.json does not compile: Unsupported type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": "json"}, "'structured_outputs' must be an object"),
    ({"response_format": {"type": "yaml"}}, "'response_format.type' must be"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "only one of"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens cannot be combined"),
])
def test_bad_structured_requests_are_400(model_dir, extra, needle):
    async def fn(client):
        with pytest.raises(openai.BadRequestError, match=re.escape(needle) if "(" in needle else needle):
            await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, extra_body=extra)
        if "tools" not in extra:
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
        r = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
        assert r.choices[0].finish_reason == "length"
    serve(model_dir, fn)


def test_backend_flag():
    import argparse

    from wideep.launch.cli.options import add_options
    p = argparse.ArgumentParser()
    add_options(p, "serve")
    assert p.parse_args(["d", "--structured-outputs-backend", "guidance"]).engine__structured_outputs_backend == "guidance"
    with pytest.raises(SystemExit):
        p.parse_args(["d", "--structured-outputs-backend", "outlines"])
