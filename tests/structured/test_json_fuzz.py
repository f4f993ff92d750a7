"""Every structured JSON output parses strictly and validates, whatever xgrammar's quirks: generated schemas
(tests/structured/schema_fuzz.py) sent through the official `openai` client at temperature 1 on random weights,
as response_format json_schema (free whitespace), vLLM's structured_outputs json (compact) and json_object, on
chat and completions. Every output that ends ("stop") must pass Python's strict json.loads (no raw control
character in a string) and jsonschema with format checks; schemas whose length bounds xgrammar would ignore
must be a 400 instead. Size: FUZZ_SCHEMAS schemas x 2 samples, plus json_object and the refused ones."""
from __future__ import annotations

import asyncio
import datetime
import json
import random

import pytest

from tests.launch.test_structured_server import serve
from tests.structured.schema_fuzz import top_schema
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from wideep.structured.json_strings import length_conflicts

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
FUZZ_SCHEMAS = 200
MSGS = [{"role": "user", "content": "Answer in JSON."}]

FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(v) -> bool:   # jsonschema checks it only with rfc3339-validator installed
    return not isinstance(v, str) or bool(datetime.datetime.fromisoformat(v))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("fuzz")), arch="v3", seed=3, initializer_range=0.3,
                                max_position_embeddings=2048)


def check(text: str, schema: dict | None) -> None:
    value = json.loads(text)                     # strict: a raw control character in a string is an error
    if schema is None:
        assert isinstance(value, dict), text
    else:
        jsonschema.validate(value, schema, format_checker=FORMATS)


async def ask(client, i: int, schema: dict | None) -> list[tuple[str, str]]:
    """-> (finish_reason, text) per sample; the request shape rotates with i."""
    common = dict(model="tiny", n=2, temperature=1.0, seed=i, max_tokens=256)
    if schema is None:
        r = await client.chat.completions.create(messages=MSGS, response_format={"type": "json_object"}, **common)
        return [(c.finish_reason, c.message.content) for c in r.choices]
    shape = i % 3
    if shape == 0:
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        r = await client.chat.completions.create(messages=MSGS, response_format=rf, **common)
        return [(c.finish_reason, c.message.content) for c in r.choices]
    body = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    if shape == 1:
        r = await client.chat.completions.create(messages=MSGS, extra_body=body, **common)
        return [(c.finish_reason, c.message.content) for c in r.choices]
    r = await client.completions.create(prompt=f"record {i}:", extra_body=body, **common)
    return [(c.finish_reason, c.text) for c in r.choices]


def test_every_json_output_parses_and_validates(model_dir):
    rng = random.Random(2024)
    schemas = [top_schema(rng) for _ in range(FUZZ_SCHEMAS)] + [None] * 6      # None: json_object
    conflicts = [s for s in (top_schema(rng, conflict=True) for _ in range(200)) if length_conflicts(s)][:6]
    results = {}

    async def fn(client):
        outs = await asyncio.gather(*(ask(client, i, s) for i, s in enumerate(schemas)))
        results["outs"] = outs
        for s in conflicts:
            with pytest.raises(openai.BadRequestError, match="minLength/maxLength and a pattern or format"):
                await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, extra_body={
                    "structured_outputs": {"json": s}})
    serve(model_dir, fn)
    done, bad = 0, []
    for schema, outs in zip(schemas, results["outs"]):
        for reason, text in outs:
            if reason != "stop":
                continue
            done += 1
            try:
                check(text, schema)
            except (ValueError, jsonschema.ValidationError, AssertionError) as e:
                bad.append((text, schema, str(e)[:200]))
    total = 2 * len(schemas)
    assert not bad, bad[:3]
    assert done >= 0.9 * total, f"only {done} of {total} outputs ended: the test would check too little"
    assert len(conflicts) == 6
