"""Random JSON Schemas for the structured-outputs fuzz test (tests/structured/test_json_fuzz.py): strings with length
bounds, patterns, formats, enums and consts (with quotes, backslashes, control characters and non-ASCII inside),
bounded integers and numbers, booleans, nulls, nested arrays and objects, anyOf. Everything is bounded (so random
weights can finish an output), objects are closed (additionalProperties false). `conflict=True` also draws the
strings whose length bounds xgrammar would ignore (a pattern or format beside minLength/maxLength), which the
server must refuse."""
from __future__ import annotations

import random

FORMATS = ("date", "date-time", "email", "ipv4", "ipv6", "uuid")
WORDS = ("a", "Zo", 'q"t', "b\\s", "t\tab", "é", "日本", "x\u0007y", "")


def _string(rng: random.Random, conflict: bool) -> dict:
    kind = rng.choice(["len", "len", "len", "min_max", "pattern", "format", "enum", "const"])
    if kind == "len":
        return {"type": "string", "maxLength": rng.randint(1, 10)}
    if kind == "min_max":
        lo = rng.randint(0, 4)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "pattern":
        s = {"type": "string", "pattern": rng.choice(["^[a-z]{1,5}$", "^[A-Z][0-9]{2}$", "^(yes|no)$", "^\\w{2,4}$"])}
    elif kind == "format":
        s = {"type": "string", "format": rng.choice(FORMATS)}
    elif kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 3))}
    else:
        return {"const": rng.choice(WORDS)}
    if conflict and rng.random() < 0.3:
        s["maxLength"] = 8
    return s


def _leaf(rng: random.Random, conflict: bool) -> dict:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "null"])
    if kind == "string":
        return _string(rng, conflict)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    return {"type": kind}


def schema(rng: random.Random, depth: int = 0, conflict: bool = False) -> dict:
    kind = rng.choice(["object", "object", "array", "anyOf", "leaf"] if depth < 2 else ["leaf"])
    if kind == "leaf":
        return _leaf(rng, conflict)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": schema(rng, depth + 1, conflict), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [schema(rng, depth + 1, conflict) for _ in range(2)]}
    props = {f"p{i}": schema(rng, depth + 1, conflict) for i in range(rng.randint(1, 3))}
    return {"type": "object", "properties": props, "required": rng.sample(sorted(props), rng.randint(0, len(props))),
            "additionalProperties": False}


def top_schema(rng: random.Random, conflict: bool = False) -> dict:
    """An object at the top (response_format json_schema's usual shape)."""
    props = {f"k{i}": schema(rng, 1, conflict) for i in range(rng.randint(1, 3))}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
