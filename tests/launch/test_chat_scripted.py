"""The chat endpoint end to end (the official `openai` client over HTTP, the same Server class) on a
scripted engine whose "model" writes DeepSeek's markup, which random weights never would: reasoning
split, tool calls (non-stream and as stream deltas, finish_reason "tool_calls"), the tool result
rendered into the next prompt, and a malformed call returned as text — for the V3 / R1, V3.1 and
V3.2 (DSML, no template: the Python encoding) formats."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from wideep.engine.front.outputs import RequestState
from wideep.engine.sampling_params import RequestOutput
from wideep.engine.worker.messages import Delta
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.test_chat_parsers import V3, V31, V32

openai = pytest.importorskip("openai")
EOS = "<｜end▁of▁sentence｜>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "weather in Paris?"}]
CASES = {  # name: (arch, template style, chat options, template kwargs, scripted output)
    "r1": ("v3", "r1", dict(reasoning_parser="deepseek_r1", tool_call_parser="deepseek_v3"), {}, "Checking.</think>" + V3),
    "v31": ("v3", "v31", dict(reasoning_parser="deepseek_v3", tool_call_parser="deepseek_v31"), {"thinking": True},
            "Checking.</think>" + V31),
    "v32": ("v32", None, dict(reasoning_parser="deepseek_v3", tool_call_parser="deepseek_v32"), {"thinking": True},
            "Checking.</think>" + V32),
}


class ScriptedEngine:
    """AsyncEngine's surface for the server: generate() replays `script` (text; a list: one per
    sample) as tokens then EOS, one token per delta, through the front's own RequestState (its
    detokenizer, special-token rule and stop strings), and records the prompts it was given."""

    def __init__(self, model_dir: str):
        tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        self.engine = SimpleNamespace(core=SimpleNamespace(tokenizer=tok, model_dir=model_dir, max_model_len=4096))
        self.is_running, self.script, self.prompts = True, "", []

    async def generate(self, ids, params, request_id):
        tok = self.engine.core.tokenizer
        self.prompts.append(tok.decode(ids, skip_special_tokens=False))
        scripts = self.script if isinstance(self.script, list) else [self.script] * params.n
        outs = [tok.encode(s, add_special_tokens=False).ids + [tok.token_to_id(EOS)] for s in scripts]
        eos = (tok.token_to_id(EOS),)
        states = [RequestState(f"{request_id}#{i}", None, list(ids), params, 4096, 0, index=i, eos_token_ids=eos)
                  for i in range(params.n)]
        final_only = params.output_kind == "final_only"
        while not all(st.finished for st in states):
            done = []
            for st, out in zip(states, outs):
                if st.finished:
                    continue
                k = len(st.token_ids)
                step = out[k:] if final_only else out[k:k + 1]
                st.apply(Delta(st.request_id, step, None, 0.0, "stop" if k + len(step) == len(out) else None))
                st.detokenize(tok)   # the front's stop-string check
                done.append(st.output(tok, delta=params.output_kind == "delta"))
            if not final_only:
                for o in done:
                    yield RequestOutput(request_id, None, list(ids), None, o.outputs, finished=all(st.finished for st in states))
        if final_only:
            outputs = [st.output(tok).outputs[0] for st in states]
            yield RequestOutput(request_id, None, list(ids), None, outputs, finished=True)


def run(case: str, fn, auto_tools: bool = True):
    from aiohttp.test_utils import TestServer

    from wideep.launch.server.app import Server
    arch, style, opts, _, _ = CASES[case]

    async def go(tmp):
        d = make_tiny_checkpoint(tmp, arch=arch, chat_template_style=style)
        eng = ScriptedEngine(d)
        srv = TestServer(Server(eng, "tiny", chat=dict(opts, enable_auto_tool_choice=auto_tools)).app(), host="127.0.0.1")
        await srv.start_server()
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x",
                                          max_retries=0) as client:
                await fn(client, eng)
        finally:
            await srv.close()
    return go


@pytest.mark.parametrize("case", list(CASES))
def test_reasoning_and_tool_call_round_trip(case, tmp_path):
    kwargs, script = CASES[case][3], CASES[case][4]

    async def fn(client, eng):
        eng.script = script
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                 extra_body={"chat_template_kwargs": kwargs})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and not ch.message.content
        assert ch.message.model_extra["reasoning_content"] == "Checking."
        (call,) = ch.message.tool_calls
        assert call.id and call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert "get_weather" in eng.prompts[-1]  # the tools were in the prompt

        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, stream=True, stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": kwargs})]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
        deltas = [c.choices[0].delta for c in chunks[:-1]]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Checking."
        assert "".join(d.content or "" for d in deltas).strip() == ""  # V3.2 writes "\n\n" before its calls
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
        assert chunks[-2].choices[0].finish_reason == "tool_calls"

        eng.script = "It is sunny."
        follow = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
        r = await client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS,
                                                 extra_body={"chat_template_kwargs": kwargs})
        assert "sunny, 21C" in eng.prompts[-1]
        assert r.choices[0].finish_reason == "stop"
        assert not r.choices[0].message.tool_calls

        eng.script = "Checking.</think>" + script.split("</think>")[1].replace('"Paris"', '"Par').replace(">Paris<", ">Par")
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                 extra_body={"chat_template_kwargs": kwargs})
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        if case != "v32":  # DSML's string parameters take any text: "Par" is still a valid call
            assert "get_weather" in r.choices[0].message.content  # the malformed call, as text

        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                                 extra_body={"chat_template_kwargs": kwargs})
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    asyncio.run(run(case, fn)(str(tmp_path)))


def test_thinking_off_is_all_content(tmp_path):
    async def fn(client, eng):
        eng.script = "Hello </think> there"
        r = await client.chat.completions.create(model="tiny", messages=MSGS)
        assert eng.prompts[-1].endswith("<｜Assistant｜></think>")  # V3.1 chat mode
        assert r.choices[0].message.content == "Hello  there"  # no parser at work: special tokens dropped
        assert r.choices[0].message.model_extra.get("reasoning_content") is None
    asyncio.run(run("v31", fn)(str(tmp_path)))


def test_a_template_that_raises_is_a_400(tmp_path):
    async def fn(client, eng):
        with pytest.raises(openai.BadRequestError, match="unknown role developer"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "developer", "content": "x"}])
        import aiohttp  # the openai client cannot even send an unpaired surrogate; JSON can
        async with aiohttp.ClientSession() as h:
            async with h.post(f"{client.base_url}chat/completions", data=b'{"messages": [{"role": "user", '
                              b'"content": "a\\udcffb"}]}', headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and "surrogate" in (await r.json())["error"]["message"]
        eng.script = "ok"
        r = await client.chat.completions.create(model="tiny", messages=MSGS)
        assert r.choices[0].message.content == "ok"
        assert eng.prompts[-1].count("<｜begin▁of▁sentence｜>") == 1  # the template's BOS, not doubled
    asyncio.run(run("v31", fn)(str(tmp_path)))


def test_tools_without_auto_tool_choice(tmp_path):
    async def fn(client, eng):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS)
        eng.script = "Checking.</think>" + V3
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none")
        assert "get_weather" in eng.prompts[-1] and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop" and "get_weather" in r.choices[0].message.content
    asyncio.run(run("r1", fn, auto_tools=False)(str(tmp_path)))


def test_chat_n_and_stop_strings(tmp_path):
    """n=2: one choice per sample, each with its own reasoning split and tool calls, streamed under
    its index; stop strings cut the answer (the front matches them on the text it keeps the special
    tokens in) and the stream never shows a stop string's start."""
    async def fn(client, eng):
        eng.script = ["Thinking.</think>Hello there. Bye.", "Hmm.</think>" + V3]
        r = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, n=2)
        a, b = sorted(r.choices, key=lambda c: c.index)
        assert a.message.content == "Hello there. Bye." and a.message.model_extra["reasoning_content"] == "Thinking."
        assert a.finish_reason == "stop" and not a.message.tool_calls
        assert b.finish_reason == "tool_calls" and b.message.tool_calls[0].function.name == "get_weather"
        assert b.message.model_extra["reasoning_content"] == "Hmm."

        chunks = [c async for c in await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                                        n=2, stream=True)]
        by = {0: [], 1: []}
        for c in chunks:
            by[c.choices[0].index].append(c.choices[0])
        assert all(by[i][0].delta.role == "assistant" for i in by)
        assert "".join(c.delta.content or "" for c in by[0]) == "Hello there. Bye."
        assert [tc.function.name for c in by[1] for tc in c.delta.tool_calls or []] == ["get_weather"]
        assert by[0][-1].finish_reason == "stop" and by[1][-1].finish_reason == "tool_calls"

        eng.script = "Thinking.</think>Hello there. Bye."
        r = await client.chat.completions.create(model="tiny", messages=MSGS, stop=["zz", "there"])
        c = r.choices[0]
        assert c.message.content == "Hello " and c.finish_reason == "stop" and c.model_extra["stop_reason"] == "there"
        r = await client.chat.completions.create(model="tiny", messages=MSGS, stop="there",
                                                 extra_body={"include_stop_str_in_output": True})
        assert r.choices[0].message.content == "Hello there"
        shown = ""
        async for ch in await client.chat.completions.create(model="tiny", messages=MSGS, stop=["therefore", "there"],
                                                             stream=True):
            shown += ch.choices[0].delta.content or ""
            assert "Hello ".startswith(shown) or shown == "Hello "
        assert shown == "Hello " and ch.choices[0].finish_reason == "stop"
    asyncio.run(run("r1", fn)(str(tmp_path)))
