"""Hostile and malformed HTTP requests against one `wideep serve` (a subprocess on 127.0.0.1): each is
answered 4xx with a JSON error naming the problem, and the next good request is still answered
correctly (equal to LLM.generate). The server is started from a config file with flags over it
(--max-logprobs, --model-name), which these tests also check."""
from __future__ import annotations

import http.client
import json

import pytest

from engine import LLM, SamplingParams
from launch.tiny import make_tiny_checkpoint
from tests.launch.test_server import ServerProc, metrics

CONFIG = """
[model]
path = "{path}"
max_model_len = 128
[parallel]
dispatch_backend = "torch"
[engine]
kv_cache_blocks = 64
max_logprobs = 20
[server]
port = 8000
model_name = "from-file"
"""
GOOD = {"model": "fuzz", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}
JSON = "application/json"


def send(base: str, body: bytes, content_type: str | None = JSON, method: str = "POST",
         path: str = "/v1/completions") -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(base, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": content_type} if content_type else {})
    r = conn.getresponse()
    out = (r.status, r.getheader("Content-Type", ""), r.read())
    conn.close()
    return out


def j(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=4)


@pytest.fixture(scope="module")
def want(tiny):
    llm = LLM(tiny, progress=False, max_model_len=128, kv_cache_blocks=64)
    return llm.generate([GOOD["prompt"]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "fuzz.toml"
    path.write_text(CONFIG.format(path=tiny))
    s = ServerProc(["--config", str(path), "--port", "0", "--max-logprobs", "5", "--model-name", "fuzz"])
    yield s
    assert s.stop() == [0], s.output
    assert "Traceback" not in "".join(s.output[0]), s.output  # no handler blew up on the way


def good_answer(base: str) -> list[int]:
    status, ctype, raw = send(base, j(GOOD))
    assert status == 200 and ctype.startswith(JSON), raw
    return json.loads(raw)["choices"][0]["token_ids"]


def P(**kw) -> bytes:
    return j({"prompt": [5, 6, 7], **kw})


DEEP = 100_000
# (name, body, content type, method, path, status, what the message must contain)
CASES = [
    ("empty body", b"", JSON, "POST", None, 400, "not valid JSON"),
    ("truncated", b'{"prompt": [1, 2', JSON, "POST", None, 400, "not valid JSON"),
    ("not utf-8", b"\xff\xfe\x00\x81", JSON, "POST", None, 400, "not valid JSON"),
    ("utf-8 inside a string broken", b'{"prompt": "\xc3\x28"}', JSON, "POST", None, 400, "not valid JSON"),
    ("utf-16 body", j(GOOD).decode().encode("utf-16"), JSON, "POST", None, 400, "not UTF-8"),
    ("json string", b'"hello"', JSON, "POST", None, 400, "must be a JSON object, got str"),
    ("json null", b"null", JSON, "POST", None, 400, "must be a JSON object, got NoneType"),
    ("json array", b"[1, 2]", JSON, "POST", None, 400, "must be a JSON object, got list"),
    ("nested arrays", b"[" * DEEP + b"]" * DEEP, JSON, "POST", None, 400, "nested too deeply"),
    ("nested objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP, JSON, "POST", None, 400, "nested too deeply"),
    ("nested prompt", j({"prompt": json.loads("[" * 500 + "1" + "]" * 500)}), JSON, "POST", None, 400,
     "'prompt[0]' must be a string or a list of integer token ids"),
    ("NaN literal", b'{"prompt": [1], "temperature": NaN}', JSON, "POST", None, 400, "NaN is not a JSON value"),
    ("Infinity literal", b'{"prompt": [1], "top_p": -Infinity}', JSON, "POST", None, 400,
     "-Infinity is not a JSON value"),
    ("float overflow to inf", b'{"prompt": [1], "temperature": 1e999}', JSON, "POST", None, 400,
     "temperature must be finite"),
    ("int of 5000 digits", b'{"prompt": [1], "max_tokens": 1' + b"0" * 5000 + b"}", JSON, "POST", None, 400,
     "not valid JSON"),
    ("huge logprobs", P(logprobs=1_000_000), JSON, "POST", None, 400, "logprobs=1000000 is more than max_logprobs=5"),
    ("logprobs over the flag's cap", P(logprobs=6), JSON, "POST", None, 400, "logprobs=6 is more than max_logprobs=5"),
    ("negative logprobs", P(logprobs=-1), JSON, "POST", None, 400, "'logprobs' must be >= 0, got -1"),
    ("logprobs true", P(logprobs=True), JSON, "POST", None, 400, "'logprobs' must be an integer, got True"),
    ("prompt_logprobs", P(prompt_logprobs=10 ** 6), JSON, "POST", None, 400, "'prompt_logprobs' is not supported"),
    ("top_k -5", P(top_k=-5), JSON, "POST", None, 400, "top_k must be -1 or 0 (disabled) or >= 1, got -5"),
    ("top_p above 1", P(top_p=1.5), JSON, "POST", None, 400, "top_p must be in (0, 1]"),
    ("negative temperature", P(temperature=-0.5), JSON, "POST", None, 400, "temperature must be >= 0"),
    ("temperature string", P(temperature="hot"), JSON, "POST", None, 400, "'temperature' must be a number"),
    ("huge max_tokens", P(max_tokens=10 ** 30), JSON, "POST", None, 400, "exceeds the context"),
    ("negative max_tokens", P(max_tokens=-1), JSON, "POST", None, 400, "'max_tokens' must be >= 1"),
    ("float max_tokens", P(max_tokens=4.0), JSON, "POST", None, 400, "'max_tokens' must be an integer"),
    ("huge seed", P(seed=10 ** 30), JSON, "POST", None, 400, "seed must be in [-2**63, 2**64)"),
    ("huge n", P(n=10 ** 30), JSON, "POST", None, 400, "n must be in [1, 128]"),
    ("float token ids", j({"prompt": [1.5, 2]}), JSON, "POST", None, 400, "list of integer token ids"),
    ("bool token ids", j({"prompt": [True, False]}), JSON, "POST", None, 400, "list of integer token ids"),
    ("negative token id", j({"prompt": [-1]}), JSON, "POST", None, 400, "token id -1 is out of range"),
    ("huge token id", j({"prompt": [10 ** 30]}), JSON, "POST", None, 400, "is out of range [0, vocab_size="),
    ("prompt object", j({"prompt": {"text": "hi"}}), JSON, "POST", None, 400, "'prompt' must be a string or a list"),
    ("prompt number", j({"prompt": 12345}), JSON, "POST", None, 400, "'prompt' must be a string or a list"),
    ("prompt missing", j({"max_tokens": 3}), JSON, "POST", None, 400, "'prompt' is required"),
    ("text too long for the context", j({"prompt": "a" * 200_000}), JSON, "POST", None, 400, "max_model_len=128"),
    ("stream string", P(stream="true"), JSON, "POST", None, 400, "'stream' must be true or false"),
    ("include_usage string", P(stream=True, stream_options={"include_usage": "yes"}), JSON, "POST", None, 400,
     "'stream_options.include_usage' must be true or false"),
    ("stream_options list", P(stream_options=[1]), JSON, "POST", None, 400, "'stream_options' must be an object"),
    ("stop ids mixed", P(stop_token_ids=[1, "2"]), JSON, "POST", None, 400, "'stop_token_ids' must be a list"),
    ("ignore_eos string", P(ignore_eos="yes"), JSON, "POST", None, 400, "'ignore_eos' must be true or false"),
    ("penalty", P(presence_penalty=1.0), JSON, "POST", None, 400, "'presence_penalty' is not supported"),
    ("logit_bias", P(logit_bias={"5": 100}), JSON, "POST", None, 400, "'logit_bias' is not supported"),
    ("1000 stop strings", P(stop=["\n"] * 1000), JSON, "POST", None, 400, "at most 128 are allowed"),
    ("long stop string", P(stop="x" * 10000), JSON, "POST", None, 400, "at most 512 are allowed"),
    ("model as a list", P(model=["fuzz"]), JSON, "POST", None, 404, "does not exist; this server serves 'fuzz'"),
    ("text/plain", j(GOOD), "text/plain", "POST", None, 415, "Content-Type 'text/plain' is not supported"),
    ("multipart", b"--x\r\n\r\n--x--", "multipart/form-data; boundary=x", "POST", None, 415,
     "Content-Type 'multipart/form-data' is not supported"),
    ("body over 1 MiB", j({"prompt": [1] * 400_000}), JSON, "POST", None, 413, "Maximum request body size"),
    ("GET on a POST route", b"", None, "GET", None, 405, "Method Not Allowed: GET /v1/completions"),
    ("unknown path", j(GOOD), JSON, "POST", "/v1/chat/nothing", 404, "Not Found: POST /v1/chat/nothing"),
]


@pytest.mark.parametrize("name,body,ctype,method,path,status,match", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_a_json_4xx_and_server_keeps_serving(server, want, name, body, ctype, method, path,
                                                                status, match):
    got, got_type, raw = send(server.base, body, ctype, method, path or "/v1/completions")
    assert got == status, (name, raw[:500])
    assert got_type.startswith(JSON), (name, got_type, raw[:200])
    err = json.loads(raw)["error"]
    assert match in err["message"], (name, err)
    assert err["code"] == status and err["type"] == "invalid_request_error"
    assert good_answer(server.base) == want


def test_fuzz_list_is_long():
    assert len(CASES) >= 30


def test_accepted_edges_and_unknown_fields(server, want):
    """Unknown fields are ignored (OpenAI clients send many); neutral values of unsupported fields
    pass; top_k 0 means off; no Content-Type and curl's default form type are read as JSON;
    logprobs up to the flag's cap (5, over the file's 20) are served."""
    for body, ctype in [(j(dict(GOOD, user="u", some_new_field={"x": [1]})), JSON),
                        (j(dict(GOOD, presence_penalty=0, logit_bias={}, suffix="", top_k=0)), JSON),
                        (j(dict(GOOD, top_k=-1, temperature=1e-300)), JSON),   # below 1e-5: greedy
                        (j(GOOD), None), (j(GOOD), "application/x-www-form-urlencoded"),
                        (j(GOOD), "application/json; charset=utf-8")]:
        status, _, raw = send(server.base, body, ctype)
        assert status == 200, (body, ctype, raw)
        assert json.loads(raw)["choices"][0]["token_ids"] == want
    status, _, raw = send(server.base, j(dict(GOOD, logprobs=5)))
    assert status == 200, raw
    assert all(len(top) >= 5 for top in json.loads(raw)["choices"][0]["logprobs"]["top_logprobs"])


def test_flags_beat_the_file_and_nothing_was_left_behind(server):
    status, _, raw = send(server.base, b"", None, "GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "fuzz"   # --model-name over [server]
    m = metrics(server.base)
    assert m["wideep_requests_running"] == 0 and m["wideep_requests_waiting"] == 0
    assert m["wideep_kv_cache_blocks_used"] == 0
    assert send(server.base, b"", None, "GET", "/health")[0] == 200


def test_a_handler_bug_is_a_json_500_and_the_next_request_works(tiny, want, monkeypatch):
    """In process (the same Server class): an exception that is not bad input is logged and answered
    500 as JSON; the server goes on serving."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from engine.front.async_engine import AsyncEngine
    from engine.front.engine import Engine
    from launch import server as server_mod

    real = server_mod.parse_completion
    calls = []

    def parse_once_broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug")
        return real(*args)

    monkeypatch.setattr(server_mod, "parse_completion", parse_once_broken)

    async def go():
        aengine = AsyncEngine(Engine(tiny, progress=False, max_model_len=64, kv_cache_blocks=16))
        try:
            async with TestClient(TestServer(server_mod.Server(aengine, "fuzz").app(), host="127.0.0.1")) as c:
                r = await c.post("/v1/completions", json=GOOD)
                assert r.status == 500
                assert (await r.json())["error"] == {"message": "internal server error (logged on the server)",
                                                     "type": "server_error", "code": 500}
                r = await c.post("/v1/completions", json=GOOD)
                assert r.status == 200 and (await r.json())["choices"][0]["token_ids"] == want
        finally:
            await aengine.shutdown()
    asyncio.run(go())
