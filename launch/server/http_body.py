"""What every HTTP handler of `wideep serve` shares (launch/server/app.py, launch/server/chat_http.py): reading a
JSON body, the OpenAI error shape, server-sent-event lines."""
from __future__ import annotations

import json

from aiohttp import web

from .json_text import lone_surrogate, surrogate_message
from .errors import BadRequest


def _error(status: int, message: str, headers: dict | None = None, extra: dict | None = None) -> web.Response:
    """extra: fields beside "error" (/health's state, for a probe that reads more than the status)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}, **(extra or {})},
                             status=status, headers=headers)


def _no_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")  # Python's json reads NaN/Infinity; JSON has no such values


def _content_type_ok(request: web.Request) -> bool:
    """application/json and */*+json; also no Content-Type and `curl -d`'s default
    (application/x-www-form-urlencoded): the body is read as JSON either way."""
    if "Content-Type" not in request.headers:
        return True
    ct = request.content_type
    return ct in ("application/json", "application/x-www-form-urlencoded") or ct.endswith("+json")


async def read_json(request: web.Request):
    """The request body as JSON (any value; the endpoint checks its shape). BadRequest: 415 for a
    non-JSON Content-Type, 400 for bytes that are not UTF-8 JSON or text no tokenizer can take."""
    if not _content_type_ok(request):
        raise BadRequest(f"Content-Type {request.content_type!r} is not supported; send application/json", 415)
    try:
        text = (await request.read()).decode("utf-8")  # JSON is UTF-8 (json.loads(bytes) would guess UTF-16/32)
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: not UTF-8 ({e})") from None
    try:
        body = json.loads(text, parse_constant=_no_json_constant)
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an int too long to convert
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    field = lone_surrogate(body)
    if field is not None:
        raise BadRequest(surrogate_message(field))
    return body


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()
