"""Hostile and malformed HTTP requests against one `wideep serve` (a subprocess on 127.0.0.1): each is
answered 4xx with a JSON error naming the problem, and the next good request is still answered
correctly (equal to LLM.generate). The server is started from a config file with flags over it
(--max-logprobs, --served-model-name with two names, --allowed-origins), which these tests also check;
/tokenize, /detokenize, /version, X-Request-Id and CORS are checked here too."""
from __future__ import annotations

import http.client
import json

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
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


ORIGIN = "https://ok.example"


def send(base: str, body: bytes, content_type: str | None = JSON, method: str = "POST",
         path: str = "/v1/completions", headers: dict | None = None, with_headers: bool = False):
    """-> (status, Content-Type, body) (and the response headers with with_headers)."""
    conn = http.client.HTTPConnection(base, timeout=60)
    conn.request(method, path, body=body, headers={**({"Content-Type": content_type} if content_type else {}),
                                                   **(headers or {})})
    r = conn.getresponse()
    out = (r.status, r.getheader("Content-Type", ""), r.read())
    hdrs = dict(r.getheaders())
    conn.close()
    return (*out, hdrs) if with_headers else out


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
    s = ServerProc(["--config", str(path), "--port", "0", "--max-logprobs", "5", "--served-model-name", "fuzz",
                    "fuzz-alias", "--allowed-origins", f'["{ORIGIN}"]'])
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
    ("skip_special_tokens string", P(skip_special_tokens="no"), JSON, "POST", None, 400,
     "'skip_special_tokens' must be true or false"),
    ("negative presence_penalty", P(presence_penalty=-3), JSON, "POST", None, 400,
     "presence_penalty must be in [-2, 2], got -3"),
    ("frequency_penalty string", P(frequency_penalty="x"), JSON, "POST", None, 400,
     "'frequency_penalty' must be a number"),
    ("zero repetition_penalty", P(repetition_penalty=0), JSON, "POST", None, 400, "repetition_penalty must be > 0"),
    ("min_p above 1", P(min_p=2), JSON, "POST", None, 400, "min_p must be in [0, 1], got 2"),
    ("min_tokens over max_tokens", P(min_tokens=20), JSON, "POST", None, 400,
     "min_tokens (20) must be <= max_tokens (16)"),
    ("logit_bias list", P(logit_bias=[5]), JSON, "POST", None, 400, "'logit_bias' must be an object"),
    ("logit_bias word key", P(logit_bias={"five": 1}), JSON, "POST", None, 400, "'logit_bias' keys must be token ids"),
    ("logit_bias out of vocab", P(logit_bias={"1000000": 1}), JSON, "POST", None, 400,
     "logit_bias token id 1000000 is out of range"),
    ("1000 stop strings", P(stop=["\n"] * 1000), JSON, "POST", None, 400, "at most 128 are allowed"),
    ("long stop string", P(stop="x" * 10000), JSON, "POST", None, 400, "at most 512 are allowed"),
    ("model as a list", P(model=["fuzz"]), JSON, "POST", None, 404, "does not exist; this server serves 'fuzz'"),
    ("text/plain", j(GOOD), "text/plain", "POST", None, 415, "Content-Type 'text/plain' is not supported"),
    ("multipart", b"--x\r\n\r\n--x--", "multipart/form-data; boundary=x", "POST", None, 415,
     "Content-Type 'multipart/form-data' is not supported"),
    ("body over 1 MiB", j({"prompt": [1] * 400_000}), JSON, "POST", None, 413, "Maximum request body size"),
    ("GET on a POST route", b"", None, "GET", None, 405, "Method Not Allowed: GET /v1/completions"),
    ("unknown path", j(GOOD), JSON, "POST", "/v1/chat/nothing", 404, "Not Found: POST /v1/chat/nothing"),
    # JSON escapes of lone UTF-16 surrogates: valid JSON, but no text a tokenizer can take
    ("lone low surrogate in prompt", b'{"prompt": "\\udcff abc", "max_tokens": 2}', JSON, "POST", None, 400,
     "'prompt' holds an unpaired UTF-16 surrogate"),
    ("lone high surrogate at the end", b'{"prompt": "abc\\ud800"}', JSON, "POST", None, 400,
     "'prompt' holds an unpaired UTF-16 surrogate"),
    ("surrogate in a prompt list", b'{"prompt": ["\\udfff"]}', JSON, "POST", None, 400,
     "'prompt[0]' holds an unpaired UTF-16 surrogate"),
    ("surrogate in an ignored field", b'{"prompt": [1], "user": {"n": "\\udc80"}}', JSON, "POST", None, 400,
     "'user.n' holds an unpaired UTF-16 surrogate"),
    ("surrogate in a key", b'{"prompt": [1], "\\ud801": 1}', JSON, "POST", None, 400,
     "holds an unpaired UTF-16 surrogate"),
    ("surrogate on /tokenize", b'{"prompt": "x\\udcffy"}', JSON, "POST", "/tokenize", 400,
     "'prompt' holds an unpaired UTF-16 surrogate"),
    ("tokenize without prompt", j({"text": "hi"}), JSON, "POST", "/tokenize", 400, "'prompt' must be a string"),
    ("tokenize token ids", j({"prompt": [1, 2]}), JSON, "POST", "/tokenize", 400, "'prompt' must be a string"),
    ("tokenize bad messages", j({"messages": "hi"}), JSON, "POST", "/tokenize", 400, "'messages' is required"),
    ("tokenize add_special_tokens string", j({"prompt": "hi", "add_special_tokens": "no"}), JSON, "POST",
     "/tokenize", 400, "'add_special_tokens' must be true or false"),
    ("tokenize another model", j({"prompt": "hi", "model": "other"}), JSON, "POST", "/tokenize", 404,
     "model 'other' does not exist"),
    ("tokenize not an object", j(["hi"]), JSON, "POST", "/tokenize", 400, "must be a JSON object, got list"),
    ("tokenize text/plain", b"hi", "text/plain", "POST", "/tokenize", 415, "Content-Type 'text/plain'"),
    ("detokenize negative id", j({"tokens": [-1]}), JSON, "POST", "/detokenize", 400, "token id -1 is out of range"),
    ("detokenize huge id", j({"tokens": [10 ** 30]}), JSON, "POST", "/detokenize", 400, "is out of range"),
    ("detokenize text", j({"tokens": "1 2"}), JSON, "POST", "/detokenize", 400, "'tokens' must be a list"),
    ("detokenize bools", j({"tokens": [True]}), JSON, "POST", "/detokenize", 400, "'tokens' must be a list"),
    ("GET /tokenize", b"", None, "GET", "/tokenize", 405, "Method Not Allowed: GET /tokenize"),
    ("POST /version", b"", None, "POST", "/version", 405, "Method Not Allowed: POST /version"),
]


@pytest.mark.parametrize("name,body,ctype,method,path,status,match", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_a_json_4xx_and_server_keeps_serving(server, want, name, body, ctype, method, path,
                                                                status, match):
    got, got_type, raw = send(server.base, body, ctype, method, path or "/v1/completions")
    assert b"Traceback" not in raw
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
    pass; the logits-processing fields at their neutral values change nothing; top_k 0 means off;
    no Content-Type and curl's default form type are read as JSON;
    logprobs up to the flag's cap (5, over the file's 20) are served."""
    for body, ctype in [(j(dict(GOOD, user="u", some_new_field={"x": [1]})), JSON),
                        (j(dict(GOOD, presence_penalty=0, logit_bias={}, suffix="", top_k=0)), JSON),
                        (j(dict(GOOD, frequency_penalty=0.0, repetition_penalty=1, min_p=0, min_tokens=0,
                                logit_bias={"5": 0})), JSON),
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
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "fuzz"   # --served-model-name over [server]
    m = metrics(server.base)
    assert m["wideep_requests_running"] == 0 and m["wideep_requests_waiting"] == 0
    assert m["wideep_kv_cache_blocks_used"] == 0
    assert send(server.base, b"", None, "GET", "/health")[0] == 200


def test_a_handler_bug_is_a_json_500_and_the_next_request_works(tiny, want, monkeypatch):
    """In process (the same Server class): an exception that is not bad input is logged and answered
    500 as JSON; the server goes on serving."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from wideep.engine.front.async_engine import AsyncEngine
    from wideep.engine.front.engine import Engine
    from wideep.launch.server import app as server_mod

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


def test_surrogates_then_the_server_still_serves(server, want):
    """Many surrogate bodies in a row, stream and not: each a 400, and then a good request is answered."""
    for i in range(20):
        esc = rb"\ud8%02x" % (i % 0x100) if i % 2 else rb"\udc%02x" % i
        body = b'{"prompt": "ab' + esc + b'cd", "stream": ' + (b"true" if i % 3 else b"false") + b"}"
        status, _, raw = send(server.base, body)
        assert status == 400 and b"unpaired UTF-16 surrogate" in raw, raw
    # a valid pair (an emoji as two escapes) is text: it is served
    status, _, raw = send(server.base, b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2, "model": "fuzz"}')
    assert status == 200, raw
    assert good_answer(server.base) == want


def test_models_cards_and_served_names(server, tiny, want):
    """vLLM's model cards: every --served-model-name listed with root (the path), created, max_model_len;
    any name is accepted as `model`, responses report the first."""
    status, _, raw = send(server.base, b"", None, "GET", "/v1/models")
    cards = json.loads(raw)["data"]
    assert [c["id"] for c in cards] == ["fuzz", "fuzz-alias"]
    for c in cards:
        assert c["object"] == "model" and c["root"] == tiny and c["max_model_len"] == 128
        assert isinstance(c["created"], int) and c["owned_by"] == "wideep"
    status, _, raw = send(server.base, j(dict(GOOD, model="fuzz-alias")))
    assert status == 200 and json.loads(raw)["model"] == "fuzz"
    assert json.loads(raw)["choices"][0]["token_ids"] == want
    status, _, raw = send(server.base, j(dict(GOOD, model="other")))
    assert status == 404 and b"does not exist" in raw


def test_tokenize_detokenize_and_version(server, tiny):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f"{tiny}/tokenizer.json")
    text = "hello world, tokens"
    for add in (True, False):
        status, _, raw = send(server.base, j({"prompt": text, "add_special_tokens": add, "model": "fuzz-alias"}),
                              path="/tokenize")
        assert status == 200, raw
        r = json.loads(raw)
        ids = tok.encode(text, add_special_tokens=add).ids
        assert r == {"tokens": ids, "count": len(ids), "max_model_len": 128, "token_strs": None}
    status, _, raw = send(server.base, j({"prompt": text, "return_token_strs": True}), path="/tokenize")
    assert json.loads(raw)["token_strs"] == tok.encode(text).tokens
    ids = tok.encode(text, add_special_tokens=False).ids
    status, _, raw = send(server.base, j({"tokens": ids}), path="/detokenize")
    assert status == 200 and json.loads(raw) == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    status, _, raw = send(server.base, j({"tokens": []}), path="/detokenize")
    assert status == 200 and json.loads(raw) == {"prompt": ""}
    status, _, raw = send(server.base, b"", None, "GET", "/version")
    assert status == 200 and isinstance(json.loads(raw)["version"], str)


def test_tokenize_messages_gives_the_chat_prompt(server, tiny):
    """The chat form of /tokenize: the ids /v1/chat/completions runs (its usage counts them), one BOS."""
    msgs = [{"role": "user", "content": "hello there"}]
    status, _, raw = send(server.base, j({"messages": msgs}), path="/tokenize")
    assert status == 200, raw
    ids = json.loads(raw)["tokens"]
    status, _, raw, h = send(server.base, j({"messages": msgs, "max_tokens": 2, "temperature": 0}),
                             path="/v1/chat/completions", headers={"X-Request-Id": "chat-7"}, with_headers=True)
    assert status == 200, raw
    r = json.loads(raw)
    assert r["usage"]["prompt_tokens"] == len(ids) and "cached_tokens" in r["usage"]["prompt_tokens_details"]
    assert h["X-Request-Id"] == "chat-7" and r["id"] == "chatcmpl-chat-7"
    from tokenizers import Tokenizer
    bos = Tokenizer.from_file(f"{tiny}/tokenizer.json").token_to_id("<｜begin▁of▁sentence｜>")
    assert bos is None or ids.count(bos) <= 1


def test_x_request_id_is_the_id_and_is_echoed(server):
    status, _, raw, h = send(server.base, j(GOOD), headers={"X-Request-Id": "trace-42"}, with_headers=True)
    assert status == 200 and h["X-Request-Id"] == "trace-42"
    assert json.loads(raw)["id"] == "cmpl-trace-42"
    status, _, raw, h = send(server.base, j(dict(GOOD, stream=True)), headers={"X-Request-Id": "trace-43"},
                             with_headers=True)
    assert status == 200 and h["X-Request-Id"] == "trace-43"
    assert json.loads(raw.decode().split("\n\n")[0][len("data: "):])["id"] == "cmpl-trace-43"
    # the same id again (the first finished): the same id; errors and other routes echo it too
    status, _, raw, h = send(server.base, j(GOOD), headers={"X-Request-Id": "trace-42"}, with_headers=True)
    assert json.loads(raw)["id"] == "cmpl-trace-42"
    for body, path in [(j({"prompt": [-1]}), "/v1/completions"), (j({"prompt": "a"}), "/tokenize")]:
        status, _, raw, h = send(server.base, body, path=path, headers={"X-Request-Id": "e1"}, with_headers=True)
        assert h["X-Request-Id"] == "e1", (path, h)
    status, _, raw, h = send(server.base, j(GOOD), with_headers=True)   # none sent: the id it ran under
    assert h["X-Request-Id"] == json.loads(raw)["id"] and h["X-Request-Id"].startswith("cmpl-")


def test_cors_for_the_allowed_origin_only(server):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization"}
    status, _, _, h = send(server.base, b"", None, "OPTIONS", headers=pre, with_headers=True)
    assert status == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in h["Access-Control-Allow-Methods"]
    assert h["Access-Control-Allow-Headers"] == "content-type, authorization"
    status, _, raw = send(server.base, b"", None, "OPTIONS", headers=dict(pre, Origin="https://evil.example"))
    assert status == 403 and b"not allowed" in raw
    status, _, _, h = send(server.base, j(GOOD), headers={"Origin": ORIGIN}, with_headers=True)
    assert status == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    status, _, _, h = send(server.base, j(dict(GOOD, stream=True)), headers={"Origin": ORIGIN}, with_headers=True)
    assert status == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    for hdrs in ({"Origin": "https://evil.example"}, {}):
        status, _, _, h = send(server.base, j(GOOD), headers=hdrs, with_headers=True)
        assert status == 200 and "Access-Control-Allow-Origin" not in h


def test_a_repeated_x_request_id_in_flight_gets_a_suffix(tiny, want):
    """In process: two concurrent requests with the same X-Request-Id both run (the engine refuses
    a duplicate id), under cmpl-dup and cmpl-dup-<suffix>; each response echoes the header as sent."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from wideep.engine.front.async_engine import AsyncEngine
    from wideep.engine.front.engine import Engine
    from wideep.launch.server.app import Server

    async def go():
        aengine = AsyncEngine(Engine(tiny, progress=False, max_model_len=64, kv_cache_blocks=16))
        try:
            async with TestClient(TestServer(Server(aengine, "fuzz").app(), host="127.0.0.1")) as c:
                async def one():
                    r = await c.post("/v1/completions", json=dict(GOOD, max_tokens=8, stream=True),
                                     headers={"X-Request-Id": "dup"})
                    first = json.loads((await r.content.readuntil(b"\n\n"))[len(b"data: "):])
                    await r.read()
                    return r.status, r.headers["X-Request-Id"], first["id"]
                got = await asyncio.gather(one(), one())
            assert [g[:2] for g in got] == [(200, "dup")] * 2
            ids = sorted(g[2] for g in got)
            assert ids[0] == "cmpl-dup" and ids[1].startswith("cmpl-dup-"), ids
        finally:
            await aengine.shutdown()
    asyncio.run(go())
