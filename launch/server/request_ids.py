"""Request ids from the `X-Request-Id` header (vLLM's convention): the id a request runs under in the
engine (and its response's `id`) is `<prefix>-<header>`, or `<prefix>-<uuid>` without one; a short
suffix keeps it unique while a request with an equal id is still in flight (the engine refuses a
duplicate). Every response echoes the header as sent, or else the id its request ran under.
"""
from __future__ import annotations

import uuid

from aiohttp import web

HEADER = "X-Request-Id"
# where a handler leaves the id its request ran under (typed keys exist from aiohttp 3.13)
_KEY = web.RequestKey("wideep_request_id", str) if hasattr(web, "RequestKey") else "wideep_request_id"


class RequestIds:
    def __init__(self):
        self._live: set[str] = set()   # ids in flight, held from assign() to release()

    def assign(self, request: web.Request, prefix: str) -> str:
        given = request.headers.get(HEADER)
        rid = f"{prefix}-{given}" if given else f"{prefix}-{uuid.uuid4().hex}"
        if rid in self._live:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        self._live.add(rid)
        request[_KEY] = rid
        return rid

    def release(self, rid: str) -> None:
        self._live.discard(rid)

    @staticmethod
    async def echo(request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: before the headers go out, streamed responses included."""
        rid = request.headers.get(HEADER) or request.get(_KEY)
        if rid:
            response.headers[HEADER] = rid
