"""`wideep serve` over real HTTP on 127.0.0.1: the server runs as `python -m wideep.launch serve` in a
subprocess (port 0, the bound port read from its first line), is stopped by its pid with SIGTERM and
must exit 0. Completions (stream and not) equal LLM.generate (greedy); concurrent requests; /metrics
parses and moves; every bad input is a 400/404 with a message and the next request still works; a
client that disconnects mid-stream aborts its request; 2 ranks (worker loop) serve the same tokens,
survive idling past the collective timeout, and both exit 0 when SIGTERM reaches every rank."""
from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.launch.cli.local import LAUNCHER_VARS, start_ranks
from wideep.launch.server.prometheus import parse
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

PROMPTS = [[5, 6, 7], list(range(2, 40)), [9] * 70, "hello world"]
MAX_TOKENS = [12, 5, 9, 7]
CONFIG = """
[model]
path = "{path}"
max_model_len = 128
[parallel]
dispatch_backend = "torch"
timeout_s = {timeout_s}
[engine]
kv_cache_blocks = 64
[server]
port = 0
model_name = "tiny"
"""


class ServerProc:
    """`python -m wideep.launch serve <args>` (a config path: `--config` it) on `ranks` local ranks
    (torchrun-style env, as launch/cli/local.py sets it); env: extra environment variables."""

    def __init__(self, args: str | list[str], ranks: int = 1, start_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None):
        args = ["--config", args] if isinstance(args, str) else args
        self.procs, self.lines = [], queue.Queue()
        penv = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS + ("WIDEEP_API_KEY",)}
        penv.update(env or {})
        cmd = [sys.executable, "-m", "wideep.launch", "serve", *args]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if ranks > 1:
            self.procs = start_ranks(cmd, ranks, dict(penv, OMP_NUM_THREADS="1"), **pipes)
        else:
            self.procs = [subprocess.Popen(cmd, env=penv, **pipes)]
        self.output: list[list[str]] = [[] for _ in range(ranks)]
        for rank, p in enumerate(self.procs):  # drain every pipe: a full pipe would block a rank
            threading.Thread(target=self._drain, args=(rank, p), daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise AssertionError(f"server did not start: {self.output}") from None
            if "http://127.0.0.1:" in line:
                self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
                break
        self.base = f"127.0.0.1:{self.port}"

    def _drain(self, rank: int, p) -> None:
        for line in p.stdout:
            self.output[rank].append(line)
            if rank == 0:
                self.lines.put(line)

    def stop(self, timeout_s: float = 60.0, every_rank: bool = False) -> list[int | None]:
        """SIGTERM rank 0 (which releases the workers), or every rank at once as torchrun does;
        anything still running after timeout_s is killed."""
        for p in self.procs if every_rank else self.procs[:1]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline, rcs = time.monotonic() + timeout_s, []
        for p in self.procs:
            try:
                rcs.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()  # by pid: only what this test started
                p.wait()
                rcs.append(None)
        return rcs


def request(base: str, method: str, path: str, body=None, timeout_s: float = 60.0,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(base, timeout=timeout_s)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = (r.status, r.read())
    conn.close()
    return out


def complete(base: str, prompt, max_tokens: int, stream: bool, **extra) -> dict:
    """-> {"token_ids", "finish_reason", "usage", "chunks"} of one greedy completion (200 asserted)."""
    body = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=stream, **extra)
    status, raw = request(base, "POST", "/v1/completions", body)
    assert status == 200, raw
    if not stream:
        r = json.loads(raw)
        assert r["object"] == "text_completion" and r["model"] == "tiny" and r["id"].startswith("cmpl-")
        c = r["choices"][0]
        return {"token_ids": c["token_ids"], "finish_reason": c["finish_reason"], "usage": r["usage"],
                "text": c["text"], "logprobs": c["logprobs"], "chunks": 1}
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()["usage"] if extra.get("stream_options") else None
    toks = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    return {"token_ids": toks, "finish_reason": chunks[-1]["choices"][0]["finish_reason"], "usage": usage,
            "chunks": len(chunks)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=4)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, progress=False, max_model_len=128, kv_cache_blocks=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n)
                                                                   for n in MAX_TOKENS])]


def write_config(tiny: str, tmp_path, timeout_s: float = 60) -> str:
    path = tmp_path / "serve.toml"
    path.write_text(CONFIG.format(path=tiny, timeout_s=timeout_s))
    return str(path)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = ServerProc(write_config(tiny, tmp_path_factory.mktemp("cfg")))
    yield s
    assert s.stop() == [0], s.output
    assert "stopped" in "".join(s.output[0])


def test_health_and_models(server, tiny):
    assert request(server.base, "GET", "/health") == (200, b'{"status": "ok"}')
    status, raw = request(server.base, "GET", "/v1/models")
    cards = json.loads(raw)["data"]
    assert status == 200 and [c["id"] for c in cards] == ["tiny"]
    assert cards[0]["root"] == tiny and cards[0]["max_model_len"] == 128 and isinstance(cards[0]["created"], int)


def test_openai_client_models_and_cached_tokens(server, tiny):
    """The official client: models.list() (root, as `vllm bench serve` reads it), and a completion's
    usage.prompt_tokens_details.cached_tokens: 0 the first time, one full block (64 tokens of the 100)
    when the same prompt comes again, streamed usage too."""
    import openai
    client = openai.OpenAI(base_url=f"http://{server.base}/v1", api_key="unused", max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].model_extra["root"] == tiny
    prompt = list(range(150, 250))   # no other test sends these: nothing of it is cached yet
    usages = [client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0).usage
              for _ in range(2)]
    assert [u.prompt_tokens for u in usages] == [100, 100] and usages[0].completion_tokens == 3
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 64]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64


def test_no_cors_unless_asked(server):
    """Without --allowed-origins: no preflight route (405) and no Access-Control-Allow-Origin."""
    pre = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}
    conn = http.client.HTTPConnection(server.base, timeout=60)
    conn.request("OPTIONS", "/v1/completions", headers=pre)
    r = conn.getresponse()
    r.read()
    assert r.status == 405 and r.getheader("Access-Control-Allow-Origin") is None
    conn.request("GET", "/v1/models", headers={"Origin": "https://a.example"})
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") is None


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_llm_generate(server, reference, stream):
    for prompt, n, want in zip(PROMPTS, MAX_TOKENS, reference):
        got = complete(server.base, prompt, n, stream, stream_options={"include_usage": True} if stream else None)
        assert got["token_ids"] == want
        assert got["finish_reason"] in ("length", "stop")
        assert got["usage"]["completion_tokens"] == len(want)
        assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + len(want)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        if stream:
            assert got["chunks"] == len(want)  # one token per chunk


def test_logprobs(server, reference):
    got = complete(server.base, PROMPTS[0], MAX_TOKENS[0], False, logprobs=2)
    lp = got["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(reference[0])
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) >= 2 for t in lp["top_logprobs"])


def test_concurrent_requests(server, reference):
    jobs = [(i, s) for i in range(len(PROMPTS)) for s in (False, True)] * 2
    with ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(lambda j: complete(server.base, PROMPTS[j[0]], MAX_TOKENS[j[0]], j[1]), jobs))
    for (i, _), g in zip(jobs, got):
        assert g["token_ids"] == reference[i]


def metrics(base: str) -> dict[str, float]:
    status, raw = request(base, "GET", "/metrics")
    assert status == 200
    text = raw.decode()
    for name in ("wideep_requests_running", "wideep_kv_cache_blocks_used", "wideep_generation_tokens_total",
                 "wideep_time_to_first_token_seconds"):
        assert f"# TYPE {name} " in text
    return parse(text)


def test_metrics_move(server, reference):
    before = metrics(server.base)
    complete(server.base, PROMPTS[1], MAX_TOKENS[1], False)
    after = metrics(server.base)
    n = len(reference[1])
    assert after["wideep_generation_tokens_total"] - before["wideep_generation_tokens_total"] == n
    assert after["wideep_prompt_tokens_total"] - before["wideep_prompt_tokens_total"] == len(PROMPTS[1])
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        c = f"wideep_{h}_seconds_count"
        assert after[c] == before.get(c, 0) + 1
        assert after[f'wideep_{h}_seconds_bucket{{le="+Inf"}}'] == after[c]
    buckets = [v for k, v in after.items() if k.startswith("wideep_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative
    assert after["wideep_requests_running"] == 0 and after["wideep_kv_cache_blocks_free"] == 64
    assert 0.0 <= after["wideep_prefix_cache_hit_rate"] <= 1.0


BAD = [
    (b'{"prompt": [1, 2', 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"max_tokens": 4}, 400, "'prompt' is required"),
    ({"prompt": ""}, 400, "'prompt' is empty"),
    ({"prompt": []}, 400, "'prompt' is empty"),
    ({"prompt": list(range(2, 200))}, 400, "max_model_len=128"),
    ({"prompt": [1, 2, 3], "max_tokens": 200}, 400, "exceeds the context"),
    ({"prompt": [1, 2, 3], "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ({"prompt": [1, 2, 3], "max_tokens": "8"}, 400, "'max_tokens' must be an integer"),
    ({"prompt": [1, 2, 3], "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"prompt": [1, 2, 3], "temperature": -1}, 400, "temperature must be >= 0"),
    ({"prompt": [1, 2, 3], "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"prompt": [1, "a"]}, 400, "list of integer token ids"),
    ({"prompt": {"text": "hi"}}, 400, "'prompt' must be a string or a list"),
    ({"prompt": [1, 10 ** 6]}, 400, "out of range"),
    ({"prompt": [[1, 2], []]}, 400, "'prompt[1]' is empty"),
    ({"prompt": [1, 2], "stop": ["x"] * 1000}, 400, "at most 128"),
    ({"prompt": [1, 2], "stop": 5}, 400, "'stop' must be a string or a list"),
    ({"prompt": [1, 2], "best_of": 3}, 400, "'best_of' is not supported"),
    ({"prompt": [[1, 2]] * 20, "n": 100}, 400, "2000 choices; at most 1024"),
    ({"prompt": [1, 2], "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"prompt": [1, 2], "stop_token_ids": "1"}, 400, "'stop_token_ids' must be a list"),
    ({"prompt": [1, 2], "n": 0}, 400, "'n' must be >= 1"),
    ({"prompt": [1, 2], "n": 10 ** 6}, 400, "n must be in [1, 128]"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "does not exist"),
]


@pytest.mark.parametrize("body,status,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_a_clear_error_and_server_keeps_serving(server, reference, body, status, match):
    got_status, raw = request(server.base, "POST", "/v1/completions", body)
    assert got_status == status, raw
    assert match in json.loads(raw)["error"]["message"]
    assert complete(server.base, PROMPTS[0], MAX_TOKENS[0], False)["token_ids"] == reference[0]


def test_client_disconnect_mid_stream_aborts(server):
    before = metrics(server.base)
    body = json.dumps({"prompt": [3, 4, 5], "max_tokens": 120, "temperature": 0.0, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data: ") < 2:  # two tokens streamed: the request is running
            got += s.recv(4096)
    deadline = time.monotonic() + 30
    key = 'wideep_requests_finished_total{finish_reason="abort"}'
    while True:
        m = metrics(server.base)
        if m.get(key, 0) == before.get(key, 0) + 1 and m["wideep_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"not aborted: {m}"
        time.sleep(0.1)
    assert m["wideep_kv_cache_blocks_used"] == 0 and m["wideep_requests_active"] == 0
    assert m["wideep_generation_tokens_total"] - before["wideep_generation_tokens_total"] < 120


@pytest.mark.multirank
def test_two_ranks_worker_loop(tiny, reference, tmp_path):
    # timeout_s=8 bounds every collective; idling 10 s checks that the workers wait for an idle
    # front (on the engine's doorbell) instead of timing out.
    s = ServerProc(write_config(tiny, tmp_path, timeout_s=8), ranks=2)
    try:
        jobs = [(i, st) for i in range(len(PROMPTS)) for st in (False, True)]
        with ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: complete(s.base, PROMPTS[j[0]], MAX_TOKENS[j[0]], j[1]), jobs))
        assert [g["token_ids"] for g in got] == [reference[i] for i, _ in jobs]
        m = metrics(s.base)
        assert sum(v for k, v in m.items() if k.startswith("wideep_rank_requests_running")) == 0
        assert len([k for k in m if k.startswith("wideep_rank_kv_cache_blocks_used")]) == 2
        for r in (0, 1):   # both ranks sent MoE rows to the other
            assert m[f'wideep_rank_moe_remote_bytes_total{{dp_rank="{r}"}}'] > 0
            assert m[f'wideep_rank_dbo_split_steps_total{{dp_rank="{r}"}}'] == 0
        time.sleep(10)
        assert complete(s.base, PROMPTS[0], MAX_TOKENS[0], True)["token_ids"] == reference[0]
    finally:
        rcs = s.stop(every_rank=True)
    assert rcs == [0, 0], s.output
    assert "stopped\n" in s.output[0][-1]  # a clean stop, no lost rank


def test_prometheus_per_rank_families():
    from wideep.launch.server.prometheus import render
    ranks = [{"running": 1, "kv_blocks_used": 3, "dispatch_bytes_remote": 4096, "dbo_split_steps": 7,
              "eplb_rebalances": 2, "eplb_balancedness": 0.93},
             {"running": 0, "kv_blocks_used": 0, "dispatch_bytes_remote": 1024, "dbo_split_steps": 7,
              "eplb_rebalances": 2, "eplb_balancedness": None}]
    text = render({"running": 1, "per_rank": ranks})
    m = parse(text)
    assert m['wideep_rank_moe_remote_bytes_total{dp_rank="1"}'] == 1024
    assert m['wideep_rank_eplb_balancedness{dp_rank="0"}'] == 0.93
    assert 'wideep_rank_eplb_balancedness{dp_rank="1"}' not in m     # no rebalance there yet
    assert "# TYPE wideep_rank_eplb_rebalances_total counter" in text
    assert "wideep_rank_dbo_split_steps_total" in text
    assert "eplb" not in render({"per_rank": [{"running": 0, "kv_blocks_used": 0}]})   # EPLB off: no family
    assert "nodes_per_token" not in text


@pytest.mark.multirank
@pytest.mark.slow
def test_a_streaming_completion_survives_a_worker_loss(tiny, tmp_path):
    """4 ranks serving with on_rank_loss = "continue": streams running on every rank; rank 2 is killed
    (SIGKILL, by its pid) mid-stream; every stream still ends with exactly the tokens of a run without
    the loss — none duplicated, none missing — and /metrics counts the loss and the re-admissions."""
    cfg = tmp_path / "elastic.toml"
    cfg.write_text(CONFIG.format(path=tiny, timeout_s=30).replace(
        "[parallel]\n", '[parallel]\non_rank_loss = "continue"\nnum_redundant_experts = 4\nheartbeat_s = 0.5\n'))
    prompts = [[3 + i, 4, 5 + i] for i in range(8)]
    want = [o.outputs[0].token_ids for o in LLM(tiny, progress=False, max_model_len=128, kv_cache_blocks=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))]
    s = ServerProc(str(cfg), ranks=4)
    try:
        with ThreadPoolExecutor(len(prompts) + 1) as ex:
            futs = [ex.submit(complete, s.base, p, 60, True, ignore_eos=True) for p in prompts]
            time.sleep(1.0)                       # the streams are under way
            s.procs[2].kill()                     # by pid: rank 2 only
            got = [f.result(timeout=240) for f in futs]
        assert [g["token_ids"] for g in got] == want
        assert all(g["finish_reason"] == "length" for g in got)
        m = metrics(s.base)
        assert m["wideep_rank_losses_total"] == 1 and m["wideep_requests_readmitted_total"] >= 1
        assert complete(s.base, prompts[0], 60, True, ignore_eos=True)["token_ids"] == want[0]  # serving on
    finally:
        rcs = s.stop()
    assert rcs[0] == 0 and rcs[1] == 0 and rcs[3] == 0, s.output


def test_prometheus_routing_histogram_and_tiers():
    from wideep.launch.server.prometheus import render
    ranks = [{"running": 0, "dispatch_bytes_intra": 300, "dispatch_bytes_inter": 200,
              "moe_nodes_per_token": [1, 10, 5, 0, 0], "moe_nodes_per_token_step": [0, 3, 2, 0, 0]},
             {"running": 0, "moe_nodes_per_token": [0, 0, 0, 0, 0], "moe_nodes_per_token_step": [0, 0, 0, 0, 0]}]
    text = render({"per_rank": ranks})
    m = parse(text)
    name = "wideep_rank_moe_nodes_per_token"
    assert f"# TYPE {name} histogram" in text
    assert [m[f'{name}_bucket{{dp_rank="0",le="{j}"}}'] for j in range(5)] == [1, 11, 16, 16, 16]
    assert m[f'{name}_bucket{{dp_rank="0",le="+Inf"}}'] == m[f'{name}_count{{dp_rank="0"}}'] == 16
    assert m[f'{name}_sum{{dp_rank="0"}}'] == 10 + 2 * 5
    assert m[f'{name}_count{{dp_rank="1"}}'] == 0
    assert m['wideep_rank_moe_nodes_per_token_max_step{dp_rank="0"}'] == 2
    assert m['wideep_rank_moe_nodes_per_token_max_step{dp_rank="1"}'] == 0
    assert m['wideep_rank_moe_intra_node_bytes_total{dp_rank="0"}'] == 300
    assert m['wideep_rank_moe_inter_node_bytes_total{dp_rank="0"}'] == 200
