"""The API key ([server] api_key, --api-key, WIDEEP_API_KEY: launch/cli/options.py resolve): /v1/* (and
/metrics with protect_metrics) answer 401 unless the request sends `Authorization: Bearer KEY`; /health
stays open for load balancers."""
from __future__ import annotations

import hmac

from aiohttp import web

from .http_body import _error


class ApiKey:
    def __init__(self, key: str, protect_metrics: bool = False):
        self._expected = f"Bearer {key}".encode()
        self.protect_metrics = protect_metrics

    def guards(self, path: str) -> bool:
        return (path.startswith("/v1/") or path == "/scale_elastic_ep"   # it changes the deployment
                or (self.protect_metrics and path == "/metrics"))

    def refusal(self, request: web.Request) -> web.Response | None:
        """-> the 401 to answer, or None: the request may pass."""
        if not self.guards(request.path):
            return None
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(got, self._expected):  # constant time: no timing oracle on the key
            return None
        return _error(401, "missing or invalid API key: send the header `Authorization: Bearer <key>`",
                      headers={"WWW-Authenticate": "Bearer"})
