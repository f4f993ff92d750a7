"""CORS for browser clients (off unless `--allowed-origins` / [server] allowed_origins names some).

A request whose Origin is allowed gets `Access-Control-Allow-Origin` (added in on_response_prepare,
so streamed responses carry it too); an OPTIONS preflight from such an origin is answered here,
before the API-key check (browsers send preflights without credentials). "*" allows any origin.
A preflight from any other origin is a 403; a plain request from one is served without the
header, so the browser withholds the response from the page (the browser's rule, as with vLLM's
CORS middleware).
"""
from __future__ import annotations

from aiohttp import web

METHODS = "GET, POST, OPTIONS"


class Cors:
    def __init__(self, origins: tuple[str, ...]):
        self.origins = frozenset(origins)

    def allowed(self, origin: str | None) -> str | None:
        """-> the Access-Control-Allow-Origin value for this Origin, or None."""
        if origin is None:
            return None
        if "*" in self.origins:
            return "*"
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin")
        allow = self.allowed(origin)
        if allow is None:
            msg = f"origin {origin!r} is not allowed (--allowed-origins)"
            return web.json_response({"error": {"message": msg, "type": "invalid_request_error", "code": 403}},
                                     status=403)
        headers = {"Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": "600",
                   "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*")}
        return web.Response(status=200, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        allow = self.allowed(request.headers.get("Origin"))
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
            if allow != "*":
                response.headers.add("Vary", "Origin")
