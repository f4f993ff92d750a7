"""An API key protects /v1/*: `wideep serve MODEL_DIR` (no config file; the key from WIDEEP_API_KEY)
answers 401 with a JSON error unless `Authorization: Bearer KEY` matches; /health and /metrics stay
open; the official openai client with api_key= works (passing the model path as vLLM clients do).
protect_metrics closes /metrics too."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.test_server import ServerProc, request

KEY = "sk-wideep-test-9f2c"
PROMPT, N = [5, 6, 7], 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=4)


@pytest.fixture(scope="module")
def want(tiny):
    llm = LLM(tiny, progress=False, max_model_len=128, kv_cache_blocks=64)
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N))[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server(tiny):
    s = ServerProc([tiny, "--port", "0", "--max-model-len", "128", "--kv-cache-blocks", "64",
                    "--dispatch-backend", "torch"], env={"WIDEEP_API_KEY": KEY})
    yield s
    assert s.stop() == [0], s.output


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


BODY = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.0}


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), bearer(KEY[:-1]), bearer(KEY + "x"),
                                     {"Authorization": f"bearer {KEY}"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "},
                                     {"X-Api-Key": KEY}],
                         ids=["none", "wrong", "prefix", "longer", "lowercase-scheme", "no-scheme",
                              "basic", "empty", "other-header"])
def test_v1_without_the_key_is_401_json(server, headers):
    for method, path, body in [("POST", "/v1/completions", BODY), ("GET", "/v1/models", None),
                               ("POST", "/v1/unknown", BODY)]:   # no route is revealed without the key
        status, raw = request(server.base, method, path, body, headers=headers)
        assert status == 401, (path, raw)
        err = json.loads(raw)["error"]
        assert "missing or invalid API key" in err["message"] and err["code"] == 401
        assert KEY not in raw.decode()


def test_non_ascii_authorization_header_is_401(server):
    import http.client
    conn = http.client.HTTPConnection(server.base, timeout=30)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", "Bearer ключ".encode())
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 401 and "missing or invalid API key" in json.loads(r.read())["error"]["message"]
    conn.close()


def test_with_the_key_serves_and_health_metrics_stay_open(server, tiny, want):
    name = os.path.basename(tiny)   # no --model-name: the directory's name, and the path as given
    for model in (None, name, tiny):
        status, raw = request(server.base, "POST", "/v1/completions", dict(BODY, model=model), headers=bearer(KEY))
        assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == want
        assert json.loads(raw)["model"] == name
    status, raw = request(server.base, "POST", "/v1/completions", dict(BODY, model=tiny + "x"), headers=bearer(KEY))
    assert status == 404 and f"this server serves {name!r}" in json.loads(raw)["error"]["message"]
    assert request(server.base, "GET", "/v1/unknown", headers=bearer(KEY))[0] == 404
    assert request(server.base, "GET", "/health") == (200, b'{"status": "ok"}')
    status, raw = request(server.base, "GET", "/metrics")
    assert status == 200 and b"wideep_requests_running" in raw
    assert "API key required" in "".join(server.output[0])


def test_openai_client(server, tiny, want):
    openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")
    client = openai.OpenAI(base_url=f"http://{server.base}/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.completions.create(model=tiny, prompt=PROMPT, max_tokens=N, temperature=0.0, logprobs=2)
    c = r.choices[0]
    assert c.token_ids == want                        # wideep's extra field, kept by the client
    assert c.finish_reason in ("length", "stop") and r.usage.completion_tokens == len(want)
    assert len(c.logprobs.token_logprobs) == len(want) and all(len(t) >= 2 for t in c.logprobs.top_logprobs)
    chunks = list(client.completions.create(model=tiny, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                            stream=True))
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
    assert [m.id for m in client.models.list()] == [os.path.basename(tiny)]
    bad = openai.OpenAI(base_url=f"http://{server.base}/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError, match="missing or invalid API key"):
        bad.completions.create(model=tiny, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="more than max_logprobs=20"):
        client.completions.create(model=tiny, prompt=PROMPT, max_tokens=2, logprobs=21)


def test_protect_metrics(tiny):
    """In process (the same Server class): /metrics needs the key with protect_metrics; /health never."""
    from aiohttp.test_utils import TestClient, TestServer

    from wideep.engine.front.async_engine import AsyncEngine
    from wideep.engine.front.engine import Engine
    from wideep.launch.server.app import Server

    async def go():
        aengine = AsyncEngine(Engine(tiny, progress=False, max_model_len=64, kv_cache_blocks=16))
        try:
            async with TestClient(TestServer(Server(aengine, "tiny", KEY, protect_metrics=True).app(),
                                             host="127.0.0.1")) as c:
                r = await c.get("/metrics")
                assert r.status == 401 and (await r.json())["error"]["code"] == 401
                assert r.headers["WWW-Authenticate"] == "Bearer"
                r = await c.get("/metrics", headers=bearer(KEY))
                assert r.status == 200 and "wideep_requests_running" in await r.text()
                assert (await c.get("/health")).status == 200
                assert (await c.get("/v1/models")).status == 401
        finally:
            await aengine.shutdown()
    asyncio.run(go())
