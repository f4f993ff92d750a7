"""The OpenAI-compatible HTTP server (aiohttp) of `wideep serve`, on rank 0 (serve_front); every other
rank follows rank 0's steps in engine.run_worker_loop() until rank 0 calls engine.shutdown() (launch/cli/serve.py
builds the engine on every rank).

    POST /v1/completions   OpenAI completions (a prompt or a batch; n, stop, echo: launch/server/openai_api.py),
                           stream true (SSE `data: {...}` chunks, `data: [DONE]`) | false
    POST /v1/chat/completions  OpenAI chat (launch/server/chat_http.py: template, reasoning, tool calls)
    GET  /v1/models        the served names (vLLM's model cards: root, created, max_model_len)
    POST /tokenize         vLLM's: {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize       vLLM's: {"tokens"} -> {"prompt"}
    GET  /version          {"version": wideep's version}
    GET  /health           200 while the engine serves ({"status": "ok"}; "degraded" with the lost ranks named
                           once survivors of a loss serve), 503 naming the lost ranks while it cannot
                           (a re-forming, a loss that ends the job) and once it has stopped
    GET  /metrics          Prometheus text (launch/server/prometheus.py)
    POST /scale_elastic_ep vLLM's: {"new_data_parallel_size": N} resizes the running deployment
                           (launch/server/resize_api.py); GET /is_scaling_elastic_ep

Every error is JSON {"error": {"message", "type", "code"}}: bad input 400 (404 an unknown model or
path, 405 a wrong method, 413 a body over 1 MiB, 415 a non-JSON Content-Type), and the server goes on
serving. With an API key ([server] api_key, --api-key, WIDEEP_API_KEY; launch/server/api_key.py), /v1/*
(and /metrics with protect_metrics) answer 401 unless the request sends `Authorization: Bearer KEY`;
/health stays open for load balancers. A client that disconnects aborts its request (handler_cancellation, plus failed
writes). SIGINT/SIGTERM to rank 0: stop accepting, abort in-flight requests, engine.shutdown()
(releases the workers, which ignore these signals so that a launcher signalling every rank stops
them cleanly). A request's `X-Request-Id` header becomes its id and is echoed (launch/server/request_ids.py);
CORS is off unless allowed_origins names origins (launch/server/cors.py).
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import traceback

from aiohttp import web

from wideep.engine.front.async_engine import AsyncEngine, EngineDeadError
from wideep.engine.front.health import message as health_message
from wideep.engine.generation_defaults import generation_defaults
from wideep.parallel.reform import origin_of

from . import chat_http, prometheus, resize_api, tokenize_api
from .api_key import ApiKey
from .cors import Cors
from .http_body import _error, _sse, read_json
from .openai_api import BadRequest, Completion, cached_tokens, parse_completion
from .request_ids import RequestIds

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
HEALTH_TIMEOUT_S = 5.0   # the engine thread answers between steps (milliseconds); longer means it is stuck



class Server:
    """The aiohttp handlers over one AsyncEngine. model_name is what clients pass as `model` and what
    responses report (aliases: other names accepted for it, listed in /v1/models too; unlisted:
    accepted, not listed); api_key: required on /v1/* (and /metrics when protect_metrics);
    allowed_origins: CORS (none: off)."""

    def __init__(self, aengine: AsyncEngine, model_name: str, api_key: str | None = None,
                 protect_metrics: bool = False, aliases: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = (), unlisted: tuple[str, ...] = (),
                 chat: dict | None = None):
        self.aengine, self.model_name, self.aliases = aengine, model_name, (*aliases, *unlisted)
        self.listed = (model_name, *aliases)
        self.api_key = ApiKey(api_key, protect_metrics) if api_key else None
        self.cors = Cors(tuple(allowed_origins)) if allowed_origins else None
        core = aengine.engine.core
        self.tokenizer, self.root, self.max_model_len = core.tokenizer, core.model_dir, core.max_model_len
        self.created = int(time.time())
        self.request_ids = RequestIds()
        tok = self.tokenizer
        self.decode = (lambda t: tok.decode([t])) if tok is not None else None
        # the checkpoint's generation_config.json sampling defaults, for fields a request leaves out
        self.defaults = generation_defaults(core.model_dir)
        self.decode_ids = tok.decode if tok is not None else None
        self.chat = chat_http.make_handler(self, **(chat or {}))

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """API key check, and every error answered as JSON (aiohttp's own 404/405/413 are text)."""
        refused = self.api_key.refusal(request) if self.api_key else None
        if refused is not None:
            return refused
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
        # CORS first: a browser's preflight carries no API key
        app = web.Application(middlewares=[self.cors.preflight, self._guard] if self.cors else [self._guard])
        app.add_routes([web.post("/v1/completions", self.completions), web.get("/v1/models", self.models),
                        web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                        web.get("/version", self.version), web.post("/v1/chat/completions", self.chat),
                        web.get("/health", self.health), web.get("/metrics", self.metrics),
                        *resize_api.routes(self.aengine)])
        app.on_response_prepare.append(self.request_ids.echo)
        if self.cors:
            app.on_response_prepare.append(self.cors.on_prepare)
        return app

    def _model(self, body) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model != self.model_name and model not in self.aliases:
            raise BadRequest(f"model {model!r} does not exist; this server serves {self.model_name!r}", status=404)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, lambda b: tokenize_api.tokenize(b, self.tokenizer,
                                                                                   self.max_model_len,
                                                                                   self.chat.messages_ids))

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, lambda b: tokenize_api.detokenize(b, self.tokenizer))

    async def _tokenizer_call(self, request: web.Request, fn) -> web.Response:
        try:
            body = await read_json(request)
            self._model(body)
            if self.tokenizer is None:
                raise BadRequest(f"{self.root!r} has no tokenizer.json: nothing to (de)tokenize with")
            return web.json_response(fn(body))
        except BadRequest as e:
            return _error(e.status, str(e))

    async def version(self, request: web.Request) -> web.Response:
        from wideep import __version__   # the facade sits above launch/: imported when asked
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.Response:
        """200 {"status": "ok"} while every rank serves; 200 {"status": "degraded", "lost_ranks", ...} once
        the survivors of a loss serve (on_rank_loss = "continue"); 503 naming the lost ranks while the
        deployment cannot serve (engine/front/health.py), and 503 once the engine stopped."""
        try:
            if not self.aengine.is_running:
                raise EngineDeadError("engine is not running")
            h = await asyncio.wait_for(self.aengine.health(), HEALTH_TIMEOUT_S)
        except EngineDeadError as e:
            err = self.aengine.error
            lost = getattr(err, "ranks", None)   # RankLostError: the job's ranks, origin-numbered below
            body = {"status": "stopped", "serving": False}
            if lost:
                body["lost_ranks"] = sorted(origin_of(self.aengine.engine.job_ctx, r) for r in lost)
            return _error(503, f"engine is not running: {err}" if err else str(e), extra=body)
        except asyncio.TimeoutError:
            return _error(503, f"the engine did not answer within {HEALTH_TIMEOUT_S:g} s", extra={"serving": False})
        if not h["serving"]:
            return _error(503, health_message(h), extra=h)
        return web.json_response({"status": "ok"} if h["status"] == "ok" else h)

    async def models(self, request: web.Request) -> web.Response:
        """vLLM's model cards, one per served name (`vllm bench serve` reads root)."""
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "wideep", "root": self.root,
                  "parent": None, "max_model_len": self.max_model_len, "permission": []}
                 for name in self.listed]
        return web.json_response({"object": "list", "data": cards})

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            m = await self.aengine.metrics()
        except EngineDeadError as e:
            return _error(503, str(e))
        return web.Response(body=prometheus.render(m).encode(), headers={"Content-Type": prometheus.CONTENT_TYPE})

    async def read_json(self, request: web.Request):
        """-> the decoded JSON body, or the error Response to answer (415, 400): the chat handler's form."""
        try:
            return await read_json(request)
        except BadRequest as e:
            return _error(e.status, str(e))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            req = parse_completion(body, self.model_name, self.aliases, self.defaults)
        except BadRequest as e:
            return _error(e.status, str(e))
        comp = Completion(self.model_name, self.decode, self.decode_ids, req.params.n, req.echo, req.drop_output)
        comp.id = self.request_ids.assign(request, "cmpl")
        one = len(req.prompts) == 1
        gens = [self.aengine.generate(p, req.params, request_id=comp.id if one else f"{comp.id}-{i}")
                for i, p in enumerate(req.prompts)]
        try:
            # The first outputs prove the engine accepted every prompt, so bad input (a prompt too long
            # for the context, a token id outside the vocab) is still a 400, not a broken 200 stream.
            firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
            for e in firsts:
                if isinstance(e, ValueError):
                    return _error(400, str(e) if one else f"prompt {firsts.index(e)}: {e}")
                if isinstance(e, EngineDeadError):
                    return _error(503, str(e))
                if isinstance(e, BaseException):
                    raise e
            if not req.stream:
                outs = await asyncio.gather(*(_last(g, f) for g, f in zip(gens, firsts)))
                return web.json_response(comp.response(outs))
            return await self._stream(request, comp, gens, firsts, req.include_usage)
        finally:
            for g in gens:
                await g.aclose()  # not finished (disconnect, failed write, a sibling's error): aborts it
            self.request_ids.release(comp.id)

    async def _stream(self, request, comp: Completion, gens: list, firsts: list,
                      include_usage: bool) -> web.StreamResponse:
        """Every prompt's deltas as they come, one chunk per delta (its choices name their index)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen, out):
            try:
                while True:
                    q.put_nowait((i, out))
                    if out.finished:
                        return
                    out = await gen.__anext__()
            except Exception as e:   # EngineDeadError, or a bug: the writer below must not wait forever
                q.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts))]
        prompt_tokens, completion_tokens, cached, live = 0, 0, 0, len(gens)
        try:
            while live:
                i, out = await q.get()
                if isinstance(out, EngineDeadError):  # the 200 is already sent: report in-band, then end
                    await resp.write(_sse({"error": {"message": str(out), "type": "server_error", "code": 503}}))
                    break
                if isinstance(out, Exception):
                    raise out
                completion_tokens += comp.completion_tokens(out)
                await resp.write(_sse(comp.chunk(out, i)))
                if out.finished:
                    live -= 1
                    prompt_tokens += len(out.prompt_token_ids)
                    cached += cached_tokens(out)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)   # before the caller closes the gens
        if include_usage:
            await resp.write(_sse(comp.usage_chunk(prompt_tokens, completion_tokens, cached)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _last(gen, out):
    async for out in gen:
        pass
    return out


async def serve_front(engine, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                      model_name: str | list[str] | None = None, api_key: str | None = None,
                      protect_metrics: bool = False, under_torchrun: bool = False,
                      allowed_origins: tuple[str, ...] = (), chat: dict | None = None) -> int:
    """Rank 0: serve until SIGINT/SIGTERM or until the engine stops by itself. -> exit status.
    model_name: one name or several (the first is what responses report; all are accepted)."""
    aengine = AsyncEngine(engine)
    names = [model_name] if isinstance(model_name, str) else list(model_name or ())
    # Unnamed, the model is its directory's name, and the path as given is accepted too (what clients
    # of `vllm serve PATH` send).
    unlisted = () if names else (engine.core.model_dir,)
    model_name = names[0] if names else os.path.basename(os.path.normpath(engine.core.model_dir))
    server = Server(aengine, model_name, api_key, protect_metrics, tuple(names[1:]), tuple(allowed_origins or ()),
                    unlisted, chat)
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
