"""Stop strings and n > 1 through the Python API (Engine, LLM) on a tiny checkpoint with a tokenizer.

Stop strings are picked from a first greedy run's own text so that every case is deterministic: one
that spans two tokens, and the text, tokens, stop_reason and finish_reason that must come out; the
sequence must leave its rank (no more tokens, its blocks freed). Streaming (delta outputs) must never
show text that the final output does not have. n=2 samples share the prompt's full KV blocks (counted
on the rank) and differ at temperature 1; sample 0 with a seed is the n=1 request with that seed."""
from __future__ import annotations

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.engine.front.stop_strings import StopMatcher, find_stop, hold_back
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

PROMPT = "hello world"
MAX = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("stop")), arch="v3", seed=5, initializer_range=0.3)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**dict(dict(temperature=0.0, max_tokens=MAX, ignore_eos=True), **kw))


def run(eng: Engine, params: SamplingParams, prompt=PROMPT, rid: str = "r") -> list:
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    eng.step()   # the rank handles the front's abort of a stopped sequence
    return outs


@pytest.fixture(scope="module")
def first_run(model_dir):
    """-> (token ids, text after each token count) of the greedy run without stop strings."""
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32)
    ids = run(eng, greedy(output_kind="final_only"))[-1].outputs[0].token_ids
    tok = eng.core.tokenizer
    texts = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    eng.shutdown()
    return ids, texts


def spanning_stop(ids, texts) -> tuple[str, int, int]:
    """A 2-character stop string whose characters come from tokens k-1 and k (its first occurrence):
    -> (stop, k, its position in the text)."""
    for k in range(2, len(ids)):
        a, b = texts[k - 1], texts[k]
        if "\ufffd" in b or len(a) < 1 or len(b) <= len(a) or not b.startswith(a):
            continue
        stop = b[len(a) - 1:len(a) + 1]
        if b.find(stop) == len(a) - 1:
            return stop, k, len(a) - 1
    pytest.skip("the greedy text has no clean token boundary")


# speculative decoding (n-gram drafts) must not change what stop strings do: a step may then add several tokens
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_ends_the_request_on_its_rank(model_dir, first_run, include, spec):
    ids, texts = first_run
    stop, k, pos = spanning_stop(ids, texts)
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, speculative_config=spec)
    out = run(eng, greedy(stop=["never seen", stop], include_stop_str_in_output=include,
                          output_kind="final_only"))[-1]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == texts[k][:pos + (len(stop) if include else 0)]
    assert c.token_ids == ids[:k]              # the token that completed the stop string is the last
    assert not eng.core.scheduler.has_work()   # the front aborted it on its rank
    assert eng.core.blocks.num_used == eng.core.blocks.num_cached
    extra = spec["num_speculative_tokens"] if spec else 0
    assert eng.front.generated <= k + 1 + extra < MAX  # at most one step's tokens past the stop string
    eng.shutdown()


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_streamed_text_never_shows_a_partial_stop_string(model_dir, first_run, spec):
    ids, texts = first_run
    stop, k, pos = spanning_stop(ids, texts)
    longer = stop + "\x00never"                # a long stop string: a long tail is held back
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, speculative_config=spec)
    outs = run(eng, greedy(stop=[longer, stop], output_kind="delta"))
    shown = ""
    for o in outs:
        shown += o.outputs[0].text
        assert texts[k][:pos].startswith(shown), (shown, stop)
    assert shown == texts[k][:pos] and outs[-1].outputs[0].stop_reason == stop
    assert sum(len(o.outputs[0].token_ids) for o in outs) == k
    eng.shutdown()


def test_stop_reason_of_a_stop_token_and_none_otherwise(model_dir, first_run):
    ids, _ = first_run
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=32)
    t = ids[5]
    a, b = llm.generate([PROMPT, PROMPT], [greedy(stop_token_ids=[t]), greedy()])
    assert a.outputs[0].finish_reason == "stop" and a.outputs[0].stop_reason == t
    assert a.outputs[0].token_ids == ids[:ids.index(t) + 1]
    assert b.outputs[0].finish_reason == "length" and b.outputs[0].stop_reason is None
    # The stop token is no text (vLLM's rule), unless include_stop_str_in_output.
    tok = llm.tokenizer
    k = ids.index(t)
    assert a.outputs[0].text == tok.decode(ids[:k])
    (c,) = llm.generate([PROMPT], [greedy(stop_token_ids=[t], include_stop_str_in_output=True)])
    assert c.outputs[0].text == tok.decode(ids[:k + 1]) and c.outputs[0].token_ids == a.outputs[0].token_ids
    llm.shutdown()


def test_skip_special_tokens_false_keeps_them_in_the_text(model_dir, first_run):
    """Forced through logit_bias: the output is a special token; the default text drops it, and
    skip_special_tokens=False keeps it (what the chat endpoint's parsers read)."""
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=32)
    tok = llm.tokenizer
    think = tok.token_to_id("<think>")
    assert think is not None
    kw = dict(max_tokens=3, logit_bias={think: 100.0})
    a, b = llm.generate([PROMPT, PROMPT], [greedy(**kw), greedy(skip_special_tokens=False, **kw)])
    assert a.outputs[0].token_ids == [think] * 3 == b.outputs[0].token_ids
    assert "<think>" not in a.outputs[0].text and b.outputs[0].text == "<think>" * 3
    llm.shutdown()


def test_find_stop_and_hold_back():
    assert find_stop("abcdef", 0, ["cd", "x"]) == (2, "cd")
    assert find_stop("abcdef", 4, ["cd"]) is None              # searched before: not found again
    assert find_stop("abcdef", 3, ["cd"]) == (2, "cd")         # ends after start: found
    assert find_stop("abcdef", 0, ["de", "bcd"]) == (1, "bcd")  # the earliest
    assert hold_back(["a", "abcd"]) == 3 and hold_back([]) == 0



def test_stop_matcher_equals_find_stop():
    """The per-request regex matcher against the reference on text that grows a few characters at a
    time, searched from where the last miss left off (as the front does), with overlapping strings,
    one a prefix of another and regex metacharacters."""
    import random
    rng = random.Random(0)
    for trial in range(300):
        stops = rng.sample(["ab", "abc", "b", "a.c", "c*", "(a", "bca", "zz", "cab", "a" * 5], rng.randint(1, 4))
        m = StopMatcher(stops)
        assert m.hold == hold_back(stops)
        text, checked = "", 0
        while len(text) < 40:
            text += "".join(rng.choice("abcz.*(") for _ in range(rng.randint(1, 3)))
            want = find_stop(text, checked, stops)
            assert m.find(text, checked) == want, (stops, text, checked)
            if want is not None:
                break
            checked = len(text)

@pytest.mark.parametrize("bad,match", [
    (dict(stop=["x"] * 1000), "at most 128"), (dict(stop="x" * 600), "at most 512"),
    (dict(stop=[""]), "empty string"), (dict(stop=[1]), "a string or a list of strings"),
    (dict(n=0), r"n must be in \[1, 128\]"), (dict(include_stop_str_in_output=1), "true or false"),
    (dict(skip_special_tokens="no"), "skip_special_tokens must be True or False")])
def test_bad_stop_and_n_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_n2_shares_the_prompt_blocks_and_samples_differ(model_dir):
    prompt = list(range(2, 42))   # 40 tokens: 2 full blocks of 16 + 8
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, enable_prefix_caching=True)
    used = []
    eng.add_request("g", prompt, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            final = o
        if len(eng.core.scheduler.running) == 2:
            used.append(eng.core.blocks.num_used)
    # both running: 2 shared full blocks + one block each for the last 8 prompt tokens and outputs
    assert used and max(used) == 4, used
    assert eng.core.stats()["prefix_hit_tokens"] == 32
    assert final.finished and final.request_id == "g"
    a, b = final.outputs
    assert (a.index, b.index) == (0, 1) and len(a.token_ids) == len(b.token_ids) == 6
    assert a.token_ids != b.token_ids
    # sample 0 has the request's seed: it is the n=1 request with that seed
    one = run(eng, SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                                  output_kind="final_only"), prompt=prompt, rid="one")[-1]
    assert one.outputs[0].token_ids == a.token_ids
    eng.shutdown()


def test_n_with_delta_outputs_and_abort(model_dir):
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32)
    eng.add_request("d", PROMPT, SamplingParams(n=3, seed=1, max_tokens=5, ignore_eos=True, output_kind="delta"))
    got = {0: [], 1: [], 2: []}
    outs = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.append(o)
            for c in o.outputs:
                got[c.index] += c.token_ids
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(len(v) == 5 for v in got.values())
    eng.add_request("e", PROMPT, SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("e#1", PROMPT, SamplingParams())   # a live sample's id on its rank
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("e", PROMPT, SamplingParams())
    eng.step()
    eng.abort("e")
    last = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            last = o
    assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
    eng.shutdown()


def test_llm_generate_with_n_and_stop(model_dir, first_run):
    ids, texts = first_run
    stop, k, pos = spanning_stop(ids, texts)
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=32)
    a, b = llm.generate([PROMPT, [5, 6, 7]], [greedy(n=2, stop=stop), SamplingParams(n=2, max_tokens=4)])
    assert [c.index for c in a.outputs] == [0, 1] and all(c.text == texts[k][:pos] for c in a.outputs)
    assert [len(c.token_ids) for c in b.outputs] == [4, 4]


def _two_ranks(model_dir: str, stop: str, want_text: str, k: int) -> dict:
    """Rank 0 sends two stopped requests (least-loaded: one per rank) and an n=2 one; a stop string
    on rank 1 must end its sequence there."""
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, parallel={"timeout_s": 60.0})
    if eng.ctx.rank != 0:
        how = eng.run_worker_loop()
        b = eng.core.blocks
        return {"how": how, "free": b.num_free, "total": b.allocators["latent"].num_blocks,
                "work": eng.core.scheduler.has_work()}
    p = greedy(max_tokens=64, stop=stop, output_kind="final_only")
    for rid in ("a", "b"):
        eng.add_request(rid, PROMPT, p)
    eng.add_request("c", PROMPT, greedy(max_tokens=64, n=2, stop=stop, output_kind="final_only"))
    ranks = {rid: eng.front.rank_of(rid) for rid in "abc"}
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = [(c.text, len(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs]
    generated = eng.front.generated
    eng.shutdown()
    return {"ranks": ranks, "got": got, "generated": generated}


@pytest.mark.multirank
def test_stop_strings_end_requests_on_a_non_front_rank(model_dir, first_run):
    from tests.parallel.spawn import spawn
    ids, texts = first_run
    stop, k, pos = spanning_stop(ids, texts)
    front, worker = spawn(_two_ranks, 2, args=(model_dir, stop, texts[k][:pos], k), timeout_s=300)
    assert front["ranks"]["a"] == 0 and front["ranks"]["b"] == 1   # least-loaded: b is on rank 1
    want = (texts[k][:pos], k, "stop", stop)
    assert front["got"] == {"a": [want], "b": [want], "c": [want, want]}
    # every sequence left its rank soon after its stop string (not at max_tokens=64)
    assert front["generated"] < 4 * (k + 8) < 4 * 64
    assert worker["how"] == "shutdown" and not worker["work"] and worker["free"] == worker["total"]
