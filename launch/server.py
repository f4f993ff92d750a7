"""`wideep serve --config x.toml`: an OpenAI-compatible HTTP server (aiohttp) on rank 0; every other
rank follows rank 0's steps in engine.run_worker_loop() until rank 0 calls engine.shutdown().

    POST /v1/completions   OpenAI completions, stream true (SSE `data: {...}` chunks, `data: [DONE]`) | false
    POST /v1/chat/completions  OpenAI chat (launch/chat_http.py: template, reasoning, tool calls)
    GET  /v1/models        the served model
    GET  /health           200 while the engine serves, 503 once it has stopped
    GET  /metrics          Prometheus text (launch/prometheus.py)

Every error is JSON {"error": {"message", "type", "code"}}: bad input 400 (404 an unknown model or
path, 405 a wrong method, 413 a body over 1 MiB, 415 a non-JSON Content-Type), and the server goes on
serving. With an API key ([server] api_key, --api-key, WIDEEP_API_KEY), /v1/* (and /metrics with
protect_metrics) answer 401 unless the request sends `Authorization: Bearer KEY`; /health stays open
for load balancers. A client that disconnects aborts its request (handler_cancellation, plus failed
writes). SIGINT/SIGTERM to rank 0: stop accepting, abort in-flight requests, engine.shutdown()
(releases the workers, which ignore these signals so that a launcher signalling every rank stops
them cleanly).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import sys
import traceback

from aiohttp import web

from engine.front.async_engine import AsyncEngine, EngineDeadError

from . import chat_http, prometheus
from .openai_api import BadRequest, Completion, parse_completion

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def _no_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")  # Python's json reads NaN/Infinity; JSON has no such values


def _content_type_ok(request: web.Request) -> bool:
    """application/json and */*+json; also no Content-Type and `curl -d`'s default
    (application/x-www-form-urlencoded): the body is read as JSON either way."""
    if "Content-Type" not in request.headers:
        return True
    ct = request.content_type
    return ct in ("application/json", "application/x-www-form-urlencoded") or ct.endswith("+json")


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class Server:
    """The aiohttp handlers over one AsyncEngine. model_name is what clients pass as `model` (aliases:
    other names accepted for it); api_key: required on /v1/* (and /metrics when protect_metrics)."""

    def __init__(self, aengine: AsyncEngine, model_name: str, api_key: str | None = None,
                 protect_metrics: bool = False, aliases: tuple[str, ...] = (), chat: dict | None = None):
        self.aengine, self.model_name, self.aliases = aengine, model_name, aliases
        self.chat = chat_http.make_handler(self, **(chat or {}))
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self.protect_metrics = protect_metrics
        tok = aengine.engine.core.tokenizer
        self.decode = (lambda t: tok.decode([t])) if tok is not None else None

    def _needs_key(self, path: str) -> bool:
        return self._key is not None and (path.startswith("/v1/") or (self.protect_metrics and path == "/metrics"))

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """API key check, and every error answered as JSON (aiohttp's own 404/405/413 are text)."""
        if self._needs_key(request.path):
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, self._key):  # constant time: no timing oracle on the key
                return _error(401, "missing or invalid API key: send the header `Authorization: Bearer <key>`",
                              headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            generic = not e.text or e.text.startswith(f"{e.status}: ")  # aiohttp's "404: Not Found"
            message = f"{e.reason}: {request.method} {request.path}" if generic else e.text
            return _error(e.status, message, headers={k: v for k, v in e.headers.items() if k == "Allow"})
        except ConnectionError:  # the client went away mid-response: nobody to answer
            raise
        except Exception:  # a bug, not bad input: log it, answer 500, keep serving
            traceback.print_exc()
            return _error(500, "internal server error (logged on the server)")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat), web.get("/v1/models", self.models),
                        web.get("/health", self.health), web.get("/metrics", self.metrics)])
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.aengine.is_running:
            return web.json_response({"status": "ok"})
        return _error(503, "engine is not running")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "wideep"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            m = await self.aengine.metrics()
        except EngineDeadError as e:
            return _error(503, str(e))
        return web.Response(body=prometheus.render(m).encode(), headers={"Content-Type": prometheus.CONTENT_TYPE})

    async def read_json(self, request: web.Request):
        """-> the decoded JSON body, or the error Response to answer (415, 400)."""
        if not _content_type_ok(request):
            return _error(415, f"Content-Type {request.content_type!r} is not supported; send application/json")
        try:
            text = (await request.read()).decode("utf-8")  # JSON is UTF-8 (json.loads(bytes) would guess UTF-16/32)
        except UnicodeDecodeError as e:
            return _error(400, f"request body is not valid JSON: not UTF-8 ({e})")
        try:
            return json.loads(text, parse_constant=_no_json_constant)
        except ValueError as e:  # JSONDecodeError, NaN/Infinity, an int too long to convert
            return _error(400, f"request body is not valid JSON: {e}")
        except RecursionError:
            return _error(400, "request body is not valid JSON: nested too deeply")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_json(request)
        if isinstance(body, web.Response):
            return body
        try:
            prompt, params, stream, include_usage = parse_completion(body, self.model_name, self.aliases)
        except BadRequest as e:
            return _error(e.status, str(e))
        comp = Completion(self.model_name, self.decode)
        gen = self.aengine.generate(prompt, params, request_id=comp.id)
        try:
            # The first output proves the engine accepted the request, so bad input (a prompt too long
            # for the context, a token id outside the vocab) is still a 400, not a broken 200 stream.
            try:
                first = await gen.__anext__()
            except ValueError as e:
                return _error(400, str(e))
            except EngineDeadError as e:
                return _error(503, str(e))
            if not stream:
                out = first
                async for out in gen:
                    pass
                return web.json_response(comp.response(out))
            return await self._stream(request, comp, gen, first, include_usage)
        finally:
            await gen.aclose()  # not finished (disconnect, failed write): aborts the request

    async def _stream(self, request, comp: Completion, gen, out, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = 0
        try:
            while True:
                n += len(out.outputs[0].token_ids)
                await resp.write(_sse(comp.chunk(out)))
                if out.finished:
                    break
                out = await gen.__anext__()
        except EngineDeadError as e:  # the 200 is already sent: report in-band, then end the stream
            await resp.write(_sse({"error": {"message": str(e), "type": "server_error", "code": 503}}))
        if include_usage:
            await resp.write(_sse(comp.usage_chunk(len(out.prompt_token_ids), n)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def serve_front(engine, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, model_name: str | None = None,
                      api_key: str | None = None, protect_metrics: bool = False, under_torchrun: bool = False,
                      chat: dict | None = None) -> int:
    """Rank 0: serve until SIGINT/SIGTERM or until the engine stops by itself. -> exit status."""
    aengine = AsyncEngine(engine)
    # Unnamed, the model is its directory's name, and the path as given is accepted too (what clients
    # of `vllm serve PATH` send).
    aliases = () if model_name else (engine.core.model_dir,)
    model_name = model_name or os.path.basename(os.path.normpath(engine.core.model_dir))
    server = Server(aengine, model_name, api_key, protect_metrics, aliases, chat)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        aengine.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the line below: whoever reads it may signal at once
        loop.add_signal_handler(sig, stop.set)
    addr = runner.addresses[0]
    # torchrun answers its own SIGINT (Ctrl-C) with a SignalException traceback and exit 1 even when
    # every rank stopped cleanly; a signal to rank 0 alone stops every rank and torchrun exits 0.
    how = f"kill -INT {os.getpid()} stops every rank" if under_torchrun else "Ctrl-C stops"
    print(f"wideep serve: model {model_name!r} on http://{addr[0]}:{addr[1]} "
          f"({engine.job_ctx.world_size} rank(s); rank 0 is pid {os.getpid()}); {how}"
          f"{'; API key required' if api_key else ''}", flush=True)
    while not stop.is_set() and aengine.is_running:  # also leave when the engine thread died
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass
    died = not stop.is_set()
    await site.stop()            # no new connections
    await aengine.shutdown()     # in-flight requests end with finish_reason "abort"; workers released
    await runner.cleanup()
    err = aengine.error
    print(f"wideep serve: stopped{f' ({err!r})' if err else ''}", file=sys.stderr if died else sys.stdout,
          flush=True)
    return 1 if died or err else 0


def serve(cfg: dict) -> int:
    """Every rank: build the Engine from the run config; rank 0 serves HTTP, the others follow it."""
    from engine.front.engine import Engine
    from parallel import launch_rank

    from . import run_config
    if launch_rank() != 0:
        # torchrun and Ctrl-C signal every rank at once. A worker that died first would leave rank 0's
        # graceful shutdown waiting for a lost rank; instead workers leave when rank 0 shuts down
        # (or, if rank 0 dies, when the watchdog says so). Set before the model loads: rank 0 may
        # serve, and be signalled, while a slower worker is still loading.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    kwargs = run_config.llm_kwargs(cfg)
    if kwargs.get("disagg") is not None:  # prefill/decode pools: rank 0 (the front) is a decode rank
        from disagg import make_engine
        engine = make_engine(**kwargs)
    else:
        engine = Engine(**kwargs)
    if not engine.is_front:
        engine.run_worker_loop()
        return 0
    s = cfg.get("server", {})
    return asyncio.run(serve_front(engine, s.get("host", DEFAULT_HOST), s.get("port", DEFAULT_PORT),
                                   s.get("model_name"), s.get("api_key"), s.get("protect_metrics", False),
                                   under_torchrun="TORCHELASTIC_RUN_ID" in os.environ,
                                   chat={k: s[k] for k in chat_http.OPTIONS if k in s}))
