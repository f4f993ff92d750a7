"""Structured outputs through the Python API on random weights: only the constraint can make the
output valid, so every finished output must parse and validate (jsonschema), match its regex or be
one of its choices, and finish "stop" within max_tokens. Also: bad specs fail at add_request naming
the problem; unconstrained rows in the same batch are untouched; EOS is allowed only where the
grammar may end; preemption (recompute) and n > 1 keep outputs valid and equal."""
from __future__ import annotations

import json
import re

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from wideep.structured.params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

# additionalProperties false, as OpenAI's strict mode asks: llguidance follows JSON Schema's default
# (other keys allowed), which random weights would fill until max_tokens
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                      "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["kind", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}}, "required": ["x", "y"],
                  "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["point", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 4},
]
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?"]
CHOICES = [["red", "green", "blue"], ["a long option", "b"]]
MAX = 160


def compact(schema: dict) -> dict:
    """JSON without free whitespace: greedy decoding of random weights would otherwise pick newlines."""
    return {"json": schema, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("so")), arch="v3", seed=3, initializer_range=0.3)


BACKENDS = ["xgrammar", pytest.param("guidance", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("llguidance") is None, reason="llguidance is not installed"))]


@pytest.fixture(scope="module", params=BACKENDS)
def llm(model_dir, request):
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=512, max_num_seqs=64,
              structured_outputs_backend=request.param)
    llm.backend = request.param
    yield llm
    llm.shutdown()


def specs() -> list[tuple[dict, object]]:
    """(structured_outputs, its checker) for every spec of the suite."""
    out = []
    for s in SCHEMAS:
        out.append(({"json": s, "disable_any_whitespace": True}, ("json", s)))
        out.append(({"json": json.dumps(s)}, ("json", s)))
    out += [({"regex": r}, ("regex", r)) for r in REGEXES]
    out += [({"choice": c}, ("choice", c)) for c in CHOICES]
    out.append(({"grammar": 'root ::= "(" digit+ ")" | "none"\ndigit ::= [0-9]'}, ("regex", r"\([0-9]+\)|none")))
    return out


def check(kind_arg, text: str) -> None:
    kind, arg = kind_arg
    if kind == "json":
        jsonschema.validate(json.loads(text), arg)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(arg, text), text
    else:
        assert text in arg, text


def test_hundreds_of_random_weight_outputs_all_valid(llm):
    suite = specs()
    prompts, params, checks = [], [], []
    for i in range(240):
        so, chk = suite[i % len(suite)]
        prompts.append(f"request {i}: answer")
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=MAX, structured_outputs=so))
        checks.append(chk)
    outs = llm.generate(prompts, params)
    bad = []
    for o, chk in zip(outs, checks):
        c = o.outputs[0]
        bad.extend([(c.finish_reason, c.text, chk)] if c.finish_reason != "stop" else [])
        try:
            check(chk, c.text)
        except Exception as e:
            bad.append(("invalid", c.text, chk, e))
    assert not bad, bad[:5]


def test_json_object_outputs_are_objects(llm):
    """Any-object mode bounds no string: on random weights some run out of tokens; those that end are objects."""
    outs = llm.generate(["obj"] * 12, [SamplingParams(seed=i, max_tokens=MAX, structured_outputs={"json_object": True})
                                       for i in range(12)])
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(done) >= 3
    for text in done:
        assert isinstance(json.loads(text), dict), text
    for o in outs:
        assert o.outputs[0].text.lstrip(" \t\r\n").startswith("{")


def test_unconstrained_rows_untouched_and_greedy_constrained_deterministic(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in range(3)]
    alone = [o.outputs[0].token_ids for o in llm.generate(["a", "bb", "ccc"], free)]
    cons = SamplingParams(temperature=0.0, max_tokens=MAX, structured_outputs=compact(SCHEMAS[0]))
    mixed = llm.generate(["a", "zz", "bb", "yy", "ccc"], [free[0], cons, free[1], cons, free[2]])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    again = llm.generate(["zz", "yy"], [cons, cons])
    assert [o.outputs[0].token_ids for o in again] == [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


def test_eos_only_where_the_grammar_may_end(llm, model_dir):
    """A bias that makes EOS the top token everywhere cannot end the output before the grammar allows."""
    eos = 1
    p = SamplingParams(temperature=0.0, max_tokens=40, logit_bias={eos: 100.0},
                       structured_outputs={"regex": "[a-z]{5}(!)?"})
    c = llm.generate(["x"], [p])[0].outputs[0]
    assert re.fullmatch("[a-z]{5}", c.text) and c.finish_reason == "stop" and c.token_ids[-1] == eos
    free = llm.generate(["x"], [SamplingParams(temperature=0.0, max_tokens=40, logit_bias={eos: 100.0})])[0]
    assert free.outputs[0].token_ids == [eos]   # the bias alone ends at once: the grammar held it back
    # ignore_eos: the grammar's end finishes the request itself
    c = llm.generate(["x"], [SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True,
                                            structured_outputs={"choice": ["alpha", "beta"]})])[0].outputs[0]
    assert c.text in ("alpha", "beta") and c.finish_reason == "stop"


def test_logprobs_are_of_the_constrained_distribution(llm):
    """As vLLM: the mask comes before the logprobs, so the top-N are allowed tokens whose
    probabilities add up to 1 where the grammar leaves two tokens."""
    import math
    p = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, structured_outputs={"choice": ["ab", "cd"]})
    c = llm.generate(["x"], [p])[0].outputs[0]
    assert c.text in ("ab", "cd")
    first = c.logprobs[0]
    allowed = {k: v for k, v in first.items() if v > float("-inf")}
    assert len(allowed) == 2 and math.isclose(sum(math.exp(v) for v in allowed.values()), 1.0, rel_tol=1e-5)
    assert c.cumulative_logprob <= 0


def test_n_samples_each_constrained(llm):
    p = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX, structured_outputs=compact(SCHEMAS[1]))
    out = llm.generate(["pets"], [p])[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS[1])
        assert c.finish_reason == "stop"


def test_preemption_recompute_keeps_the_matcher(model_dir):
    """A cache that forces preemptions: the recomputed sequences keep their matchers and give the
    same constrained outputs as an ample cache."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX, structured_outputs=compact(SCHEMAS[i % 3]))
              for i in range(8)]
    prompts = [f"prompt number {i} " * 3 for i in range(8)]
    big = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=256)
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    big.shutdown()
    small = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=24)
    for i, (pr, p) in enumerate(zip(prompts, params)):
        small.add_request(str(i), pr, p)
    got = {}
    while small.has_unfinished_requests():
        for o in small.step():
            if o.finished:
                got[int(o.request_id)] = o.outputs[0]
    assert small.core.scheduler.num_preemptions > 0
    small.shutdown()
    assert [got[i].token_ids for i in range(8)] == want
    for i in range(8):
        jsonschema.validate(json.loads(got[i].text), SCHEMAS[i % 3])


def test_stop_strings_and_streaming_with_a_constraint(llm, model_dir):
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=64, structured_outputs_backend=llm.backend)
    p = SamplingParams(temperature=0.0, max_tokens=MAX, output_kind="delta", structured_outputs=compact(SCHEMAS[0]))
    eng.add_request("s", "stream me", p)
    text = ""
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.outputs[0].text
    final = llm.generate(["stream me"], [SamplingParams(temperature=0.0, max_tokens=MAX,
                                                        structured_outputs=compact(SCHEMAS[0]))])[0].outputs[0]
    assert text == final.text
    cut = llm.generate(["stream me"], [SamplingParams(temperature=0.0, max_tokens=MAX, stop=['"age"'],
                                                      structured_outputs=compact(SCHEMAS[0]))])[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"' and final.text.startswith(cut.text)
    eng.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("so,needle", [   # {backend: what its error says}
    ({"json": {"type": "objectx"}}, {"xgrammar": "Unsupported type", "guidance": "Invalid type"}),
    ({"regex": "a(b"}, {"xgrammar": "parenthesis", "guidance": "invalid regex"}),
    ({"grammar": "root ::= undefined_rule"}, {"xgrammar": "not defined", "guidance": "not found"}),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, {}),
])
def test_bad_spec_fails_at_add_request(model_dir, so, needle, backend):
    needle = f"structured_outputs.{next(iter(so))} does not compile: .*{needle.get(backend, '')}"
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, structured_outputs_backend=backend)
    with pytest.raises(ValueError, match=needle):
        eng.add_request("bad", "x", SamplingParams(max_tokens=4, structured_outputs=so))
    assert not eng.has_unfinished_requests() and not eng.core.compiling
    eng.add_request("good", "x", SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-c]{4}"}))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert re.fullmatch("[a-c]{4}", outs[-1].outputs[0].text)
    eng.shutdown()


@pytest.mark.parametrize("so,needle", [
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"jsonx": {}}, "unknown fields"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON Schema object"),
    ({"json": 5}, "must be a JSON Schema"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be a non-empty list"),
    ({"json_object": False, "regex": "a"}, None),   # false is "not asked": the regex alone is fine
    ({"json_object": "yes"}, "json_object must be true"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be true or false"),
    ("regex", "must be an object"),
])
def test_bad_params_are_named(so, needle):
    if needle is None:
        assert SamplingParams(structured_outputs=so).structured_outputs.kind == "regex"
        return
    with pytest.raises(ValueError, match=needle):
        SamplingParams(structured_outputs=so)


def test_spec_size_is_bounded():
    from wideep.structured.params import MAX_SPEC_CHARS
    with pytest.raises(ValueError, match=f"structured_outputs.regex is {MAX_SPEC_CHARS + 1} characters"):
        SamplingParams(structured_outputs={"regex": "a" * (MAX_SPEC_CHARS + 1)})


def test_min_tokens_with_a_constraint_is_refused():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


def test_no_tokenizer_is_a_clear_error(tmp_path):
    import os
    d = make_tiny_checkpoint(str(tmp_path), arch="v3")
    os.remove(os.path.join(d, "tokenizer.json"))
    eng = Engine(d, progress=False, block_size=16, kv_cache_blocks=16)
    with pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
        eng.add_request("r", [5, 6], SamplingParams(structured_outputs={"regex": "a"}))
    eng.shutdown()


def test_unknown_backend_is_named(model_dir):
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of"):
        LLM(model_dir, progress=False, structured_outputs_backend="outlines")


def test_spec_key_and_compile_cache(model_dir):
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert a.key == b.key and a.json == b.json   # one spelling; property order kept (the output's order)
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=16)
    comp = eng.core.grammars
    g1 = comp.get(a)
    g2 = comp.get(b)
    assert g1 is g2 and comp.compiled == 1
    eng.shutdown()


def test_replayed_matcher_continues_where_the_output_is(model_dir):
    """A sequence that arrives with output tokens (re-admitted after a rank loss, or a decode-pool
    sequence) gets a matcher that has accepted them: its next bitmask allows only what follows."""
    import torch

    from wideep.engine.sched.sequence import Sequence
    from wideep.structured.rows import GrammarRows
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=16)
    tok = eng.core.tokenizer
    rows = GrammarRows(eng.core.grammars)
    p = SamplingParams(structured_outputs={"regex": "ab[cd]"})
    seq = Sequence("r", None, [5], p, 8, eos_token_ids=(1,), output_token_ids=tok.encode("ab").ids)
    plan = rows.plan([seq], [0])
    logits = torch.zeros(1, eng.core.config.vocab_size)
    rows.apply(logits, plan)
    allowed = torch.nonzero(logits[0] > float("-inf")).flatten().tolist()
    assert sorted(allowed) == sorted(tok.encode("c").ids + tok.encode("d").ids)
    eng.shutdown()


@pytest.mark.parametrize("B,rows", [(6, [0, 1, 2, 3, 4, 5]), (6, [1, 4, 5]), (6, [2]), (3, [0, 2])])
def test_masked_against_a_bit_by_bit_reference(B, rows):
    import torch

    from wideep.structured.backend import _unpack, mask_, unpack_shifts
    V = 77   # not a multiple of 32: the last word's high bits are past the vocabulary
    g = torch.Generator().manual_seed(B + len(rows))
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), (V + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(B, V, generator=g)
    want = logits.clone()
    for i, r in enumerate(rows):
        for t in range(V):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    mask_(logits, bitmask, rows)
    assert torch.equal(logits, want)
    assert torch.equal(_unpack(bitmask, V, "cpu"), unpack_shifts(bitmask, V))   # the device path, on the host


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_drafts_are_checked_against_the_grammar(model_dir, backend):
    """n-gram drafts (engine/spec_decode/) on constrained requests: cut at the first token the grammar refuses,
    each verification row masked to the grammar after the drafts before it. Greedy outputs equal the
    run without drafts; sampled ones stay valid; drafts were accepted."""
    suite = specs()
    prompts = [f"request {i}: answer" for i in range(len(suite))]
    greedy = [SamplingParams(temperature=0.0, max_tokens=MAX, structured_outputs=so) for so, _ in suite]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX, structured_outputs=so)
               for i, (so, _) in enumerate(suite)]
    kw = dict(progress=False, block_size=16, kv_cache_blocks=512, max_num_seqs=64, structured_outputs_backend=backend)
    plain = LLM(model_dir, **kw)
    spec = LLM(model_dir, speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                                  prompt_lookup_max=3), **kw)
    want = [o.outputs[0] for o in plain.generate(prompts, greedy)]
    got = [o.outputs[0] for o in spec.generate(prompts, greedy)]
    assert [(g.token_ids, g.finish_reason) for g in got] == [(w.token_ids, w.finish_reason) for w in want]
    for o, (_, chk) in zip(spec.generate(prompts, sampled), suite):
        assert o.outputs[0].finish_reason == "stop"
        check(chk, o.outputs[0].text)
    m = spec.engine.metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0, m["spec_decode_num_draft_tokens"]
    plain.shutdown()
    spec.shutdown()
