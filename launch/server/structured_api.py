"""Structured outputs in the OpenAI bodies: which fields ask for them, and tool_choice "required" /
a named tool as constrained decoding.

Completions and chat: response_format {"type": "json_object"} | {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}} | {"type": "text"} (none), and vLLM's structured_outputs {"json" |
"regex" | "choice" | "grammar" | "json_object", "disable_any_whitespace"}; vLLM's older guided_json /
guided_regex / guided_choice / guided_grammar mean the same. At most one of them per request.

Chat tool_choice "required" or {"type": "function", "function": {"name"}}: with DeepSeek-V3.2's or V4's
encoding, the output is constrained to the model's own DSML call block for the allowed tools, arguments
matching their schemas (structured/tool_call_tags.py), and read by the same parser as unconstrained calls.
With a chat template, as vLLM does it generically: "required" constrains the output to a JSON array (at least
one item) of {"name": a tool's name, "parameters": that tool's parameters}; a named tool to that tool's
parameters object (launch/chat/json_calls.py reads them). Unlike vLLM, the call's JSON has no free
whitespace: the arguments are re-serialised for the client anyway, and whitespace would only spend tokens (a
model that wanders into it never closes the call). parallel_tool_calls false: one call.
"""
from __future__ import annotations

from wideep.structured.params import StructuredOutputsParams
from wideep.structured.tool_call_tags import NO_ARGUMENTS, tool_call_tag

from .errors import BadRequest

LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _spec(fields: dict, where: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.of(fields)
    except (ValueError, TypeError) as e:
        raise BadRequest(f"'{where}': {e}") from None


def _response_format(rf) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise BadRequest(f"'response_format' must be an object with a 'type', got {rf!r}"[:300])
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec({"json_object": True}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise BadRequest("'response_format.json_schema.schema' is required: a JSON Schema object")
        return _spec({"json": js["schema"]}, "response_format.json_schema")
    raise BadRequest(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")


def structured_of(body: dict) -> StructuredOutputsParams | None:
    """The request's one structured-outputs field -> its spec (None: none asked); BadRequest when bad or several."""
    given = [k for k in ("structured_outputs", *LEGACY) if body.get(k) is not None]
    rf = body.get("response_format")
    rf_spec = _response_format(rf) if rf is not None else None
    if rf_spec is not None:
        given.append("response_format")
    if len(given) > 1:
        raise BadRequest(f"only one of {given} may be given")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return rf_spec
    if name == "structured_outputs":
        so = body[name]
        if not isinstance(so, dict):
            raise BadRequest(f"'structured_outputs' must be an object, got {type(so).__name__}")
        return _spec(so, name)
    return _spec({LEGACY[name]: body[name]}, name)


# -- tool_choice --------------------------------------------------------------------------------------
def forced_tool(choice, tools: list | None) -> str | None:
    """tool_choice -> "required", a tool's name (a named tool), or None (auto / none / absent)."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        if not tools:
            raise BadRequest("'tool_choice' \"required\" needs 'tools'")
        return "required"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": str}}")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise BadRequest(f"'tool_choice' names the tool {name!r}, which is not in 'tools' ({names})")
        return name
    raise BadRequest(f"'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, got {choice!r}")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_ARGUMENTS


def tool_spec(tools: list, forced: str, call_block: str | None = None, parallel: bool = True
              ) -> StructuredOutputsParams:
    """What the output must match for tool_choice `forced` ("required" or a tool's name). call_block: the
    encoding's DSML block ("function_calls" | "tool_calls"; None: JSON)."""
    if call_block is not None:
        try:
            return tool_call_tag(call_block, tools, forced, parallel)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"'tools': {str(e).splitlines()[0]}") from None
    if forced != "required":
        tool = next(t for t in tools if t["function"]["name"] == forced)
        return _spec({"json": _parameters(tool), "disable_any_whitespace": True},
                     f"tools[{forced!r}].function.parameters")
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return _spec({"json": schema, "disable_any_whitespace": True}, "tools")
