"""vLLM's elastic-EP routes: resize the running deployment (engine/front/resize.py).

    POST /scale_elastic_ep {"new_data_parallel_size": N}
        200 {"message": "Scaled to N data parallel engines", "new_data_parallel_size": N,
             "old_data_parallel_size": M, "resize_s": ..., "requests_moved": ..., ...} once the new shape serves
        400 a bad or missing size, or a deployment that cannot resize as asked (the message says what to run
            instead); 409 a resize already running; 503 a grow whose new ranks could not join, or the engine
            stopped. Nothing changes on an error, and
            requests keep being served throughout.
    GET  /is_scaling_elastic_ep  {"is_scaling_elastic_ep": true | false}

Guarded by the API key when there is one (it changes the deployment).
"""
from __future__ import annotations

from aiohttp import web

from wideep.engine.front.async_engine import EngineDeadError
from wideep.engine.front.resize import ResizeConflict, ResizeError, ResizeFailed

from .http_body import _error, read_json
from .errors import BadRequest

FIELD = "new_data_parallel_size"


def routes(aengine) -> list:
    async def scale(request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as e:
            return _error(e.status, str(e))
        if not isinstance(body, dict) or FIELD not in body:
            return _error(400, f'the body must be a JSON object with "{FIELD}" (an integer >= 1), '
                               f'e.g. {{"{FIELD}": 2}}')
        try:
            result = await aengine.scale_elastic_ep(body[FIELD])
        except ResizeConflict as e:
            return _error(409, str(e))
        except ResizeError as e:
            return _error(400, str(e))
        except (EngineDeadError, ResizeFailed) as e:
            return _error(503, str(e))
        n = result["new_data_parallel_size"]
        return web.json_response({"message": f"Scaled to {n} data parallel engines", **result})

    async def scaling(request: web.Request) -> web.Response:
        return web.json_response({"is_scaling_elastic_ep": aengine.is_resizing})

    return [web.post("/scale_elastic_ep", scale), web.get("/is_scaling_elastic_ep", scaling)]
