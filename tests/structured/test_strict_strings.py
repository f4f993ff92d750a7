"""structured/json_strings.py and the grammar that starts after the reasoning, on xgrammar directly (no model):
a length-bounded string is strict JSON (xgrammar 0.2.9 alone admits raw control characters there), length bounds
xgrammar would ignore are refused, a DSML tool-call structural tag compiles (and is refused by llguidance), and a
SequenceGrammar with after_token is free until that token, then the grammar's."""
from __future__ import annotations

import json

import pytest
import torch

from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from wideep.structured.backend import allocate
from wideep.structured.json_strings import length_conflicts, strict_strings
from wideep.structured.params import StructuredOutputsParams
from wideep.structured.rows import SequenceGrammar
from wideep.structured.tool_call_tags import tool_call_tag

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from tokenizers import Tokenizer

    from wideep.structured.xgrammar_backend import XGrammarBackend
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tok")), arch="v3")
    return XGrammarBackend(Tokenizer.from_file(f"{d}/tokenizer.json"), 256)


def accepts(backend, spec: StructuredOutputsParams, text: str) -> bool:
    m = xgr.GrammarMatcher(backend.compile(spec), terminate_without_stop_token=True)
    return m.accept_string(text) and m.is_terminated()


BOUNDED = {"type": "string", "minLength": 1, "maxLength": 4}


@pytest.mark.parametrize("text,ok", [('"ab"', True), ('"a\x07b"', False), ('"a\x1f"', False), ('"\x00"', False),
                                     ('"a\\u0007"', True), ('"a\\"b"', True), ('"\\\\"', True), ('"abcd"', True),
                                     ('"abcde"', False), ('""', False), ('"\\ud83d"', False), ('"é\\n"', True)])
def test_length_bounded_strings_are_strict_json(backend, text, ok):
    """What the grammar takes is what a strict parser takes and the bounds allow (escapes count one character;
    a surrogate-half escape, which would not, is refused)."""
    assert accepts(backend, StructuredOutputsParams(json=BOUNDED), text) is ok
    if ok:
        assert 1 <= len(json.loads(text)) <= 4


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 1}, {"type": "string", "minLength": 1, "maxLength": 1},
                                    {"anyOf": [{"type": "string", "maxLength": 1}, {"type": "integer"}]}])
def test_the_shortest_bounds_too(backend, schema):
    """xgrammar writes the class inline for the shortest bounds (found by the fuzz test)."""
    spec = StructuredOutputsParams(json=schema)
    assert not accepts(backend, spec, '"\x1c"') and accepts(backend, spec, '"\\u001c"') and accepts(backend, spec, '"a"')


def accepts_bytes(backend, spec: StructuredOutputsParams, data: bytes) -> bool:
    """Fed one byte token at a time (the tiny tokenizer has one per byte): bytes that are no UTF-8 too."""
    byte = {v[0]: i for i, v in enumerate(backend.info.decoded_vocab) if len(v) == 1}
    m = xgr.GrammarMatcher(backend.compile(spec), terminate_without_stop_token=True)
    return all(m.accept_token(byte[b]) for b in data) and m.is_terminated()


def test_no_surrogate_bytes_in_bounded_strings(backend):
    """A surrogate's three UTF-8 bytes would decode to three U+FFFD: one character in the grammar, three in the
    text. Refused in length-bounded JSON strings and DSML raw parameters; real characters of any width taken."""
    spec = StructuredOutputsParams(json={"type": "string", "maxLength": 2})
    assert not accepts_bytes(backend, spec, b'"\xed\xa0\x80"')
    assert accepts_bytes(backend, spec, '"日😀"'.encode())
    tag = tool_call_tag("tool_calls", TOOLS, "get_weather")
    assert not accepts_bytes(backend, tag, CALL.replace("Paris", "\ud800").encode("utf-8", "surrogatepass"))
    assert accepts_bytes(backend, tag, CALL.replace("Paris", "日😀").encode())


def test_xgrammar_alone_admits_control_characters():
    """The quirk worked around (if xgrammar fixes it, strict_strings has nothing to rewrite and this says so)."""
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps({"type": "object", "properties": {
        "a": BOUNDED, "b": {"type": "array", "items": {"type": "string", "maxLength": 2}}}})))
    fixed, n = strict_strings(ebnf)
    assert n == 2 and "wideep_json_escape ::=" in fixed
    assert strict_strings(str(xgr.Grammar.from_json_schema('{"type": "string"}'))) == (
        str(xgr.Grammar.from_json_schema('{"type": "string"}')), 0)


def test_length_bounds_xgrammar_would_ignore_are_refused(backend):
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
                                               "b": {"type": "array", "items": {"type": "string", "format": "date",
                                                                                "minLength": 1}}}}
    assert length_conflicts(schema) == ["schema.properties.a", "schema.properties.b.items"]
    assert length_conflicts({"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 2}}}) == []
    with pytest.raises(ValueError, match=r"structured_outputs.json does not compile: schema.properties.a: .*pattern"):
        backend.compile(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("fmt,good,bad", [
    ("date", ["2024-02-29", "2000-02-29", "0001-01-01", "2023-04-30"], ["2023-02-29", "1900-02-29", "2024-04-31",
                                                                      "0000-01-01", "2024-13-01"]),
    ("ipv4", ["1.2.3.4", "255.0.10.199"], ["01.2.3.4", "256.1.1.1", "1.2.3"]),
    ("date-time", ["2024-02-29T23:59:59Z", "2024-01-01T00:00:00.123456-05:30"],
     ["2024-01-01T00:00:001Z", "2024-01-01T24:00:00Z", "2024-04-31T00:00:00Z"])])
def test_formats_take_exactly_the_valid_values(backend, fmt, good, bad):
    spec = StructuredOutputsParams(json={"type": "string", "format": fmt})
    for v in good:
        assert accepts(backend, spec, json.dumps(v)), v
    for v in bad:
        assert not accepts(backend, spec, json.dumps(v)), v


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_optional_groups_with_a_repetition(backend, kind):
    """xgrammar alone takes "a00Z" for a schema's pattern a(x[0-9]{1,3})?Z (the group's start dropped); its bare
    regex path does not."""
    pattern = "^a(x[0-9]{1,3})?Z$"
    spec = StructuredOutputsParams(json={"type": "string", "pattern": pattern}) if kind == "json" else \
        StructuredOutputsParams(regex=pattern[1:-1])
    text = (lambda s: json.dumps(s)) if kind == "json" else (lambda s: s)
    assert accepts(backend, spec, text("ax12Z")) and accepts(backend, spec, text("aZ"))
    assert not accepts(backend, spec, text("a00Z")) and not accepts(backend, spec, text("a0Z"))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city"]}}}, {"type": "function", "function": {"name": "now"}}]
CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
        'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
NOW = '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n'


def test_dsml_tool_call_tags(backend):
    named = tool_call_tag("tool_calls", TOOLS, "get_weather")
    assert accepts(backend, named, CALL)
    assert not accepts(backend, named, CALL.replace("Paris", "Paris, France"))   # maxLength 8
    assert not accepts(backend, named, CALL.replace(">2<", ">two<"))             # an integer
    assert not accepts(backend, named, CALL.replace("tool_calls", "function_calls"))
    two = CALL.replace("</｜DSML｜tool_calls>", NOW + "</｜DSML｜tool_calls>")
    assert accepts(backend, tool_call_tag("tool_calls", TOOLS, "required"), two)
    assert not accepts(backend, tool_call_tag("tool_calls", TOOLS, "required", parallel=False), two)
    assert accepts(backend, tool_call_tag("function_calls", TOOLS, "get_weather"),
                   CALL.replace("tool_calls", "function_calls"))


def test_guidance_refuses_structural_tags(tmp_path):
    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    from wideep.structured.guidance_backend import GuidanceBackend
    d = make_tiny_checkpoint(str(tmp_path), arch="v3")
    g = GuidanceBackend(Tokenizer.from_file(f"{d}/tokenizer.json"), 256)
    with pytest.raises(ValueError, match="structural_tag is not supported by --structured-outputs-backend guidance"):
        g.compile(tool_call_tag("tool_calls", TOOLS, "required"))


def test_after_token_leaves_the_output_free_until_it(backend):
    """The grammar (an enum) starts after token 7: before it anything goes and drafts are free; from it the
    grammar's tokens, and drafts are checked from there."""
    spec = StructuredOutputsParams(json={"enum": ["ab"]}, after_token=7)
    assert spec.key == StructuredOutputsParams(json={"enum": ["ab"]}).key   # the same compiled grammar
    compiled = backend.compile(spec)
    ids = {c: backend.info.decoded_vocab.index(c.encode()) for c in '"ab'}
    g = SequenceGrammar(backend.matcher(compiled, [1]), spec.after_token)
    draft = [ids["a"], 7, ids['"'], ids["b"]]
    assert g.valid_prefix(draft) == 3          # "a" free, 7 starts it, '"' allowed, "b" is not
    mask = allocate(5, 256)
    g.fill_drafts(draft[:3], backend, mask)
    assert (mask[:2] == -1).all()              # free before 7 (and right after "a")
    assert mask[2].ne(-1).any()                # after 7: the grammar's first token only
    for t in (ids["b"], 3, 7):
        g.accept(t)
        assert g.waiting == (t != 7) and g.finish is None
    for t in (ids['"'], ids["a"], ids["b"], ids['"']):
        g.accept(t)
    assert g.finish is None and not g.waiting
    g.accept(1)   # EOS where the grammar may end
    assert g.finish == "stop"
    with pytest.raises(ValueError, match="after_token"):
        StructuredOutputsParams(json={}, after_token="7")
    with pytest.raises(ValueError, match="unknown fields"):
        StructuredOutputsParams.of({"json": {}, "after_token": 3})   # not a request field


def test_bitmask_rows_only_for_started_grammars(backend):
    from types import SimpleNamespace

    from wideep.structured.rows import GrammarRows
    spec = StructuredOutputsParams(json={"enum": ["ab"]}, after_token=7)
    rows = GrammarRows(SimpleNamespace(backend=backend, vocab_size=256, get=backend.compile))
    seqs = [SimpleNamespace(grammar=None, params=SimpleNamespace(structured_outputs=spec, ignore_eos=False,
                                                                 stop_token_ids=[]),
                            eos_token_ids=(1,), output_token_ids=out) for out in ([], [5, 7])]
    plan = rows.plan(seqs, [0, 1])
    assert plan.masked == [1] and plan.bitmask.shape[0] == 1
    logits = torch.zeros(2, 256)
    rows.apply(logits, plan)
    assert torch.isfinite(logits[0]).all() and torch.isinf(logits[1]).sum() > 200
